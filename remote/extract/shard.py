"""What the laptop needs to shard one extraction over many hosts (stdlib only).

A task module (``main(params) -> payload``); ``params["action"]`` picks the verb.

``probe``  the facts a shard map is planned from, in well under a second, nothing
           imported: the dataset's sample count (after ``max_samples``, the rows the
           supervisor will read) and a sha256 of exactly those rows (so hosts with
           different files are caught before global indices mean different samples),
           the engine this host runs and its layer convention, layer ids and sample file
           format (mixing them is silent), the model's config summary, the package
           versions, and the data-parallel width (devices // tp).
``files``  the sample files of one range ``[start, stop)`` in ``output_dir``, in either
           format (``data_{i}.pt``, or ``hidden_states/hs_{i}.safetensors``): global
           index, path, bytes and digest (taken from the run's manifest where it lists
           the file, in its algorithm; computed otherwise, BLAKE3 where the host has it), the first index of the range not on disk, and
           the token dataset an ``hs`` run writes beside its samples. Temp files of a
           killed writer never count.

Parameters: :data:`SPEC` (a run's parameters for ``probe``, ``output_dir``/``start``/``stop``
for ``files``). A group plan that preflights its hosts asks preflight instead
(``shard_probe``): :func:`probe` then runs in preflight's process, from the run plan
(:mod:`remote.extract.runplan`) preflight made, so each host answers from one python.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from remote.extract import runplan, samples
from remote.system import modelconfig
from remote.wire import contract, layers, manifest as run_manifest, protocol
from remote.wire.argspec import RUN_ARGS, Arg, Spec
from remote.wire.contract import param
from remote.wire.fsutil import file_digest

#: probe: the plan's shared-storage probe for this host (specops/storage.py probe_params).
STORAGE_PROBE = Arg("dict", options={
    "dir": Arg("path", doc="the run's output dir on this host"), "work_dir": Arg("path"),
    "token": Arg("str", required=True, doc="this host's marker name"),
    "others": Arg("dict", {}, doc="host -> its token")})
#: ``probe`` takes a run's parameters (as preflight does); ``files`` one range of an output dir.
SPEC = Spec("shard", RUN_ARGS, {
    "action": Arg("str", "probe", choices=("probe", "files")),
    "device": RUN_ARGS["device"].but(default="cuda"),
    "storage_probe": STORAGE_PROBE,
    "start": Arg("int", min=0), "stop": Arg("int", min=0),
    "sha256": Arg("bool", True, doc="files: hash the files no manifest lists (BLAKE3 where this host has "
                                    "it, else sha256; the name is older than BLAKE3)"),
}, required_if=[("action", "files", ("output_dir", "start", "stop"))])


@SPEC.task
def main(params: dict) -> dict:
    verbs = {"probe": probe, "files": files}
    try:
        return verbs[params["action"]](params)
    except protocol.TaskError as exc:
        return exc.payload()


# --------------------------------------------------------------------------- probe

def count_rows(dataset, max_samples) -> tuple:
    """``(rows, sha256)`` of the rows a run reads across its inputs (:func:`remote.extract.dataset.input_rows`),
    nothing parsed.

    The digest covers each row's bytes without its line ending, so the same rows with
    other blank lines or CRLF endings are the same samples.
    """
    from remote.extract.dataset import input_rows

    digest = hashlib.sha256()
    count = 0
    for _, _, line in input_rows(dataset, max_samples):
        digest.update(line.rstrip(b"\r\n") + b"\n")
        count += 1
    return count, digest.hexdigest()


def probe(params: dict, plan=None) -> dict:
    """The facts a shard map is planned from (see the module docstring).

    :param plan: the run's plan when the caller made it already (preflight, which runs this
        probe in its own process for a group plan); else resolved here.
    """
    protocol.apply_job_env(params)
    records, data = [], {}
    dataset = params["dataset"]
    from remote.extract.dataset import DatasetError, inputs_of

    missing = [str(p) for p in inputs_of(dataset) if not p.exists()]
    if not inputs_of(dataset) or missing:
        records.append(protocol.record("shard.dataset", protocol.FAIL,
                                       f"dataset {', '.join(missing) or dataset!r} does not exist",
                                       detail={"dataset": dataset, "missing": missing},
                                       fix="copy the dataset to the host, or fix 'dataset' for this host"))
    else:
        try:
            rows, digest = count_rows(dataset, params.get("max_samples"))
        except (DatasetError, OSError, ImportError) as exc:
            rows, digest, why = 0, None, str(exc)
        else:
            why = None
        sizes = [p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
                 for p in inputs_of(dataset)]
        data["dataset"] = {"path": dataset, "samples": rows, "sha256": digest, "bytes": sum(sizes),
                           "max_samples": params.get("max_samples")}
        status = protocol.OK if rows else protocol.FAIL
        shown = dataset if isinstance(dataset, str) else ", ".join(map(str, dataset))
        records.append(protocol.record("shard.dataset", status,
                                       why or f"{rows} samples in {shown} (after max_samples)",
                                       detail=data["dataset"],
                                       fix=None if rows else "fix the dataset named above" if why
                                       else "fill the dataset, or raise max_samples"))
    records.append(_stack(params, data, plan))
    records.append(_width(params, data))
    if params.get("storage_probe"):
        records.append(_storage(params["storage_probe"], data))
    data["versions"] = dict(samples.package_versions(), python=_python_version())
    return protocol.payload(records, **data)


def _python_version() -> str:
    import platform

    return platform.python_version()


def _stack(params: dict, data: dict, plan=None) -> dict:
    """Engine, layer convention, layer ids (in the output convention too) and file format: the
    run's plan (:func:`remote.extract.runplan.resolve`, as the supervisor will resolve it)."""
    try:
        engine = (plan.engine, plan.engine_why) if plan is not None else runplan.resolve_engine(params.get("engine"))
    except runplan.PlanError as exc:
        return protocol.record("shard.stack", protocol.FAIL, str(exc), detail={"asked": params.get("engine")},
                               fix="install the speculators that fits the host's vLLM, or set engine")
    name, why = engine
    fmt = contract.ENGINES[name].sample_format
    stack = {"engine": name, "engine_why": why, "convention": contract.ENGINES[name].convention,
             "format": fmt, "format_text": samples.FORMATS[fmt][2]}
    data["stack"] = stack
    try:
        config = modelconfig.read(params["model_path"])
        data["model"] = modelconfig.summary(config)
        plan = (plan or runplan.resolve(params, config, engine=engine)).require()
    except Exception as exc:  # the model is preflight's to judge; here only what the plan needs
        return protocol.record("shard.stack", protocol.FAIL, f"cannot resolve the layer ids: {exc}",
                               detail=stack, fix="run specops preflight on this host; it names the cause")
    data["plan"] = plan.as_dict()
    stack.update(layer_ids=plan.layer_ids, layer_ids_output=plan.ids(layers.OUTPUT), state_format=plan.state_format)
    return protocol.record("shard.stack", protocol.OK,
                           f"{name}: layers {plan.layer_ids} ({plan.convention} of layer i), files {fmt}",
                           detail=stack)


def _width(params: dict, data: dict) -> dict:
    """The host's data-parallel width in a group plan: the replicas it runs (:mod:`remote.extract.layout`)."""
    from remote.extract import layout as host_layout

    # a replica's head holds only its share of the ranks; the replica is one data-parallel unit
    tp = max(1, int((params.get("replica") or {}).get("ranks_per_node") or param(params, "tp")))
    kind, ids, error = host_layout.host_devices(params)
    layout = host_layout.resolve(params, tp, kind, ids, (data.get("stack") or {}).get("engine"))
    devices = {"kind": kind, "count": len(ids), "ids": ids, **({"error": error} if error else {})}
    width = 0 if layout.problem else layout.dp
    data["capacity"] = {"devices": devices, "tp": tp, "dp_width": width, "layout": layout.as_dict()}
    detail = data["capacity"]
    if layout.problem:
        fix = (f"set tp to at most {len(ids)} for this host" if ids and layout.dp == 1 else
               "set dp (and tp) so that dp x tp fits the devices, or leave dp out (its default fits)" if ids else
               "make a device usable on this host, or leave it out")
        return protocol.record("shard.capacity", protocol.FAIL, layout.problem, detail=detail, fix=fix)
    return protocol.record("shard.capacity", protocol.OK, f"{layout.text()}: data-parallel width {width}",
                           detail=detail)


PROBE_MARKER = samples.PROBE_MARKER_PREFIX + "{token}"


def _storage(asked: dict, data: dict) -> dict:
    """Whether this host's output dir for the run (and its work dir) is one another host of the plan sees.

    The laptop gives every host of a plan a token. Each host creates the dir (the run
    would), leaves a marker named by its own token, then looks up the others' markers by
    name (a lookup, not a listing, which NFS may serve from a stale cache). Of two hosts
    probing the same dir, at least the one that looks last sees the other's marker. The
    dir's ``st_dev``/``st_ino`` and the kernel's boot id say the same for hosts that
    are one machine (NFS clients see another ``st_dev`` for one export). The output
    dir's markers are removed when the run's supervisor claims the dir; a work dir's
    when a later probe finds them a day old.
    """
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = None
    found = {}
    for key, field in (("dir", "output_dir"), ("work_dir", "work_dir")):
        if not asked.get(key):
            continue
        where = Path(str(asked[key]))
        try:
            where.mkdir(parents=True, exist_ok=True)
            if key == "work_dir":
                _drop_stale_markers(where)
            (where / PROBE_MARKER.format(token=asked["token"])).write_text(str(asked["token"]))
            st = where.stat()
        except OSError as exc:
            return protocol.record("shard.storage", protocol.FAIL, f"cannot write into the {field} {where}: "
                                   f"{exc.strerror or exc}", detail={field: str(where)},
                                   fix=f"make {field} writable for this user on this host (or fix it in the inventory)")
        sees = sorted(host for host, token in (asked.get("others") or {}).items()
                      if (where / PROBE_MARKER.format(token=token)).exists())
        found[key] = {"dir": str(where), "st_dev": st.st_dev, "st_ino": st.st_ino, "boot_id": boot_id, "sees": sees}
    data["storage"] = dict(found.get("dir") or {}, work_dir=found.get("work_dir"))
    sees = data["storage"].get("sees") or []
    return protocol.record("shard.storage", protocol.OK,
                           f"output dir {data['storage'].get('dir')}"
                           + (f": also seen by {', '.join(sees)} (shared storage)" if sees else ""),
                           detail=data["storage"])


def _drop_stale_markers(where: Path, age_s: float = 86400.0) -> None:
    import time

    for name in os.listdir(where):
        if name.startswith(samples.PROBE_MARKER_PREFIX):
            try:
                if time.time() - (where / name).stat().st_mtime > age_s:
                    (where / name).unlink()
            except OSError:
                pass


# --------------------------------------------------------------------------- files

def present(out_dir, start: int, stop: int) -> dict:
    """``{index: path}`` of the complete sample files of ``[start, stop)`` in ``out_dir``, either format.

    What a resume goes by: the disk, whatever a status file says.
    """
    found = {}
    for fmt in samples.FORMATS:
        for index in samples.present_indices(out_dir, fmt):
            if start <= index < stop:
                found[index] = samples.sample_path(out_dir, index, fmt)
    return found


def files(params: dict) -> dict:
    """The samples of ``[start, stop)`` in ``output_dir`` (either format), in index order.

    ``path`` is relative to the output dir, as in the run's manifest; so is each of
    ``dataset_files`` (the token dataset an ``hs`` run writes beside its samples).
    A file the run's manifest lists with another size is ``changed`` (with the size and
    digest the manifest gives: ``manifest_bytes``, ``manifest_<algorithm>``), not in ``files``,
    and ends the gap-free prefix (``first_missing``): it is not the sample the run made.
    """
    out_dir = Path(params["output_dir"])
    start, stop = params["start"], params["stop"]
    # the dir's manifest and every range's own (a dir the shards of a run share holds several)
    manifest = samples.manifest_entries(out_dir)
    listed = {e["path"]: e for e in manifest.get("files") or [] if isinstance(e, dict) and e.get("path")}
    found = present(out_dir, start, stop)
    entries, changed, hashed = [], [], 0
    want_hash = params["sha256"]
    for index in sorted(found):
        path = found[index]
        rel = str(path.relative_to(out_dir))
        entry = {"index": index, "path": rel, "bytes": path.stat().st_size}
        known = listed.get(rel)
        known_digest = run_manifest.entry_digest(known) if known else None
        if known_digest and known.get("bytes") is not None and known["bytes"] != entry["bytes"]:
            # the run's manifest says what it wrote; a file of another size changed since (truncated,
            # overwritten): not the sample the run made, so it is flagged, never passed on as one
            name, value = known_digest
            changed.append({**entry, "manifest_bytes": known["bytes"], f"manifest_{name}": value})
            continue
        if known_digest and known.get("bytes") == entry["bytes"]:
            # the manifest's digest, in its own algorithm (an older run's sha256 stays sha256)
            entry.update({k: v for k, v in known.items() if k not in ("path", "index", "bytes")})
        elif want_hash:
            entry.update(file_digest(path))
            hashed += 1
        entries.append(entry)
    good = {e["index"] for e in entries}
    first_missing = start
    while first_missing in good:
        first_missing += 1
    missing = [i for i in range(start, stop) if i not in found]
    extra = []
    for name in manifest.get("dataset_files") or []:
        path = out_dir / name
        if path.is_file():
            extra.append({"path": name, "bytes": path.stat().st_size, **(file_digest(path) if want_hash else {})})
    rec = protocol.record("shard.files", protocol.OK,
                          f"{len(entries)} of {stop - start} sample(s) of [{start}, {stop}) in {out_dir}"
                          + (f"; {len(changed)} changed since the run wrote them" if changed else ""),
                          detail={"hashed_here": hashed, "from_manifest": len(entries) - hashed,
                                  "changed": len(changed)})
    return protocol.payload([rec], files=entries, changed=changed, first_missing=first_missing, missing=len(missing),
                            missing_head=missing[:20], output_dir=str(out_dir), manifest=bool(manifest["files"]),
                            hashed_here=hashed, dataset_files=extra)

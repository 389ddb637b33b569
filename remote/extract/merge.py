"""The host-side merge of a run's shards on one output dir (stdlib only): ``manifest.json`` there.

A task module (``main(params) -> payload``). When the hosts of a group run share one
output dir (one filesystem mounted on every node), every shard writes its samples into
the one layout its trainer reads, under global indices, and its own manifest under
``.specops-shards/<lo>-<hi>/`` (:mod:`remote.extract.samples`). This step reads those
manifests -- no sample file is read, nothing is copied to the laptop -- and writes one
manifest of every sample in the dir, by index, as ``<output_dir>/manifest.json``.

params: ``output_dir``, ``run_id``, ``ranges`` (optional ``[[lo, hi], ...]``: the
ranges the group expects in this dir; a missing one is reported, as is a sample of a
range that no shard's manifest lists).

The merge is refused (nothing written) when a range's manifest does not fit the schema
(:mod:`remote.wire.manifest`, which also merges the files), the ranges' manifests disagree on
what makes them one run (:data:`remote.extract.samples.IDENTITY_FIELDS`), belong to another run
id, overlap, or list one index twice.
"""
from __future__ import annotations

from pathlib import Path

from remote.extract import samples
from remote.wire import manifest, protocol
from remote.wire.argspec import Arg, Spec

SPEC = Spec("merge", {"output_dir": Arg("path", required=True), "run_id": Arg("str", required=True),
                      "ranges": Arg("list", doc="[[lo, hi], ...]: the ranges the group expects in this dir")})


@SPEC.task
def main(params: dict) -> dict:
    try:
        return merge(params)
    except protocol.TaskError as exc:
        return exc.payload()


def _fail(summary: str, fix: str, **detail) -> protocol.TaskError:
    return protocol.TaskError("merge.manifest", summary, fix, detail=detail)


def merge(params: dict) -> dict:
    out = Path(params["output_dir"])
    run_id = params["run_id"]
    if not out.is_dir():
        raise _fail(f"output dir {out} does not exist on this host", "pass the output dir the shards wrote to")
    claims = samples.read_claims(out)
    manifests = {}
    for tag in claims:
        try:  # a range with no manifest yet has not finished; one that does not fit the schema is refused
            manifests[tag] = manifest.read(out / samples.SHARDS_DIR / tag / samples.MANIFEST, manifest.FOR_MERGE)
        except FileNotFoundError:
            continue
        except manifest.ManifestError as exc:
            raise _fail(f"range {tag} of {out}: {exc}", "re-extract that range (its manifest is damaged)",
                        field=exc.field) from None
    own = {t: m for t, m in manifests.items() if m.get("run_id") == run_id}
    foreign = sorted({m.get("run_id") for m in manifests.values()} - {run_id})
    if foreign:
        raise _fail(f"{out} holds ranges of other run(s) {foreign} beside run {run_id!r}",
                    "give each run its own output dir; merge each run on its own", foreign=foreign)
    if not own:
        raise _fail(f"no range of run {run_id!r} in {out} has finished (no .specops-shards/*/manifest.json)",
                    "let the shards finish (specops status --run-id RUN), then merge again")
    order = sorted(own, key=lambda t: own[t]["sample_range"][0])
    first = own[order[0]]
    for tag, doc in own.items():
        differ = samples.identity_differences(first.get("identity") or {}, doc.get("identity") or {})
        if differ:
            raise _fail(f"ranges {order[0]} and {tag} of run {run_id!r} in {out} were made from other inputs: "
                        + "; ".join(differ), "re-extract the odd range with the run's inputs", differ=differ)
    ranges = sorted(tuple(m["sample_range"]) for m in own.values())
    expected = [tuple(r) for r in params.get("ranges") or ranges]
    parts = [manifest.Range(tag, *own[tag]["sample_range"], own[tag]["files"],
                            {"range": tag, "host": (own[tag].get("who") or claims[tag].get("who") or {}).get("host")})
             for tag in order]
    try:
        merged_files = manifest.merge(parts, expected=expected, strict=True)
    except manifest.MergeError as exc:
        raise _fail(f"run {run_id!r} in {out}: {exc.summary}", exc.fix, **exc.detail) from None
    missing = merged_files["missing"]
    missing_ranges = [list(r) for r in expected if shard_key(r) not in own]
    dataset_files = next((m["dataset_files"] for m in own.values() if m.get("dataset_files")), [])
    writer = samples.read_json_quietly(out / samples.TOKEN_DATASET_MARK) or {}
    if first.get("format_name") == samples.HS and not dataset_files:
        dataset_files = writer.get("files") or []
    merged = manifest.inherited(first)
    merged.update(merged_files)
    merged.update({
        "created_at": manifest.utc_now(),
        "merged_from": {tag: {"sample_range": own[tag]["sample_range"], "samples": own[tag].get("samples"),
                              "engine": own[tag].get("engine"), "host": claims[tag].get("who", {}).get("host"),
                              "created_at": own[tag].get("created_at")} for tag in sorted(own)},
        "sample_ranges": [list(r) for r in ranges],
        "missing": missing[:1000],
        "missing_ranges": missing_ranges,
        "dataset_files": dataset_files,
    })
    files = merged["files"]
    path = out / samples.MANIFEST
    manifest.write_atomic(path, merged, temp_prefix=samples.TEMP_PREFIX)
    status = protocol.OK if not missing else protocol.WARN
    summary = (f"{len(files)} sample(s) of {len(own)} range(s) in one manifest: {path}" if not missing else
               f"{len(files)} sample(s) merged into {path}; {len(missing)} missing (first {missing[:5]})")
    if first.get("format_name") == samples.HS and not dataset_files:
        status, summary = protocol.WARN, summary + "; the token dataset is not written yet"
    rec = protocol.record("merge.manifest", status, summary,
                          detail={"ranges": sorted(own), "missing_ranges": missing_ranges},
                          fix=None if status == protocol.OK else
                          "finish or resume the unfinished shards (specops status --run-id RUN), then merge again")
    return protocol.payload([rec], path=str(path), samples=len(files), complete=not missing, missing=len(missing),
                            ranges=sorted(own), tokens=merged["tokens"], dataset_files=dataset_files,
                            digest=samples.file_digest(path), bytes=path.stat().st_size)


def shard_key(sample_range) -> str:
    return samples.shard_tag(*sample_range)

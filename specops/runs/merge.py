"""The merged manifest of a group run, ``runs/R/manifest.json``: every sample once, by global index.

Its schema and the merge of the shards' files are the host's (``remote/wire/manifest.py``, the
``group`` document, :mod:`specops.wire.manifest`).
"""
from __future__ import annotations

from specops import wire
from specops.result import HostReport
from specops.runs.shardmap import GroupMap
from specops.runs.store import run_root


def merge(manifest: GroupMap, reports: dict[str, HostReport | None]) -> dict:
    """``runs/R/manifest.json``: every sample once, by global index, from the shard that owns it.

    A shard's listing entry outside its range (a cut shard's samples past its cut, made
    before it was stopped) is never used.
    """
    schema, name = wire.manifest, wire.contract.MANIFEST
    ranges = []
    for shard in manifest.shards:
        if shard.empty:
            continue
        report = reports.get(shard.id)
        listing = (report.data.get("listing") if report is not None and report.error is None else None) or {}
        ranges.append(schema.Range(shard.id, shard.start, shard.stop, listing.get("files") or [],
                                   {"shard": shard.id, "host": shard.head}))
    per_host = {}
    for shard in manifest.shards:
        # a shard's own manifest, fetched: one that is not there (or not usable) adds nothing
        found = schema.read_quietly(run_root(manifest.run_id) / "hosts" / shard.head / shard.run_id / name)
        if found is not None:
            per_host[shard.id] = found
    some = next(iter(per_host.values()), {})
    merged = {
        "run_id": manifest.run_id,
        "created_at": schema.utc_now(),
        "total": manifest.total,
        **schema.merge(ranges, strict=False),
        "format": some.get("format") or manifest.stack.get("format_text"),
        "format_name": manifest.stack.get("format"),
        "layer_ids": manifest.stack.get("layer_ids"),
        "layer_convention": manifest.stack.get("convention"),
        "layer_convention_text": some.get("layer_convention_text"),
        "model": some.get("model") or {"config": manifest.stack.get("model")},
        "dataset": manifest.dataset,
        "shard_map": [{"id": s.id, "hosts": s.hosts, "range": [s.start, s.stop], "run_id": s.run_id,
                       "moved_from": s.moved_from, "moved_to": s.moved_to} for s in manifest.shards],
        "hosts": {h: {"engine": info.get("engine"), "versions": info.get("versions")}
                  for h, info in manifest.hosts.items()},
        "engines": {sid: m.get("engine") for sid, m in per_host.items()},
        "canaries": {sid: m["canary"] for sid, m in per_host.items() if m.get("canary") is not None},
        "dataset_reports": {sid: m["dataset_report"] for sid, m in per_host.items()
                            if m.get("dataset_report") is not None},
        "file_layer_ids": some.get("file_layer_ids"),
        "dataset_files": some.get("dataset_files") or [],
        # the states' dtype (bf16/fp8): every shard's plan agreed on it (group.stack)
        "state_format": some.get("state_format") or manifest.stack.get("state_format"),
        "scales_key": some.get("scales_key"),
        "hidden_states_backend": some.get("hidden_states_backend"),
    }
    schema.write_atomic(run_root(manifest.run_id) / name, merged, mode=0o644)
    return merged

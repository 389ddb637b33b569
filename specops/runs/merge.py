"""The merged manifest of a group run, ``runs/R/manifest.json``: every sample once, by global index."""
from __future__ import annotations

import json
import os
import time

from specops.result import HostReport
from specops.runs.store import run_root
from specops.shards import FleetManifest


def merge(manifest: FleetManifest, reports: dict[str, HostReport | None]) -> dict:
    """``runs/R/manifest.json``: every sample once, by global index, from the shard that owns it."""
    files, missing = [], []
    for shard in manifest.shards:
        if shard.empty:
            continue
        report = reports.get(shard.id)
        listing = (report.data.get("listing") if report is not None and report.error is None else None) or {}
        by_index = {int(e["index"]): e for e in listing.get("files") or []}
        for index in range(shard.start, shard.stop):
            entry = by_index.get(index)
            if entry is None:
                missing.append(index)
                continue
            files.append({**entry, "index": index, "shard": shard.id, "host": shard.head})
    per_host = {}
    for shard in manifest.shards:
        path = run_root(manifest.run_id) / "hosts" / shard.head / shard.run_id / "manifest.json"
        if path.is_file():
            per_host[shard.id] = json.loads(path.read_text())
    some = next(iter(per_host.values()), {})
    merged = {
        "run_id": manifest.run_id,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "total": manifest.total,
        "samples": len(files),
        "complete": not missing,
        "missing": missing,
        "tokens": sum(int(f.get("tokens") or 0) for f in files),
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
        "file_layer_ids": some.get("file_layer_ids"),
        "dataset_files": some.get("dataset_files") or [],
        "files": files,
    }
    path = run_root(manifest.run_id) / "manifest.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(merged, indent=2))
    os.replace(tmp, path)
    return merged

"""``fetch`` of a group run: every shard's files into ``runs/R/hosts/``, then the merged result."""
from __future__ import annotations

from pathlib import Path

from specops import storage, wire
from specops.errors import SpecopsError
from specops.exit_codes import ExitCode
from specops.inventory import Inventory
from specops.report import console
from specops.result import HostReport, Record, overall_exit
from specops.runs import hostjob
from specops.runs.merge import merge
from specops.runs.pool import FILES_TIMEOUT_S, QUICK_TIMEOUT_S, per_shard, shard_files
from specops.runs.shardmap import GroupMap, Shard
from specops.runs.store import GROUP, load_manifest, run_root, save_manifest
from specops.runs.view import print_group, shard_table
from specops.transport.host import Host
from specops.transport.pool import HostPool


def fetch(manifest: GroupMap, conns: HostPool, *, tensors: bool) -> list[HostReport]:
    """Every shard's run files into ``runs/R/hosts/``; the merged manifest (and samples) once all are done.

    Each host is fetched on its own thread; a host that does not answer is reported and
    the others are fetched regardless. Samples are taken from the shard whose range
    holds their index, so a cut shard's samples past its cut (made before it was
    stopped) are never used.
    """
    root = run_root(manifest.run_id)
    shards = [s for s in manifest.shards if not s.empty]

    def one(shard: Shard, host: Host) -> HostReport:
        report = hostjob.fetch_run(host, shard.run_id, tensors=False, dest_root=root / "hosts", timeout=QUICK_TIMEOUT_S)
        report.host = shard.label
        report.records.extend(_worker_runs(shard, conns, root))
        # hashing on the host (files no manifest lists yet) reads every byte: a long bound, not none
        files = shard_files(host, shard, sha256=True, timeout=FILES_TIMEOUT_S)
        report.data["listing"] = files
        changed = files.get("changed") or []
        if changed:  # never fetched, never merged: a good copy fetched before stays as it is
            paths = [c["path"] for c in changed]
            report.records.append(Record(
                name="group.changed", status="fail",
                summary=f"{len(changed)} sample file(s) of [{shard.start}, {shard.stop}) on {shard.head} changed since "
                        f"its run wrote them ({', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''}: size differs "
                        f"from the host's manifest); not fetched, not merged",
                detail={"changed": changed},
                fix=f"the copy on {shard.head} is damaged: remove it there ({files.get('output_dir')}/{paths[0]}"
                    f"{' ...' if len(paths) > 1 else ''}), then specops extract --run-id {manifest.run_id} makes it "
                    f"again"))
        have = len(files.get("files") or [])
        if have == shard.size:
            report.records.append(Record(name="group.files", status="ok",
                                         summary=f"all {have} sample(s) of [{shard.start}, {shard.stop}) on "
                                                 f"{shard.head}", detail={"hashed_on_host": files.get("hashed_here")}))
        else:
            report.records.append(Record(
                name="group.files", status="warn",
                summary=f"{have} of {shard.size} sample(s) of [{shard.start}, {shard.stop}) on {shard.head} yet "
                        f"(first missing {files.get('first_missing')})",
                detail={"missing_head": files.get("missing_head")},
                fix=f"let the run finish (specops status --run-id {manifest.run_id}), or resume it: specops extract "
                    f"--run-id {manifest.run_id}"))
        if tensors and files.get("files"):
            report.records.append(hostjob.download_files(host, host.remote_path(files["output_dir"]), files["files"],
                                                      root / "samples", name="group.tensors"))
        return report

    reports = per_shard(shards, manifest, conns, "fetch", one, timeout=0)
    by_label = {r.host: r for r in reports}
    # an hs run writes the token dataset (every row) beside its samples: one copy serves the merged dir
    with_dataset = [s for s in shards if ((by_label.get(s.label) or HostReport(host="", task="")).data.get(
        "listing") or {}).get("dataset_files")]
    if tensors and with_dataset:
        source = with_dataset[0]
        listing = by_label[source.label].data["listing"]
        host = conns.for_shard(manifest, source)
        by_label[source.label].records.append(hostjob.download_files(
            host, host.remote_path(listing["output_dir"]), listing["dataset_files"], root / "samples",
            name="group.dataset_files"))
    merged = merge(manifest, {s.id: by_label.get(s.label) for s in shards})
    # the merged dir must hold what the merged manifest names (a download that failed leaves none)
    absent = [f["path"] for f in merged["files"] if tensors and not _local_copy_ok(root / "samples", f)]
    # a dir the shards share gets its merged manifest there, made on a host of it (no tensor moves)
    reports += storage.host_merges(manifest, conns, root)
    merged_path = root / wire.contract.MANIFEST
    group = HostReport(host=GROUP, task="fetch", data={"dest": str(root), "manifest": str(merged_path)})
    if absent:
        group.records.append(Record(
            name="group.merge", status="fail",
            summary=f"{len(absent)} of {merged['samples']} merged sample file(s) are not in {root / 'samples'} "
                    f"({', '.join(absent[:3])}{', ...' if len(absent) > 3 else ''})",
            detail={"absent": absent[:50], "missing_head": merged["missing"][:50]},
            fix=f"see the download records above; fetch again (specops fetch --run-id {manifest.run_id} --tensors)"))
    elif merged["complete"]:
        group.records.append(Record(name="group.merge", status="ok",
                                    summary=f"{merged['samples']} sample(s) of {manifest.total} in one manifest "
                                            f"({merged_path})"
                                            + (f", files in {root / 'samples'}" if tensors else "")))
    else:
        group.records.append(Record(
            name="group.merge", status="warn",
            summary=f"{merged['samples']} of {manifest.total} sample(s) so far; {len(merged['missing'])} missing "
                    f"(first {merged['missing'][:5]})",
            detail={"missing_head": merged["missing"][:50]},
            fix=f"finish or resume the unfinished shards (specops status --run-id {manifest.run_id}), then fetch "
                f"again"))
    save_manifest(manifest)
    return [*reports, group]


def _worker_runs(shard: Shard, conns: HostPool, root: Path) -> list[Record]:
    """The run files (logs, status, params) of each worker host of a replica shard, into
    ``runs/R/hosts/<worker>/<run id>/`` beside the head's: their ranks' logs are on them only."""
    records = []
    for worker in shard.hosts[1:]:
        try:
            got = hostjob.fetch_run(conns.host(worker), shard.run_id, tensors=False, dest_root=root / "hosts",
                                 timeout=QUICK_TIMEOUT_S)
        except SpecopsError as exc:
            records.append(Record(name=f"fetch.run@{worker}", status="warn",
                                  summary=f"{worker} (ranks of {shard.label}) did not answer: "
                                          f"{str(exc).splitlines()[0]}; its logs are not fetched",
                                  fix=f"once {worker} answers, fetch again (specops fetch --run-id {shard.run_id})"))
            continue
        records.extend(r.model_copy(update={"name": f"{r.name}@{worker}"}) for r in got.records)
    return records


def _local_copy_ok(local_dir: Path, entry: dict) -> bool:
    """The fetched copy of a merged sample is there, whole (its digest was checked when it came)."""
    path = local_dir / entry["path"]
    try:
        return path.stat().st_size == int(entry["bytes"])
    except OSError:
        return False


def fetch_run_id(inventory: Inventory, run_id: str, *, tensors: bool, as_json: bool,
                 accept_new_host_key: bool = False) -> ExitCode:
    manifest = load_manifest(run_id)
    conns = HostPool(inventory, accept_new_host_key)
    try:
        reports = fetch(manifest, conns, tensors=tensors)
    finally:
        conns.close()
    print_group(reports, as_json=as_json)
    if not as_json:
        console.print(shard_table(manifest, {}))
    return overall_exit(reports)

"""Hosts of a group run that share one output dir (one filesystem mounted on every node).

At plan time every host's shard probe (``remote/extract/shard.py``) leaves a marker named by a
token of its own in the run's output dir and looks up the other hosts' markers: two
hosts share the dir when either sees the other's marker (of two hosts probing one dir
at once, the one that looks last always sees the first's), or when they are one
machine (same kernel boot id) and see the same ``st_dev``/``st_ino``.

Sharing changes nothing of the shard map: each shard still writes its own range, under
global indices, into the one sample layout its trainer reads; its own manifest, summary
and claim go under ``.specops-shards/<lo>-<hi>/`` there. After the run, the merged
manifest of the shared dir is made on a host of it (``remote/extract/merge.py``: it reads the
shards' manifests, not the samples) and comes back to the laptop without a tensor.
"""
from __future__ import annotations

import secrets
from pathlib import Path

from specops.result import STATE, HostReport, Record
from specops.runs import hostjob
from specops.transport.parallel import report_from_payload, run_steps

#: the record name of the plan's verdict in the recap.
RECORD = "group.storage"
WORK_RECORD = "group.work_dir"
#: seconds for the host-side merge (it reads the shards' manifests, never a sample)
MERGE_TIMEOUT_S = 600.0


def probe_params(names: list[str], dirs: dict[str, str], work_dirs: dict[str, str] | None = None) -> dict[str, dict]:
    """Each host's ``storage_probe`` parameter: the run's output dir (and work dir) there, its token,
    the others' tokens."""
    tokens = {name: secrets.token_hex(8) for name in names}
    return {name: {"dir": dirs[name], "token": tokens[name], "work_dir": (work_dirs or {}).get(name),
                   "others": {other: tokens[other] for other in names if other != name}} for name in names}


def shared_groups(probes: dict[str, dict], which: str = "output") -> list[list[str]]:
    """Hosts that see one output dir (``which="work"``: one work dir), as groups of two or more."""
    def facts(p: dict) -> dict:
        st = p.get("storage") or {}
        return (st.get("work_dir") or {}) if which == "work" else st

    seen = {h: facts(p) for h, p in probes.items()}
    parent = {h: h for h in probes}

    def root(h: str) -> str:
        while parent[h] != h:
            h = parent[h]
        return h

    names = list(probes)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            sa, sb = seen[a], seen[b]
            if not sa or not sb:
                continue
            same_machine = sa.get("boot_id") and sa.get("boot_id") == sb.get("boot_id") and \
                (sa.get("st_dev"), sa.get("st_ino")) == (sb.get("st_dev"), sb.get("st_ino"))
            if b in (sa.get("sees") or []) or a in (sb.get("sees") or []) or same_machine:
                parent[root(b)] = root(a)
    groups: dict[str, list[str]] = {}
    for h in names:
        groups.setdefault(root(h), []).append(h)
    return [g for g in groups.values() if len(g) > 1]


def plan_records(probes: dict[str, dict], run_id: str) -> tuple[list[Record], list[list[str]]]:
    """The recap's word on storage, and the groups of hosts that share an output dir.

    A shared output dir is fine (each shard writes its own range); a shared work dir is
    not: every host keeps run ``R`` in ``<work_dir>/runs/R``, so the shards' run dirs
    (params, status, pid, logs) would be one.
    """
    records = []
    work = shared_groups(probes, "work")
    if work:
        where = {g[0]: ((probes[g[0]].get("storage") or {}).get("work_dir") or {}).get("dir") for g in work}
        said = "; ".join(f"{', '.join(g)} share one work dir ({where[g[0]]})" for g in work)
        records.append(Record(name=WORK_RECORD, status="fail",
                              summary=f"{said}: the run dir of {run_id} (params, status, pid, logs) would be one "
                                      f"for several shards",
                              detail={"work_dir_groups": work},
                              fix="give each host its own work_dir in the inventory (e.g. work_dir: "
                                  "~/.specops/<host name>, or a node-local disk); the output dir may stay shared"))
    groups = shared_groups(probes)
    if not groups:
        records.append(Record(name=RECORD, status="ok",
                              summary=f"each of the {len(probes)} host(s) has its own output dir"))
        return records, []
    said = "; ".join(f"{', '.join(g)} share one output dir ({(probes[g[0]].get('storage') or {}).get('dir')})"
                     for g in groups)
    records.append(Record(name=RECORD, status="ok",
                          summary=f"shared storage: {said}. Each shard writes only its range there (global indices, "
                                  f"one layout) and keeps its own manifest under .specops-shards/; fetch makes the "
                                  f"merged manifest on the host",
                          detail={"groups": groups, "storage": {h: p.get("storage") for h, p in probes.items()}}))
    return records, groups


def remember(manifest, probes: dict[str, dict], groups: list[list[str]]) -> None:
    """Keep in the group manifest which hosts share an output dir (fetch merges there)."""
    for host, probe in probes.items():
        info = manifest.hosts.setdefault(host, {})
        info["storage"] = dict(probe.get("storage") or {},
                               shared_with=next((g for g in groups if host in g), [host]))


def host_merges(manifest, conns, root: Path) -> list[HostReport]:
    """For each output dir shared by shards of the run: the merged manifest made there, and a copy here.

    Only shards of the group's own run id count (a moved range has a dir of its own).
    The copy lands in ``runs/R/shared/<hosts>/manifest.json``, checked by its digest. One
    host per dir, all dirs at once; a host that does not answer is a report, not a crash.
    """
    jobs_by_group: dict[tuple[str, ...], list] = {}
    for shard in manifest.shards:
        group = tuple((manifest.hosts.get(shard.head) or {}).get("storage", {}).get("shared_with") or ())
        if len(group) > 1 and not shard.empty and shard.run_id == manifest.run_id:
            jobs_by_group.setdefault(group, []).append(shard)

    def one(item) -> HostReport:
        group, members = item
        name = f"shared@{'+'.join(group)}"
        unfinished = [s.label for s in members if s.seen.get("state") != STATE.DONE]
        if unfinished:  # a shard's own manifest exists only once it is done; nothing is merged before
            return HostReport(host=name, task="fetch", records=[Record(
                name="merge.manifest", status="skipped",
                summary=f"not merging the shared dir yet: {', '.join(unfinished)} not done")])
        first = members[0]
        host = conns.for_shard(manifest, first)
        payload = host.run_task("merge", {"output_dir": first.output_dir, "run_id": manifest.run_id,
                                          "ranges": [[s.start, s.stop] for s in members]}, timeout=MERGE_TIMEOUT_S)
        report = report_from_payload(name, "fetch", payload)
        data = report.data = {k: v for k, v in (payload.get("data") or {}).items() if k != "dataset_files"}
        if data.get("path"):
            local = root / "shared" / "+".join(group)
            remote = Path(data["path"])
            report.records.append(hostjob.download_files(
                host, host.remote_path(str(remote.parent)),
                [{"path": remote.name, "bytes": data["bytes"], **data["digest"]}], local,
                name="group.shared_manifest"))
            data["local"] = str(local / remote.name)
        return report

    items = list(jobs_by_group.items())
    return run_steps(items, one, name_of=lambda item: f"shared@{'+'.join(item[0])}", task="fetch",
                     timeout=MERGE_TIMEOUT_S)

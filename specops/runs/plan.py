"""Plan a group run: probe every host at once, check that they agree, rehearse, write the shard map."""
from __future__ import annotations

import json

from specops import storage
from specops.errors import UsageError
from specops.params import run_params
from specops.preflight import preflight_step
from specops.replica import node_params, preflight_replicas, replica_overrides
from specops.result import HostReport, Record
from specops.runs import shardmap
from specops.runs.shardmap import GroupMap
from specops.runs.store import GROUP, save_manifest
from specops.transport.host import Host
from specops.transport.parallel import report_from_payload, run_steps, step_timeout
from specops.transport.pool import HostPool

#: run parameters that decide what sample i is: every host must have the same value.
SHARED_PARAMS = {"max_samples": "--max-samples", "seq_len": "--seq-len", "layer_ids": "--layer-ids",
                 "layer_convention": "--layer-ids (its output:/input: prefix)"}


def check_shared_params(specs, overrides: dict) -> dict[str, dict]:
    """Each host's run params; the ones that decide sample i must agree, or a usage error names them."""
    params = {spec.name: run_params(spec, **overrides) for spec in specs}
    for key, flag in SHARED_PARAMS.items():
        values = {name: p[key] for name, p in params.items()}
        if len({json.dumps(v) for v in values.values()}) > 1:
            said = ", ".join(f"{name}={value}" for name, value in values.items())
            raise UsageError(f"the hosts disagree on {key} ({said}): sample i would not be the same sample on "
                             f"every host", f"pass {flag} to give every host one value, or make them equal in "
                                            f"the inventory")
    return params


#: the names of the shard probe's records (``remote/extract/shard.py``), which a preflight of a plan carries too.
SHARD_RECORDS = "shard."


def probe_step(host: Host, overrides: dict, *, preflight: bool, storage_probe: dict | None = None) -> HostReport:
    """Preflight (failures only) and the shard probe of one host, in one host python; ``data["probe"]``
    holds its facts.

    :param storage_probe: the plan's shared-storage probe for this host (:mod:`specops.storage`).
    """
    report = HostReport(host=host.name, task="extract")
    asked = {"storage_probe": storage_probe} if storage_probe else {}
    if not preflight:
        inventory = getattr(host, "inventory", None)
        node = node_params(inventory, host.name) if inventory is not None else {}
        payload = host.run_task("shard", {**run_params(host.spec, **overrides), **node, "action": "probe", **asked})
        report.records.extend(report_from_payload(host.name, "extract", payload).records)
        report.data["probe"] = payload.get("data") or {}
        return report
    # one host python: preflight runs the shard probe too, from the run's plan it made
    pre = preflight_step(host, overrides, skip_autoconfig=True, shard_probe=asked)
    checks = [r for r in pre.records if not r.name.startswith(SHARD_RECORDS)]
    failed = [r for r in checks if r.status == "fail"]
    report.records.extend(failed)
    report.records.append(Record(
        name="group.preflight", status="fail" if failed else "ok",
        summary=(f"preflight found {len(failed)} failure(s)" if failed
                 else f"preflight passed ({len(checks)} checks)"),
        fix=("fix the failures above (specops preflight --on HOST shows every check), or leave this host out "
             "(--allow-partial starts on the ready hosts)") if failed else None))
    report.records.extend(r for r in pre.records if r.name.startswith(SHARD_RECORDS))
    report.data["probe"] = pre.data.get("shard") or {}
    return report


def _describe_stack(stack: dict) -> str:
    return (f"{stack.get('engine')} writes {stack.get('format')} ({stack.get('state_format') or 'bf16'}), layers {stack.get('layer_ids')} "
            f"({stack.get('convention')} of layer i)")


def agreement(probes: dict[str, dict], expected: GroupMap | None = None) -> list[Record]:
    """Whether the hosts (and, with ``expected``, an existing run) agree on dataset, model and stack.

    Different engines are fine when they write the same files: the same sample format
    and the same tensors (layer ids compared in one convention).
    """
    records = []
    datasets = {h: (p["dataset"]["samples"], p["dataset"]["sha256"]) for h, p in probes.items()}
    if expected is not None:
        datasets = {**{f"run {expected.run_id}": (expected.dataset.get("samples"), expected.dataset.get("sha256"))},
                    **datasets}
    if len(set(datasets.values())) > 1:
        said = "; ".join(f"{h}: {n} samples, sha256 {d[:12]}" for h, (n, d) in datasets.items())
        records.append(Record(name="group.dataset", status="fail",
                              summary=f"the hosts' datasets differ ({said}): index i would name different samples",
                              detail={"datasets": {h: {"samples": n, "sha256": d} for h, (n, d) in datasets.items()}},
                              fix="copy the same dataset file to every host (same rows, same order)"))
    else:
        (count, digest), = set(datasets.values())
        records.append(Record(name="group.dataset", status="ok",
                              summary=f"{len(probes)} host(s) read the same {count} samples (sha256 {digest[:12]})"))
    stacks = {h: p.get("stack") or {} for h, p in probes.items()}
    if expected is not None:
        stacks = {f"run {expected.run_id}": expected.stack, **stacks}
    keys = {h: (s.get("convention"), s.get("format"), tuple(s.get("layer_ids_output") or ()),
                s.get("state_format") or "bf16")
            for h, s in stacks.items()}
    if len(set(keys.values())) > 1:
        said = "; ".join(f"{h}: {_describe_stack(s)}" for h, s in stacks.items())
        records.append(Record(name="group.stack", status="fail",
                              summary=f"mixed stacks: the hosts would write different files ({said})",
                              detail={"stacks": stacks},
                              fix="make every host write the same files: pin --engine, or give --layer-ids "
                                  "output:... naming the same tensors; or leave the odd host out of --on"))
    else:
        engines = sorted({s["engine"] for s in stacks.values() if s.get("engine")})
        first = next(iter(stacks.values()))
        records.append(Record(name="group.stack", status="ok",
                              summary=f"one stack: {first.get('format')}, layers {first.get('layer_ids')} "
                                      f"({first.get('convention')} of layer i); engine(s) {', '.join(engines)}"))
    models = {h: p.get("model") for h, p in probes.items()}
    if expected is not None:
        models = {f"run {expected.run_id}": (expected.stack or {}).get("model"), **models}
    if len({json.dumps(m, sort_keys=True) for m in models.values()}) > 1:
        records.append(Record(name="group.model", status="fail",
                              summary="the hosts' models differ: " + "; ".join(
                                  f"{h}: {(m or {}).get('model_type')} {(m or {}).get('num_hidden_layers')} layers "
                                  f"hidden {(m or {}).get('hidden_size')}" for h, m in models.items()),
                              detail={"models": models},
                              fix="point model_path of every host at a copy of the same model"))
    return records


def _weights(mode: str, given: dict | None, probes: dict[str, dict]) -> dict[str, float]:
    if mode == "weights":
        return dict(given or {})
    if mode == "equal":
        return {h: 1.0 for h in probes}
    return shardmap.capacity_weights({h: (p.get("capacity") or {}).get("dp_width") for h, p in probes.items()})


def shard_output_dir(spec, overrides: dict, run_id: str) -> str:
    # each run owns its own output dir: a new run never "resumes" from another's samples
    return f"{run_params(spec, **overrides)['output_dir'].rstrip('/')}/{run_id}"


def _why_not_ready(report: HostReport) -> str:
    if report.error is not None:
        return report.error.splitlines()[0]
    failed = [r.name for r in report.records if r.status == "fail" and r.name != "group.preflight"]
    return f"{len(failed)} failed check(s): {', '.join(failed[:3])}" + (", ..." if len(failed) > 3 else "")


def rehearse_hosts(names: list[str], conns: HostPool, overrides: dict, force: bool,
                   reports: list[HostReport], real: bool = False, twin: bool = True) -> list[str]:
    """Smoke on every named host at once (each host's records join its report in ``reports``);
    returns the hosts whose rehearsal failed. ``twin``: on the tiny twin; ``real``: on the real model
    (after the twin, where it passed)."""
    smoked = run_steps([conns.host(n) for n in names],
                       lambda h: HostReport(host=h.name, task="extract",
                                            records=_rehearse_both(h, overrides, force, twin, real)),
                       name_of=lambda h: h.name, task="smoke", on_timeout=lambda h: h.close())
    by_host = {r.host: r for r in reports}
    for report in smoked:
        records = report.records if report.error is None else [Record(
            name="group.smoke", status="fail", summary=f"smoke on {report.host}: {report.error.splitlines()[0]}",
            fix="fix the host, or pass --skip-smoke")]
        by_host[report.host].records.extend(records)
    return [r.host for r in smoked if r.failed]


def _rehearse_both(host, overrides: dict, force: bool, twin: bool, real: bool) -> list:
    from specops.smoke import rehearse

    records = rehearse(host, overrides, force=force, name="group.smoke") if twin else []
    if real and not any(r.status == "fail" for r in records):
        records += rehearse(host, overrides, force=force, name="group.smoke", real=True)
    return records


def plan(run_id: str, overrides: dict, specs, conns: HostPool, *, shard_by: str | None, allow_partial: bool,
         skip_preflight: bool, skip_smoke: bool = False, force: bool = False, smoke_real: bool = False
         ) -> tuple[GroupMap | None, list[HostReport]]:
    """Probe every host at once and write the shard map; (None, reports) when the run must not start.

    The smoke rehearsal runs once the hosts agree (a mismatch is found in seconds, without a
    twin's load); a host whose rehearsal fails is not ready.
    """
    inventory = conns.inventory
    # the units of the run: a host that holds a whole replica, or a replica's hosts (head first);
    # a replica is one shard, planned and probed through its head
    units = inventory.units([s.name for s in specs])
    check_shared_params([conns.spec(h) for h in units], overrides)
    names = list(units)
    node_overrides = {n: replica_overrides(inventory, n, overrides) for n in names}
    mode, given = shardmap.parse_shard_by(shard_by, names)
    storage_probes = storage.probe_params(names, {n: shard_output_dir(conns.spec(n), overrides, run_id) for n in names},
                                          {n: run_params(conns.spec(n), **overrides)["work_dir"] for n in names})
    reports = run_steps([conns.host(n) for n in names],
                        lambda h: probe_step(h, node_overrides[h.name], preflight=not skip_preflight,
                                             storage_probe=storage_probes[h.name]), name_of=lambda h: h.name,
                        task="extract", timeout=step_timeout("preflight"), on_timeout=lambda h: h.close())
    if not skip_preflight:  # a replica's hosts, all at once: versions, model copy, master port, devices, clocks
        checked = preflight_replicas(inventory, names, conns.host, overrides)
        for report in reports:
            report.records.extend(checked.get(report.host, []))
    ready = [r.host for r in reports if not r.failed]
    group = HostReport(host=GROUP, task="extract")
    left_out = {r.host: _why_not_ready(r) for r in reports if r.failed}
    if left_out:
        if not ready or not allow_partial:
            group.records.append(Record(
                name="group.ready", status="fail",
                summary=f"{len(ready)} of {len(names)} host(s) ready ({', '.join(ready) or 'none'}); not ready: "
                        + "; ".join(f"{h}: {why}" for h, why in left_out.items()),
                detail={"ready": ready, "not_ready": left_out},
                fix=("fix the hosts above and run the same command again, or start on the ready hosts only "
                     "with --allow-partial") if ready else "fix the hosts above and run the same command again"))
            return None, [*reports, group]
        group.records.append(Record(name="group.ready", status="warn",
                                    summary=f"--allow-partial: starting on {', '.join(ready)}; left out: "
                                            + "; ".join(f"{h}: {why}" for h, why in left_out.items()),
                                    detail={"ready": ready, "not_ready": left_out}))
        if mode == "weights":
            given = {h: w for h, w in (given or {}).items() if h in ready}
    else:
        group.records.append(Record(name="group.ready", status="ok", summary=f"all {len(names)} hosts ready"))
    probes = {r.host: r.data["probe"] for r in reports if r.host in ready}
    checks = agreement(probes)
    group.records.extend(checks)
    if any(r.status == "fail" for r in checks):
        return None, [*reports, group]
    shared_records, shared_groups = storage.plan_records(probes, run_id)
    group.records.extend(shared_records)
    if any(r.status == "fail" for r in shared_records):
        return None, [*reports, group]
    failed_smoke = [] if skip_smoke and not smoke_real else rehearse_hosts(
        ready, conns, overrides, force, reports, real=smoke_real, twin=not skip_smoke)
    if failed_smoke:
        left_out.update({h: "smoke failed on the tiny twin" + (" or the real model" if smoke_real else "")
                         for h in failed_smoke})
        ready = [h for h in ready if h not in failed_smoke]
        if not ready or not allow_partial:
            group.records.append(Record(
                name="group.smoke", status="fail",
                summary=f"smoke failed on {', '.join(failed_smoke)}: the real run would fail there; not starting",
                detail={"ready": ready, "not_ready": left_out},
                fix=("fix the failures above (specops smoke --on HOST shows them alone), or start on the other "
                     "hosts with --allow-partial, or pass --skip-smoke") if ready else
                    "fix the failures above (specops smoke --on HOST shows them alone), or pass --skip-smoke"))
            return None, [*reports, group]
        group.records.append(Record(name="group.smoke", status="warn",
                                    summary=f"--allow-partial: smoke failed on {', '.join(failed_smoke)}; starting "
                                            f"on {', '.join(ready)}", detail={"ready": ready, "not_ready": left_out}))
        probes = {h: p for h, p in probes.items() if h in ready}
        shared_groups = storage.shared_groups(probes)
        if mode == "weights":
            given = {h: w for h, w in (given or {}).items() if h in ready}
    first = probes[ready[0]]
    total = first["dataset"]["samples"]
    weights = _weights(mode, given, probes)
    manifest = GroupMap(
        run_id=run_id, total=total, dataset={k: first["dataset"][k] for k in ("samples", "sha256")},
        shard_by=mode, weights=weights, overrides=overrides,
        stack={k: first["stack"].get(k) for k in ("convention", "format", "format_text", "layer_ids",
                                                   "layer_ids_output")}
        | {"model": first.get("model")},
        hosts={h: {"engine": p["stack"].get("engine"), "versions": p.get("versions"),
                   "capacity": p.get("capacity"), "dataset_path": p["dataset"].get("path")} for h, p in probes.items()},
        shards=shardmap.plan(run_id, total, weights, {h: shard_output_dir(conns.spec(h), overrides, run_id) for h in ready},
                             members=units),
    )
    manifest.history.append({"event": "planned", "hosts": ready, "left_out": left_out, "shard_by": mode,
                             "at": manifest.created_at})
    storage.remember(manifest, probes, shared_groups)
    idle = [s.head for s in manifest.shards if s.empty]
    group.records.append(Record(
        name="group.plan", status="ok",
        summary=f"{total} samples over {len(ready)} host(s) by {mode}: " + ", ".join(
            f"{s.head} [{s.start}, {s.stop})" for s in manifest.shards)
        + (f"; {', '.join(idle)} get(s) no samples (more hosts than samples)" if idle else ""),
        detail={"shards": [s.model_dump() for s in manifest.shards], "weights": weights}))
    save_manifest(manifest)
    return manifest, [*reports, group]

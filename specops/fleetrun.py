"""One extraction over a group of hosts: the dataset sharded, every shard detached, one merged result.

``specops extract --on GROUP --run-id R`` with more than one host:

1. **plan** -- every host at once, each bounded by a timeout: preflight (unless
   skipped) and ``remote/shard.py probe`` (dataset sample count and sha256 of the rows
   used, engine, layer convention and ids, sample format, versions, data-parallel
   width). One recap says which hosts are ready; the run starts only when all are,
   or on the ready ones with ``--allow-partial``. Hosts must agree on the dataset
   (count and sha256), the model, and the stack (layer convention, layer ids, sample
   format): a mixed stack is refused, since mixed files are silent. Once they agree,
   each ready host rehearses on a tiny twin of the model (``specops smoke``; unless
   ``--skip-smoke``), and a host whose rehearsal fails is not ready. The dataset's
   ``[0, total)`` is split into contiguous ranges sized by capacity
   (:mod:`specops.shards`), and the map is written to ``runs/R/fleet.json`` before
   anything starts.
2. **start** -- each shard's run is started detached on its host (``remote/job.py``,
   ``sample_range`` in its parameters; run id ``R`` on every host, so the host's run
   dir and output dir are named by the group's id).
3. **follow** -- one rich view: a bar per shard and a total with tokens/s and ETA. A
   host that drops out is marked and the others go on; its last seen progress is kept
   in ``fleet.json``.
4. **fetch** -- logs, status and manifests of every shard into ``runs/R/hosts/``, and
   once every shard is done, ``runs/R/manifest.json``: one manifest of every sample by
   global index (``--tensors``: the files too, into ``runs/R/samples/``, sha256-checked).

The same ``extract --run-id R`` again resumes what is unfinished (the map and the flags
come from ``fleet.json``); ``--reassign FROM=TO`` moves an unfinished shard's remaining
range -- from the first index not on FROM's disk, read from FROM when it answers, from
its last seen status when it does not -- to TO, as a new shard (run id ``R.<shard>``
there). ``status``, ``logs``, ``abort``, ``fetch`` and ``verify`` with the run id act on every
shard, on the host that holds it now.

Every one of them believes the host's disk, not a status file: a done run whose samples
went missing resumes (``job start`` checks its range on disk) and ``status`` calls it
incomplete; a cut shard's kept range is read again whenever its host answers (a cut made
from a last seen status is unchecked), and a gap there becomes a new shard on that host;
``fetch`` refuses a file whose size differs from the host manifest, and says ok only when
every merged file is in ``runs/R/samples``.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from specops import jobs
from specops import shards as shardmap
from specops import storage
from specops.logs import log_printer
from specops.errors import SpecopsError, UsageError
from specops.exit_codes import ExitCode
from specops.fleet import report_from_payload, run_steps, step_timeout
from specops.host import Host
from specops.inventory import Inventory
from specops.params import run_params
from specops.preflight import preflight_step
from specops.report import console, err_console, host_view, print_reports, recap_line
from specops.result import HostReport, Record, RunState, overall_exit
from specops.shards import FleetManifest, Shard

#: run parameters that decide what sample i is: every host must have the same value.
SHARED_PARAMS = {"max_samples": "--max-samples", "seq_len": "--seq-len", "layer_ids": "--layer-ids",
                 "layer_convention": "--layer-ids (its output:/input: prefix)"}
#: seconds for the quick per-host steps (start a job, look at it, abort it, read its logs);
#: the plan takes preflight's limit, and a fetch is bounded by its downloads' idle limit.
QUICK_TIMEOUT_S = float(os.environ.get("SPECOPS_STEP_TIMEOUT") or 180)
#: seconds for listing (and, where no manifest has them, hashing) one shard's files on its host.
FILES_TIMEOUT_S = 3600.0
#: how often the follow view writes last seen progress to fleet.json (seconds).
SAVE_EVERY_S = 2.0
GROUP = "fleet"

_save_lock = threading.Lock()


def print_fleet(reports: list[HostReport], as_json: bool = False) -> None:
    """``print_reports``, made for many hosts: with ``--json`` every record; for people, the
    tables of the hosts that have something to say (a failure, a warning, a change of plan)
    and one recap line for every host."""
    if as_json:
        print_reports(reports, as_json=True)
        return
    for report in reports:
        if report.error is not None:
            console.print(Text(f"{report.task} on {report.host}: ", style="bold")
                          + Text(report.error, style="bold red"))
        elif report.host == GROUP or any(r.status in ("fail", "warn") for r in report.records):
            console.print(host_view(report, console))
    console.rule("RECAP", style="dim")
    for report in reports:
        console.print(recap_line(report))


# --------------------------------------------------------------------------- the manifest on the laptop

def run_root(run_id: str) -> Path:
    return jobs.local_runs_root() / run_id


def manifest_path(run_id: str) -> Path:
    return run_root(run_id) / "fleet.json"


def load_manifest(run_id: str) -> FleetManifest | None:
    """The group run's map, or None when this laptop has no fleet run of that id."""
    path = manifest_path(run_id)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return FleetManifest.model_validate_json(text)
    except ValueError as exc:
        raise UsageError(f"{path} is not a readable fleet manifest: {str(exc).splitlines()[0]}",
                         "restore it from a backup, or start the run under a new run id") from None


def save_manifest(manifest: FleetManifest) -> None:
    """Write ``fleet.json`` atomically; a map that does not cover every sample exactly once is a bug."""
    problems = shardmap.coverage_problems(manifest)
    if problems:
        raise SpecopsError(f"internal error: the shard map of run {manifest.run_id} is broken: {problems[0]}",
                           "report this as a specops bug, with runs/<run-id>/fleet.json")
    path = manifest_path(manifest.run_id)
    with _save_lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        tmp.write_text(manifest.model_dump_json(indent=2))
        os.replace(tmp, path)


def is_fleet_run(run_id: str | None) -> bool:
    return bool(run_id) and manifest_path(run_id).is_file()


# --------------------------------------------------------------------------- connections

class Connections:
    """One :class:`Host` per host for the plan, and one per shard after that.

    A host that holds two shards of a group gets a connection per shard, so their
    steps and follows never share an SFTP session; the first shard of a host reuses
    the connection the plan opened.
    """

    def __init__(self, inventory: Inventory, accept_new_host_key: bool):
        self.inventory, self.accept_new = inventory, accept_new_host_key
        self._by_key: dict[tuple[str, int], Host] = {}
        self._lock = threading.Lock()  # steps of several shards ask at once

    def spec(self, name: str):
        if name not in self.inventory.hosts:
            raise UsageError(f"host {name!r} of this run is not in {self.inventory.path}",
                             f"add {name!r} back to the inventory (or pass the inventory the run was started with)")
        return self.inventory.hosts[name]

    def host(self, name: str, slot: int = 0) -> Host:
        key = (name, slot)
        with self._lock:
            if key not in self._by_key:
                self._by_key[key] = Host(self.spec(name), self.inventory, self.accept_new)
            return self._by_key[key]

    def for_shard(self, manifest: FleetManifest, shard: Shard) -> Host:
        slot = [s.id for s in manifest.shards_on(shard.head)].index(shard.id)
        return self.host(shard.head, slot)

    def close(self) -> None:
        for host in self._by_key.values():
            host.close()


def _per_shard(items: list[Shard], manifest: FleetManifest, conns: Connections, task: str, step,
               timeout: float | None) -> list[HostReport]:
    """``step(shard, host)`` for every shard in parallel, each bounded by ``timeout``."""
    return run_steps(items, lambda s: step(s, conns.for_shard(manifest, s)), name_of=lambda s: s.label, task=task,
                     timeout=timeout, on_timeout=lambda s: conns.for_shard(manifest, s).close())


# --------------------------------------------------------------------------- plan

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


def probe_step(host: Host, overrides: dict, *, preflight: bool, storage_probe: dict | None = None) -> HostReport:
    """Preflight (failures only) and the shard probe of one host; ``data["probe"]`` holds its facts.

    :param storage_probe: the plan's shared-storage probe for this host (:mod:`specops.storage`).
    """
    report = HostReport(host=host.name, task="extract")
    if preflight:
        pre = preflight_step(host, overrides, skip_autoconfig=True)
        failed = [r for r in pre.records if r.status == "fail"]
        report.records.extend(failed)
        report.records.append(Record(
            name="fleet.preflight", status="fail" if failed else "ok",
            summary=(f"preflight found {len(failed)} failure(s)" if failed
                     else f"preflight passed ({len(pre.records)} checks)"),
            fix=("fix the failures above (specops preflight --on HOST shows every check), or leave this host out "
                 "(--allow-partial starts on the ready hosts)") if failed else None))
    payload = host.run_task("shard", {**run_params(host.spec, **overrides), "action": "probe",
                                      **({"storage_probe": storage_probe} if storage_probe else {})})
    report.records.extend(report_from_payload(host.name, "extract", payload).records)
    report.data["probe"] = payload.get("data") or {}
    return report


def _describe_stack(stack: dict) -> str:
    return (f"{stack.get('engine')} writes {stack.get('format')}, layers {stack.get('layer_ids')} "
            f"({stack.get('convention')} of layer i)")


def agreement(probes: dict[str, dict], expected: FleetManifest | None = None) -> list[Record]:
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
        records.append(Record(name="fleet.dataset", status="fail",
                              summary=f"the hosts' datasets differ ({said}): index i would name different samples",
                              detail={"datasets": {h: {"samples": n, "sha256": d} for h, (n, d) in datasets.items()}},
                              fix="copy the same dataset file to every host (same rows, same order)"))
    else:
        (count, digest), = set(datasets.values())
        records.append(Record(name="fleet.dataset", status="ok",
                              summary=f"{len(probes)} host(s) read the same {count} samples (sha256 {digest[:12]})"))
    stacks = {h: p.get("stack") or {} for h, p in probes.items()}
    if expected is not None:
        stacks = {f"run {expected.run_id}": expected.stack, **stacks}
    keys = {h: (s.get("convention"), s.get("format"), tuple(s.get("layer_ids_output") or ()))
            for h, s in stacks.items()}
    if len(set(keys.values())) > 1:
        said = "; ".join(f"{h}: {_describe_stack(s)}" for h, s in stacks.items())
        records.append(Record(name="fleet.stack", status="fail",
                              summary=f"mixed stacks: the hosts would write different files ({said})",
                              detail={"stacks": stacks},
                              fix="make every host write the same files: pin --engine, or give --layer-ids "
                                  "output:... naming the same tensors; or leave the odd host out of --on"))
    else:
        engines = sorted({s["engine"] for s in stacks.values() if s.get("engine")})
        first = next(iter(stacks.values()))
        records.append(Record(name="fleet.stack", status="ok",
                              summary=f"one stack: {first.get('format')}, layers {first.get('layer_ids')} "
                                      f"({first.get('convention')} of layer i); engine(s) {', '.join(engines)}"))
    models = {h: p.get("model") for h, p in probes.items()}
    if expected is not None:
        models = {f"run {expected.run_id}": (expected.stack or {}).get("model"), **models}
    if len({json.dumps(m, sort_keys=True) for m in models.values()}) > 1:
        records.append(Record(name="fleet.model", status="fail",
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


def _output_dir(spec, overrides: dict, run_id: str) -> str:
    # each run owns its own output dir: a new run never "resumes" from another's samples
    return f"{run_params(spec, **overrides)['output_dir'].rstrip('/')}/{run_id}"


def _why_not_ready(report: HostReport) -> str:
    if report.error is not None:
        return report.error.splitlines()[0]
    failed = [r.name for r in report.records if r.status == "fail" and r.name != "fleet.preflight"]
    return f"{len(failed)} failed check(s): {', '.join(failed[:3])}" + (", ..." if len(failed) > 3 else "")


def rehearse_hosts(names: list[str], conns: Connections, overrides: dict, force: bool,
                   reports: list[HostReport]) -> list[str]:
    """Smoke on every named host at once (each host's records join its report in ``reports``);
    returns the hosts whose rehearsal failed."""
    from specops.extract import rehearse

    smoked = run_steps([conns.host(n) for n in names],
                       lambda h: HostReport(host=h.name, task="extract",
                                            records=rehearse(h, overrides, force=force, name="fleet.smoke")),
                       name_of=lambda h: h.name, task="smoke", on_timeout=lambda h: h.close())
    by_host = {r.host: r for r in reports}
    for report in smoked:
        records = report.records if report.error is None else [Record(
            name="fleet.smoke", status="fail", summary=f"smoke on {report.host}: {report.error.splitlines()[0]}",
            fix="fix the host, or pass --skip-smoke")]
        by_host[report.host].records.extend(records)
    return [r.host for r in smoked if r.failed]


def plan(run_id: str, overrides: dict, specs, conns: Connections, *, shard_by: str | None, allow_partial: bool,
         skip_preflight: bool, skip_smoke: bool = False, force: bool = False
         ) -> tuple[FleetManifest | None, list[HostReport]]:
    """Probe every host at once and write the shard map; (None, reports) when the run must not start.

    The smoke rehearsal runs once the hosts agree (a mismatch is found in seconds, without a
    twin's load); a host whose rehearsal fails is not ready.
    """
    check_shared_params(specs, overrides)
    names = [s.name for s in specs]
    mode, given = shardmap.parse_shard_by(shard_by, names)
    storage_probes = storage.probe_params(names, {n: _output_dir(conns.spec(n), overrides, run_id) for n in names},
                                          {n: run_params(conns.spec(n), **overrides)["work_dir"] for n in names})
    reports = run_steps([conns.host(n) for n in names],
                        lambda h: probe_step(h, overrides, preflight=not skip_preflight,
                                             storage_probe=storage_probes[h.name]), name_of=lambda h: h.name,
                        task="extract", timeout=step_timeout("preflight"), on_timeout=lambda h: h.close())
    ready = [r.host for r in reports if not r.failed]
    group = HostReport(host=GROUP, task="extract")
    left_out = {r.host: _why_not_ready(r) for r in reports if r.failed}
    if left_out:
        if not ready or not allow_partial:
            group.records.append(Record(
                name="fleet.ready", status="fail",
                summary=f"{len(ready)} of {len(names)} host(s) ready ({', '.join(ready) or 'none'}); not ready: "
                        + "; ".join(f"{h}: {why}" for h, why in left_out.items()),
                detail={"ready": ready, "not_ready": left_out},
                fix=("fix the hosts above and run the same command again, or start on the ready hosts only "
                     "with --allow-partial") if ready else "fix the hosts above and run the same command again"))
            return None, [*reports, group]
        group.records.append(Record(name="fleet.ready", status="warn",
                                    summary=f"--allow-partial: starting on {', '.join(ready)}; left out: "
                                            + "; ".join(f"{h}: {why}" for h, why in left_out.items()),
                                    detail={"ready": ready, "not_ready": left_out}))
        if mode == "weights":
            given = {h: w for h, w in (given or {}).items() if h in ready}
    else:
        group.records.append(Record(name="fleet.ready", status="ok", summary=f"all {len(names)} hosts ready"))
    probes = {r.host: r.data["probe"] for r in reports if r.host in ready}
    checks = agreement(probes)
    group.records.extend(checks)
    if any(r.status == "fail" for r in checks):
        return None, [*reports, group]
    shared_records, shared_groups = storage.plan_records(probes, run_id)
    group.records.extend(shared_records)
    if any(r.status == "fail" for r in shared_records):
        return None, [*reports, group]
    failed_smoke = [] if skip_smoke else rehearse_hosts(ready, conns, overrides, force, reports)
    if failed_smoke:
        left_out.update({h: "smoke failed on the tiny twin" for h in failed_smoke})
        ready = [h for h in ready if h not in failed_smoke]
        if not ready or not allow_partial:
            group.records.append(Record(
                name="fleet.smoke", status="fail",
                summary=f"smoke failed on {', '.join(failed_smoke)}: the real run would fail there; not starting",
                detail={"ready": ready, "not_ready": left_out},
                fix=("fix the failures above (specops smoke --on HOST shows them alone), or start on the other "
                     "hosts with --allow-partial, or pass --skip-smoke") if ready else
                    "fix the failures above (specops smoke --on HOST shows them alone), or pass --skip-smoke"))
            return None, [*reports, group]
        group.records.append(Record(name="fleet.smoke", status="warn",
                                    summary=f"--allow-partial: smoke failed on {', '.join(failed_smoke)}; starting "
                                            f"on {', '.join(ready)}", detail={"ready": ready, "not_ready": left_out}))
        probes = {h: p for h, p in probes.items() if h in ready}
        shared_groups = storage.shared_groups(probes)
        if mode == "weights":
            given = {h: w for h, w in (given or {}).items() if h in ready}
    first = probes[ready[0]]
    total = first["dataset"]["samples"]
    weights = _weights(mode, given, probes)
    manifest = FleetManifest(
        run_id=run_id, total=total, dataset={k: first["dataset"][k] for k in ("samples", "sha256")},
        shard_by=mode, weights=weights, overrides=overrides,
        stack={k: first["stack"].get(k) for k in ("convention", "format", "format_text", "layer_ids",
                                                   "layer_ids_output")}
        | {"model": first.get("model")},
        hosts={h: {"engine": p["stack"].get("engine"), "versions": p.get("versions"),
                   "capacity": p.get("capacity"), "dataset_path": p["dataset"].get("path")} for h, p in probes.items()},
        shards=shardmap.plan(run_id, total, weights, {h: _output_dir(conns.spec(h), overrides, run_id) for h in ready}),
    )
    manifest.history.append({"event": "planned", "hosts": ready, "left_out": left_out, "shard_by": mode,
                             "at": manifest.created_at})
    storage.remember(manifest, probes, shared_groups)
    idle = [s.head for s in manifest.shards if s.empty]
    group.records.append(Record(
        name="fleet.plan", status="ok",
        summary=f"{total} samples over {len(ready)} host(s) by {mode}: " + ", ".join(
            f"{s.head} [{s.start}, {s.stop})" for s in manifest.shards)
        + (f"; {', '.join(idle)} get(s) no samples (more hosts than samples)" if idle else ""),
        detail={"shards": [s.model_dump() for s in manifest.shards], "weights": weights}))
    save_manifest(manifest)
    return manifest, [*reports, group]


# --------------------------------------------------------------------------- reassign

def parse_reassign(text: str) -> list[tuple[str, str]]:
    """``--reassign FROM=TO[,FROM=TO...]``: each FROM once; nothing given is a usage error, not a no-op."""
    pairs = []
    for part in (p.strip() for p in str(text).split(",") if p.strip()):
        src, sep, dst = part.partition("=")
        if not sep or not src.strip() or not dst.strip():
            raise UsageError(f"--reassign {text!r}: {part!r} is not FROM=TO",
                             "name the host that lost its shard and the host that takes the rest, e.g. "
                             "--reassign gpu-b=gpu-d")
        if src.strip() == dst.strip():
            raise UsageError(f"--reassign {part!r} moves a shard to its own host", "name another host after '='")
        if any(src.strip() == had for had, _ in pairs):
            raise UsageError(f"--reassign {text!r} moves {src.strip()!r} twice",
                             f"name each host once: its unfinished range goes to one host, e.g. --reassign "
                             f"{src.strip()}={dst.strip()}")
        pairs.append((src.strip(), dst.strip()))
    if not pairs:
        raise UsageError(f"--reassign {text!r} names no move", "give FROM=TO, e.g. --reassign gpu-b=gpu-d")
    return pairs


def _listing(host: Host, shard: Shard, *, sha256: bool, timeout: float) -> dict:
    """What ``shard``'s range holds on its head's disk (``remote/shard.py files``): the truth a
    resume, a cut and a fetch go by, whatever a status file says."""
    payload = host.run_task("shard", {"action": "files", "output_dir": shard.output_dir, "start": shard.start,
                                      "stop": shard.stop, "sha256": sha256}, timeout=timeout)
    return payload.get("data") or {}


def _cut_point(manifest: FleetManifest, shard: Shard, conns: Connections) -> tuple[int, str, bool]:
    """The first index of ``shard`` not on its host's disk, how it was learned, and whether
    that was read on the disk.

    Asked from the host when it answers (its run is stopped first, so it makes nothing
    past the cut); else the last status the laptop saw, which never runs ahead of the
    disk (a run reports a sample only once it is written) but counts samples, so a gap
    below it (a file lost in an earlier crash) is not seen: the cut is then marked
    unchecked, and the kept range is read when the host answers again.
    """
    host = conns.for_shard(manifest, shard)

    def ask(_shard) -> HostReport:
        state = jobs.run_state(host, shard.run_id)
        if state.alive and not state.is_final:
            jobs.job_call(host, "abort", shard.run_id)
        listing = _listing(host, shard, sha256=False, timeout=QUICK_TIMEOUT_S)
        return HostReport(host=shard.label, task="extract", data={"first_missing": listing["first_missing"],
                                                                  "state": state.state})

    report, = run_steps([shard], ask, name_of=lambda s: s.label, task="extract", timeout=QUICK_TIMEOUT_S,
                        on_timeout=lambda s: host.close())
    if report.error is None:
        return int(report.data["first_missing"]), f"read on {shard.head}'s disk (its run stopped first)", True
    at = shard.seen.get("at") or "never"
    return shard.first_missing(), (f"{shard.head} did not answer ({report.error.splitlines()[0]}); last seen "
                                   f"status at {at}, not checked on its disk: a gap below it is made again once "
                                   f"{shard.head} answers (specops extract --run-id {manifest.run_id})"), False


def reassign(manifest: FleetManifest, pairs: list[tuple[str, str]], conns: Connections, overrides: dict,
             skip_preflight: bool, skip_smoke: bool = False, force: bool = False) -> list[HostReport]:
    """Move every unfinished shard of each FROM to its TO; the map is saved when all moves are settled.

    A TO new to the run is checked as the plan checks a host (preflight, then smoke)."""
    group = HostReport(host=GROUP, task="extract")
    reports: list[HostReport] = []
    for src, dst in pairs:
        if src not in manifest.host_names():
            raise UsageError(f"--reassign {src}={dst}: {src!r} holds no shard of run {manifest.run_id}",
                             f"its hosts are {', '.join(manifest.host_names())}")
        conns.spec(dst)
    targets = sorted({dst for _, dst in pairs})
    probed = run_steps([conns.host(n) for n in targets],
                       lambda h: probe_step(h, overrides,
                                            preflight=not skip_preflight and h.name not in manifest.hosts),
                       name_of=lambda h: h.name, task="extract", timeout=step_timeout("preflight"),
                       on_timeout=lambda h: h.close())
    reports.extend(probed)
    bad = [r.host for r in probed if r.failed]
    probes = {r.host: r.data["probe"] for r in probed if not r.failed}
    checks = agreement(probes, expected=manifest) if probes else []
    group.records.extend(checks)
    new = [n for n in targets if n not in manifest.hosts]
    if not bad and not skip_smoke and new and not any(r.status == "fail" for r in checks):
        bad = rehearse_hosts(new, conns, overrides, force, reports)
    if bad or any(r.status == "fail" for r in checks):
        group.records.append(Record(name="fleet.reassign", status="fail",
                                    summary=f"not moving anything: {', '.join(bad) or 'the new host'} cannot take a "
                                            f"shard of run {manifest.run_id}",
                                    fix="fix the target host (see its records), or pick another one"))
        return [*reports, group]
    for src, dst in pairs:
        # a cut shard too: what its host keeps is read again, and a gap in it moves (the disk decides, not a
        # status); every shard says what happened to it, a move asked twice included
        for shard in [s for s in manifest.shards_on(src) if not s.empty]:
            cut, how, checked = _cut_point(manifest, shard, conns)
            kept = f" (the rest moved to {', '.join(shard.moved_to)} before)" if shard.closed else ""
            if shard.closed and not checked:
                group.records.append(Record(
                    name="fleet.reassign", status="skipped",
                    summary=f"{shard.label}: [{shard.start}, {shard.stop}) stays on {src}{kept}; nothing more to move "
                            f"while it does not answer ({how.split(';')[0]})",
                    fix=f"once {src} answers, specops extract --run-id {manifest.run_id} reads its disk and makes "
                        f"any gap again"))
                continue
            new_run_id = shardmap.moved_run_id(manifest.run_id, shardmap.next_moved_id(manifest, shard))
            moved = shardmap.reassign(manifest, shard, dst, cut, _output_dir(conns.spec(dst), overrides, new_run_id))
            if moved is None:
                if checked:
                    shard.cut_checked = True
                group.records.append(Record(name="fleet.reassign", status="skipped",
                                            summary=f"{shard.label}: every sample of [{shard.start}, {shard.stop}) "
                                                    f"is on {src}{kept} ({how}); nothing to move"))
                continue
            shard.cut_checked = checked
            manifest.hosts.setdefault(dst, {"engine": probes[dst]["stack"].get("engine"),
                                            "versions": probes[dst].get("versions"),
                                            "capacity": probes[dst].get("capacity"),
                                            "dataset_path": probes[dst]["dataset"].get("path")})
            group.records.append(Record(
                name="fleet.reassign", status="changed",
                summary=f"{shard.id}: [{cut}, {moved.stop}) moved from {src} to {dst} as {moved.label} (run id "
                        f"{moved.run_id}); [{shard.start}, {cut}) stays on {src} (cut {how})",
                detail={"from": shard.model_dump(), "to": moved.model_dump(), "how": how}))
    save_manifest(manifest)
    return [*reports, group]


# --------------------------------------------------------------------------- start, settle

def start_step(manifest: FleetManifest, shard: Shard, host: Host, overrides: dict, force: bool) -> HostReport:
    """Start (or re-attach to, or resume) one shard's run on its head host."""
    params = run_params(host.spec, **overrides)
    params.update(force=force, output_dir=shard.output_dir, sample_range=[shard.start, shard.stop])
    payload = jobs.job_call(host, "start", shard.run_id, **params)
    report = report_from_payload(shard.label, "extract", payload)
    status = (payload.get("data") or {}).get("status")
    if status:
        shard.remember(status)
    report.data.update(payload.get("data") or {})
    return report


def settle_closed(manifest: FleetManifest, shard: Shard, host: Host) -> HostReport:
    """A cut shard's run must not go on past its cut: stop it if it runs; read what its host's disk
    holds of the kept range (``data["first_missing"]``: where a gap starts, or its stop)."""
    report = HostReport(host=shard.label, task="extract")
    state = jobs.run_state(host, shard.run_id)
    moved = ", ".join(shard.moved_to)
    if state.alive and not state.is_final:
        jobs.job_call(host, "abort", shard.run_id)
        report.records.append(Record(name="fleet.cut", status="changed",
                                     summary=f"stopped run {shard.run_id} on {shard.head}: its range past {shard.stop} "
                                             f"moved to {moved}"))
        state = jobs.run_state(host, shard.run_id)
    if state.found:
        shard.remember(state.model_dump())
    listing = _listing(host, shard, sha256=False, timeout=QUICK_TIMEOUT_S)
    have = int(listing["first_missing"])
    report.data["first_missing"] = have
    if have >= shard.stop:
        report.records.append(Record(name="fleet.cut", status="ok",
                                     summary=f"[{shard.start}, {shard.stop}) kept on {shard.head}, every sample on "
                                             f"its disk (the rest moved to {moved})", detail={"first_missing": have}))
    return report


def remake_gaps(manifest: FleetManifest, settled: list[tuple[Shard, HostReport]], conns: Connections,
                overrides: dict) -> list[Record]:
    """A cut shard whose kept range has a gap on its host's disk (a file lost in a crash before an
    unchecked cut, or deleted since): ``[gap, stop)`` becomes a new shard on the same host, so it is
    made again (a cut shard's own run never restarts: it would make its whole old range)."""
    records = []
    for shard, report in settled:
        if report.error is not None or "first_missing" not in report.data:
            continue
        cut = int(report.data["first_missing"])
        old_stop = shard.stop
        new_run_id = shardmap.moved_run_id(manifest.run_id, shardmap.next_moved_id(manifest, shard))
        moved = shardmap.reassign(manifest, shard, shard.head, cut,
                                  _output_dir(conns.spec(shard.head), overrides, new_run_id))
        shard.cut_checked = True
        if moved is None:
            continue
        records.append(Record(
            name="fleet.gap", status="changed",
            summary=f"{shard.label}: sample {cut} of its kept range [{shard.start}, {old_stop}) is not on "
                    f"{shard.head}'s disk; [{cut}, {old_stop}) is made again there as {moved.label} (run id "
                    f"{moved.run_id})", detail={"from": shard.model_dump(), "to": moved.model_dump()}))
    return records


# --------------------------------------------------------------------------- the view

def shard_state(shard: Shard, state: RunState | None) -> str:
    """A shard's state for people: a cut shard is done once its kept range is on disk."""
    if shard.empty:
        return "empty"
    if state is None:
        return "unknown"
    if shard.closed and state.found and shard.first_missing(state.model_dump()) >= shard.stop:
        return "done"
    return state.state


class NotStarted(Exception):
    """A shard that waited for another shard of its host, which did not end done."""


def lanes_of(shard_list: list[Shard]) -> dict[str, list[Shard]]:
    """Shards by head host, in map order: a host runs one shard at a time (one run per host, as
    ``job start`` enforces), so a range moved to a busy host waits for the shard before it."""
    lanes: dict[str, list[Shard]] = {}
    for shard in shard_list:
        lanes.setdefault(shard.head, []).append(shard)
    return lanes


def start_lane(manifest: FleetManifest, lane: list[Shard], conns: Connections, overrides: dict,
               force: bool) -> HostReport:
    """Start a host's first unfinished shard (shards already done just say so); ``data["current"]`` names it."""
    out = HostReport(host=lane[0].head, task="extract")
    reports, current = [], None
    for shard in lane:
        try:
            report = start_step(manifest, shard, conns.for_shard(manifest, shard), overrides, force)
        except SpecopsError as exc:
            report = HostReport(host=shard.label, task="extract", error=str(exc), error_code=int(exc.code))
        reports.append(report)
        if report.failed:
            break
        if shard.seen.get("state") != "done":
            current = shard.id
            break
    out.data = {"reports": reports, "current": current}
    return out


def follow(manifest: FleetManifest, conns: Connections, lanes: dict[str, list[Shard]], overrides: dict,
           force: bool) -> tuple[dict[str, RunState | Exception], list[HostReport]]:
    """One view over every lane until each shard is final, lost or left waiting.

    Each host's lane runs on a thread of its own: it follows the running shard (one
    python on the host, one channel), and when that ends done, starts the host's next
    shard and follows it. Returns each shard's last state (or why it has none) and the
    start reports of the shards started on the way.

    :raises KeyboardInterrupt: passed through; the caller detaches.
    """
    import queue

    shard_list = [s for lane in lanes.values() for s in lane]
    events: queue.Queue = queue.Queue()
    states: dict[str, RunState] = {}
    results: dict[str, RunState | Exception] = {}
    started: list[HostReport] = []
    last_save = [0.0]

    def lane_worker(lane: list[Shard]) -> None:
        for i, shard in enumerate(lane):
            host = conns.for_shard(manifest, shard)
            try:
                if i > 0:  # the shard before it on this host is done: this one's turn
                    report = start_step(manifest, shard, host, overrides, force)
                    events.put(("report", shard.id, report))
                    if report.failed:
                        raise NotStarted(report.error or next(r.summary for r in report.records if r.status == "fail"))
                # a next shard waits until this one's supervisor has exited (its engine freed the devices)
                until = "exited" if i + 1 < len(lane) else "final"
                result = jobs.follow_run(host, shard.run_id, lambda e, sid=shard.id: events.put(("event", sid, e)),
                                         until=until)
            except Exception as exc:  # noqa: BLE001 -- this shard's result; the other lanes go on
                result = exc
            events.put(("result", shard.id, result))
            if not (isinstance(result, RunState) and result.state == "done"):
                for rest in lane[i + 1:]:
                    events.put(("result", rest.id, NotStarted(f"waits for {shard.id} on {shard.head}, which did not "
                                                              f"end done")))
                return

    with Progress(TextColumn("[bold]{task.fields[label]}"), TextColumn("{task.fields[phase]:<14}"), BarColumn(),
                  MofNCompleteColumn(), TextColumn("{task.fields[rate]:>12}"), TextColumn("ETA {task.fields[eta]}"),
                  TimeElapsedColumn(), console=err_console, transient=False) as progress:
        bars = {s.id: progress.add_task("", label=s.label, phase="starting" if lane[0] is s else "waiting",
                                        rate="", eta="?", total=s.size, completed=max(0, s.first_missing() - s.start))
                for lane in lanes.values() for s in lane}
        total_bar = progress.add_task("", label=f"total {manifest.run_id}", phase="", rate="", eta="?",
                                      total=manifest.total)
        by_id = {s.id: s for s in shard_list}

        def draw_total() -> None:
            done = 0
            for s in manifest.shards:
                st = states.get(s.id)
                done += s.size if shard_state(s, st) == "done" else max(
                    0, s.first_missing(st.model_dump() if st else None) - s.start)
            running = [st for sid, st in states.items() if not st.is_final and sid not in results]
            rate = sum(st.tokens_per_s or 0 for st in running if st.state == "extracting")
            etas = [st.eta_s for st in running]
            eta = "?" if any(e is None for e in etas) else f"{max(etas, default=0):.0f}s"
            lost = [sid for sid, r in results.items() if isinstance(r, Exception) and not isinstance(r, NotStarted)]
            progress.update(total_bar, completed=done, rate=f"{rate:.0f} tok/s" if rate else "", eta=eta,
                            phase=f"{len(lost)} lost" if lost else "")

        def show(shard: Shard, state: RunState) -> None:
            states[shard.id] = state
            before = (shard.seen.get("state"), shard.seen.get("samples_done"))
            shard.remember(state.model_dump())
            if (state.state, state.samples_done) != before:  # progress is what a reassignment goes by: keep it now
                last_save[0] = 0.0
            rate, eta = state.tokens_per_s, state.eta_s
            progress.update(bars[shard.id], completed=max(0, shard.first_missing(state.model_dump()) - shard.start),
                            phase=shard_state(shard, state), rate=f"{rate:.0f} tok/s" if rate else "",
                            eta=f"{eta:.0f}s" if eta is not None else "?")
            draw_total()
            if time.monotonic() - last_save[0] > SAVE_EVERY_S:
                save_manifest(manifest)
                last_save[0] = time.monotonic()

        for lane in lanes.values():
            threading.Thread(target=lane_worker, args=(lane,), daemon=True, name=f"lane-{lane[0].head}").start()
        while len(results) < len(shard_list):
            try:
                kind, sid, item = events.get(timeout=0.5)  # a timeout keeps Ctrl-C deliverable here
            except queue.Empty:
                continue
            if kind == "event":
                if item["event"] == "status":
                    show(by_id[sid], RunState.model_validate(item["status"]))
            elif kind == "report":
                started.append(item)
            else:
                results[sid] = item
                if isinstance(item, RunState):
                    if item.found:
                        show(by_id[sid], item)
                else:
                    progress.update(bars[sid], phase="not started" if isinstance(item, NotStarted) else "unreachable",
                                    rate="", eta="?")
                    draw_total()
    save_manifest(manifest)
    return results, started


def shard_table(manifest: FleetManifest, states: dict[str, RunState | Exception | None],
                disk: dict[str, tuple[int, int]] | None = None) -> Table:
    """One row per shard; ``disk`` (``{shard id: (samples on disk, first missing)}``) overrides a done
    status for shards whose disk lacks samples."""
    table = Table(title=f"run {manifest.run_id}: {manifest.total} samples, {len(manifest.shards)} shard(s)",
                  title_justify="left")
    for column in ("shard", "host(s)", "range", "run id", "state", "done", "first missing", "note"):
        table.add_column(column, justify="right" if column in ("done", "first missing") else "left")
    for s in manifest.shards:
        result = states.get(s.id)
        if result is None and s.seen.get("state"):  # not looked at now: what was seen last
            result = RunState(state=s.seen["state"], samples_done=s.seen.get("samples_done"),
                              samples_total=s.seen.get("samples_total"), alive=s.seen.get("alive"))
        state = result if isinstance(result, RunState) else None
        if isinstance(result, Exception):
            text = Text("unreachable", style="bold red")
            first = s.first_missing()
            note = f"last seen {s.seen.get('at', 'never')}: {s.seen.get('state') or '?'}"
        else:
            name = shard_state(s, state)
            style = {"done": "green", "failed": "bold red", "aborted": "yellow"}.get(name, "")
            text = Text(name, style=style)
            first = s.first_missing(state.model_dump() if state and state.found else None)
            note = ""
            if disk and s.id in disk:
                text = Text(INCOMPLETE, style="bold red")
                first = disk[s.id][1]
                note = f"{disk[s.id][0]}/{s.size} on disk"
        if s.moved_to:
            note = (note + "; " if note else "") + f"rest moved to {', '.join(s.moved_to)}"
        if s.moved_from:
            note = (note + "; " if note else "") + f"moved from {s.moved_from}"
        table.add_row(s.id, "+".join(s.hosts), f"[{s.start}, {s.stop})", s.run_id, text,
                      f"{max(0, first - s.start)}/{s.size}", str(first) if first < s.stop else "-", note)
    return table


# --------------------------------------------------------------------------- extract

def extract(inventory: Inventory, selector: str | None, overrides: dict, *, run_id: str, detach: bool, force: bool,
            skip_preflight: bool, as_json: bool, tensors: bool, accept_new_host_key: bool = False,
            skip_smoke: bool = False, shard_by: str | None = None, allow_partial: bool = False,
            reassign_text: str | None = None) -> ExitCode:
    """The whole group run: plan (or resume, or reassign), start, follow, fetch; returns the exit code.

    Every host of a new plan (and a new host a shard moves to) gets the smoke rehearsal
    first unless ``skip_smoke``; a resumed shard does not (it was checked when planned).
    """
    conns = Connections(inventory, accept_new_host_key)
    try:
        return _extract(inventory, selector, overrides, conns, run_id=run_id, detach=detach, force=force,
                        skip_preflight=skip_preflight, skip_smoke=skip_smoke, as_json=as_json, tensors=tensors,
                        shard_by=shard_by, allow_partial=allow_partial, reassign_text=reassign_text)
    finally:
        conns.close()


def _resume_overrides(manifest: FleetManifest, overrides: dict) -> dict:
    """The run's own flags; a flag given again must say the same thing."""
    changed = {k: (manifest.overrides.get(k), v) for k, v in overrides.items()
               if k in manifest.overrides and str(manifest.overrides[k]) != str(v)}
    added = {k: v for k, v in overrides.items() if k not in manifest.overrides}
    if changed or added:
        said = ", ".join([f"--{k.replace('_', '-')} was {a!r}, now {b!r}" for k, (a, b) in changed.items()]
                         + [f"--{k.replace('_', '-')} {v!r} is new" for k, v in added.items()])
        raise UsageError(f"run {manifest.run_id} exists with other flags ({said})",
                         f"resume it with no run flags (they come from {manifest_path(manifest.run_id)}), "
                         f"or start a new run id")
    return dict(manifest.overrides)


def _extract(inventory, selector, overrides, conns: Connections, *, run_id, detach, force, skip_preflight, skip_smoke,
             as_json, tensors, shard_by, allow_partial, reassign_text) -> ExitCode:
    manifest = load_manifest(run_id)
    reports: list[HostReport] = []
    if manifest is None:
        if reassign_text:
            raise UsageError(f"--reassign needs a fleet run, and this laptop has none called {run_id!r} "
                             f"({manifest_path(run_id)} does not exist)", "pass the id of a running group run")
        specs = inventory.select(selector)
        manifest, reports = plan(run_id, overrides, specs, conns, shard_by=shard_by, allow_partial=allow_partial,
                                 skip_preflight=skip_preflight, skip_smoke=skip_smoke, force=force)
        if manifest is None:
            print_fleet(reports, as_json=as_json)
            return overall_exit(reports)
    else:
        if shard_by:
            raise UsageError(f"--shard-by applies when a run is planned; run {run_id} already has its shard map",
                             "drop --shard-by to resume, or move a shard with --reassign FROM=TO")
        overrides = _resume_overrides(manifest, overrides)
        if reassign_text:
            reports = reassign(manifest, parse_reassign(reassign_text), conns, overrides, skip_preflight,
                               skip_smoke=skip_smoke, force=force)
            if any(r.failed for r in reports):
                print_fleet(reports, as_json=as_json)
                return overall_exit(reports)
    # hosts left out by --allow-partial are shown, but their failures are not this run's any more
    left_out = set(manifest.history[-1].get("left_out") or {}) if manifest.history else set()
    wanted = {s.name for s in inventory.select(selector)} if selector else None
    closed = [s for s in manifest.shards if not s.empty and s.closed and (wanted is None or s.head in wanted)]
    settled = _per_shard(closed, manifest, conns, "extract", lambda s, h: settle_closed(manifest, s, h),
                         QUICK_TIMEOUT_S)
    reports += settled
    gaps = remake_gaps(manifest, list(zip(closed, settled)), conns, overrides)
    if gaps:
        reports.append(HostReport(host=GROUP, task="extract", records=gaps))
    chosen = [s for s in manifest.shards if not s.empty and (wanted is None or s.head in wanted)]
    lanes = lanes_of([s for s in chosen if not s.closed])
    lane_reports = run_steps(list(lanes.values()), lambda lane: start_lane(manifest, lane, conns, overrides, force),
                             name_of=lambda lane: lane[0].head, task="extract", timeout=QUICK_TIMEOUT_S,
                             on_timeout=lambda lane: [conns.for_shard(manifest, s).close() for s in lane])
    running: dict[str, list[Shard]] = {}
    for lane, lane_report in zip(lanes.values(), lane_reports):
        if lane_report.error is not None:  # the host hung or dropped while starting
            reports.append(lane_report.model_copy(update={"host": lane[0].label}))
            continue
        reports.extend(lane_report.data["reports"])
        current = lane_report.data["current"]
        if current is not None:
            running[lane[0].head] = lane[[s.id for s in lane].index(current):]
    save_manifest(manifest)
    waiting = [s.label for lane in running.values() for s in lane[1:]]
    if not running and not detach:
        return _nothing_to_run(manifest, conns, reports, tensors=tensors, as_json=as_json, left_out=left_out)
    if detach or not running:
        print_fleet(reports, as_json=as_json)
        if not as_json:
            console.print(shard_table(manifest, {}))
            console.print(f"run [bold]{run_id}[/] started detached ({len(running)} shard(s) running"
                          + (f"; {', '.join(waiting)} wait for their host's shard to finish: run the same command "
                             f"again then" if waiting else "")
                          + f"). Follow: specops extract --run-id {run_id};  status: specops status --run-id {run_id}")
        return overall_exit([r for r in reports if r.host not in left_out])
    if not as_json:
        print_fleet(reports)
        console.print(f"Following run [bold]{run_id}[/] on {len(running)} host(s)"
                      + (f" ({', '.join(waiting)} start when their host's shard is done)" if waiting else "")
                      + " (Ctrl-C detaches; the runs go on)")
    try:
        final, more = follow(manifest, conns, running, overrides, force)
    except KeyboardInterrupt:
        conns.close()
        save_manifest(manifest)
        err_console.print(f"\n[yellow]detached[/]: run {run_id} goes on. Re-attach: specops extract --run-id {run_id};"
                          f" status: specops status --run-id {run_id}")
        return ExitCode.JOB_RUNNING
    return _conclude(manifest, conns, final, tensors=tensors, as_json=as_json, printed=reports, late=more,
                     left_out=left_out)


def _nothing_to_run(manifest: FleetManifest, conns: Connections, reports: list[HostReport], *, tensors: bool,
                    as_json: bool, left_out: set[str]) -> ExitCode:
    """No shard is running after the starts: every one is done on its disk (a done run missing
    samples was restarted, so it runs), or the starts failed. Say which; fetch what is done."""
    mine = [r for r in reports if r.host not in left_out]
    group = HostReport(host=GROUP, task="extract")
    if any(r.failed for r in mine):
        group.records.append(Record(name="fleet.run", status="fail",
                                    summary=f"no shard of run {manifest.run_id} is running: the starts above failed",
                                    fix="fix the causes above, then run the same command again"))
        fetched = []
    else:
        group.records.append(Record(name="fleet.run", status="ok",
                                    summary=f"nothing left to run: every shard of run {manifest.run_id} is done; "
                                            f"fetching" + (" the files" if tensors else "")))
        fetched = fetch(manifest, conns, tensors=tensors)
    everything = [*reports, group, *fetched]
    print_fleet(everything, as_json=as_json)
    if not as_json:
        console.print(shard_table(manifest, {}))
    return overall_exit([r for r in everything if r.host not in left_out])


def _conclude(manifest: FleetManifest, conns: Connections, final: dict, *, tensors: bool, as_json: bool,
              printed: list[HostReport], late: list[HostReport], left_out: set[str] = frozenset()) -> ExitCode:
    """Say how each shard ended; fetch and merge when every shard is done.

    :param printed: the reports shown before the view (``--json`` prints them now, with the rest).
    :param late: start reports of shards started while following.
    """
    codes, reports = [], []
    for shard in manifest.shards:
        if shard.id not in final:
            continue
        result = final[shard.id]
        report = HostReport(host=shard.label, task="extract")
        if isinstance(result, NotStarted):
            report.records.append(Record(
                name="fleet.run", status="fail", summary=f"not started: {result}",
                fix=f"once the shard before it is done, run the same command again (specops extract --run-id "
                    f"{manifest.run_id})"))
            codes.append(ExitCode.FAILED)
        elif isinstance(result, Exception):
            report.records.append(Record(
                name="fleet.run", status="fail", summary=f"lost {shard.head}: {str(result).splitlines()[0]}",
                detail={"last_seen": shard.seen},
                fix=f"the other shards went on. Once {shard.head} answers, run the same command again to resume it; "
                    f"or move its remaining range: specops extract --run-id {manifest.run_id} --reassign "
                    f"{shard.head}=OTHER_HOST"))
            codes.append(result.code if isinstance(result, SpecopsError) else ExitCode.INTERNAL)
        elif result.state == "done":
            report.records.append(Record(name="fleet.run", status="ok",
                                         summary=f"[{shard.start}, {shard.stop}) done on {shard.head}"))
            codes.append(ExitCode.SUCCESS)
        else:
            err = result.error
            report.records.append(Record(
                name="fleet.run", status="fail",
                summary=f"{shard.run_id} on {shard.head} {result.state}: "
                        + (err.headline() if err else "no error recorded"),
                detail={"error": err.model_dump() if err else None},
                fix=f"read the traceback (specops logs --run-id {manifest.run_id}); fix the cause, then run the "
                    f"same command again to resume the shard"))
            codes.append(result.exit_code)
        reports.append(report)
    fetched = {r.host: r for r in fetch(manifest, conns, tensors=tensors)}
    for report in reports:  # one report per shard: how its run ended, then what was fetched of it
        got = fetched.pop(report.host, None)
        if got is not None:
            report.records.extend(got.records)
            report.data.update(got.data)
            report.error, report.error_code = got.error, got.error_code
    reports.extend(fetched.values())
    if as_json:
        print_fleet([*printed, *late, *reports], as_json=True)
    else:
        print_fleet([*[r for r in late if r.failed], *reports])
        console.print(shard_table(manifest, final))
    # a shard that could not even start (its host busy with another run, unreachable) counts too
    everything = [r for r in (*printed, *late, *reports) if r.host not in left_out]
    if ExitCode.UNREACHABLE in codes or overall_exit(everything) == ExitCode.UNREACHABLE:
        return ExitCode.UNREACHABLE
    return max([*codes, overall_exit(everything)], default=ExitCode.SUCCESS)


# --------------------------------------------------------------------------- status, logs, abort

#: a shard whose status says done while its disk lacks samples (status's word for it).
INCOMPLETE = "incomplete"


class UnreachableMarker(Exception):
    """A shard whose host did not answer a look (shown with its last seen progress)."""


def _look_step(manifest: FleetManifest, shard: Shard, host: Host) -> HostReport:
    payload = jobs.job_call(host, "status", shard.run_id)
    report = report_from_payload(shard.label, "status", payload)
    state = RunState.from_payload(payload)
    if state.found:
        shard.remember(state.model_dump())
    report.data["state"] = shard_state(shard, state)
    report.data["run_state"] = state.model_dump()
    if shard.closed:  # its host's run may have ended any way; what counts is the kept range
        report.records = [Record(name="job.status", status="ok" if report.data["state"] == "done" else "warn",
                                 summary=f"[{shard.start}, {shard.stop}) on {shard.head}: {report.data['state']} "
                                         f"(rest moved to {', '.join(shard.moved_to)})")]
    if report.data["state"] == "done":  # done is what the disk holds, not what a status file says
        listing = _listing(host, shard, sha256=False, timeout=QUICK_TIMEOUT_S)
        gone = shard.size - len(listing.get("files") or [])
        if gone:
            report.data.update(state=INCOMPLETE, on_disk=shard.size - gone, disk_first_missing=listing["first_missing"])
            report.records.append(Record(
                name="fleet.disk", status="fail",
                summary=f"{shard.label} is done by its status, but {gone} of its {shard.size} sample(s) are not on "
                        f"{shard.head}'s disk, or changed there (first {listing['first_missing']})",
                detail={"missing_head": listing.get("missing_head"), "changed": listing.get("changed")},
                fix=f"specops extract --run-id {manifest.run_id} makes them again"))
    return report


def status(inventory: Inventory, run_id: str, *, as_json: bool, accept_new_host_key: bool = False) -> ExitCode:
    """Every shard's state, bounded per host; an unreachable host is shown with its last seen progress."""
    manifest = load_manifest(run_id)
    conns = Connections(inventory, accept_new_host_key)
    try:
        shards = [s for s in manifest.shards if not s.empty]
        reports = _per_shard(shards, manifest, conns, "status", lambda s, h: _look_step(manifest, s, h),
                             QUICK_TIMEOUT_S)
    finally:
        conns.close()
    save_manifest(manifest)
    states: dict = {}
    for shard, report in zip(shards, reports):
        if report.error is not None:
            states[shard.id] = UnreachableMarker(report.error)
            report.data["last_seen"] = shard.seen
        else:
            states[shard.id] = RunState.model_validate(report.data["run_state"])
    print_fleet(reports, as_json=as_json)
    if not as_json:
        console.print(shard_table(manifest, states, {
            s.id: (r.data["on_disk"], r.data["disk_first_missing"]) for s, r in zip(shards, reports)
            if r.data.get("state") == INCOMPLETE}))
    if any(r.error is not None for r in reports):
        return overall_exit([r for r in reports if r.error is not None])
    return max((ExitCode.FAILED if r.data.get("state") == INCOMPLETE else
                ExitCode.from_job_state(r.data.get("state", "missing")) for r in reports), default=ExitCode.SUCCESS)


def abort(inventory: Inventory, run_id: str, *, accept_new_host_key: bool = False) -> list[HostReport]:
    """Stop every shard's run (cut shards too, should theirs still run)."""
    manifest = load_manifest(run_id)
    conns = Connections(inventory, accept_new_host_key)
    try:
        shards = [s for s in manifest.shards if not s.empty]
        return _per_shard(shards, manifest, conns, "abort",
                          lambda s, h: report_from_payload(s.label, "abort", jobs.job_call(h, "abort", s.run_id)),
                          QUICK_TIMEOUT_S)
    finally:
        conns.close()


def logs(inventory: Inventory, run_id: str, *, follow_logs: bool, only: str | None, as_json: bool,
         accept_new_host_key: bool = False) -> ExitCode:
    """Every shard's logs, each line prefixed by its shard and host; ``follow_logs`` streams until all are final."""
    manifest = load_manifest(run_id)
    conns = Connections(inventory, accept_new_host_key)
    shards = [s for s in manifest.shards if not s.empty]
    collected: dict[str, dict[str, str]] = {s.label: {} for s in shards}
    labels = {s.id: s.label for s in shards}
    show = log_printer(collected, only, as_json)

    codes = [ExitCode.SUCCESS]
    try:
        if follow_logs:
            def on_event(sid: str, event: dict) -> None:
                if event["event"] == "log":
                    show(labels[sid], event["file"], event["text"])

            try:
                final = jobs.follow_many([(s.id, conns.for_shard(manifest, s), s.run_id) for s in shards], on_event,
                                         logs=True)
            except KeyboardInterrupt:
                conns.close()
                console.print("[yellow]stopped following; the runs go on[/]")
                return ExitCode.SUCCESS
            for sid, result in final.items():
                if isinstance(result, Exception):
                    console.print(Text(f"{labels[sid]}: lost the follow: {result}", style="bold red"))
                    codes.append(result.code if isinstance(result, SpecopsError) else ExitCode.INTERNAL)
        else:
            def look(shard: Shard, host: Host) -> HostReport:
                payload = jobs.job_call(host, "logs", shard.run_id)
                return HostReport(host=shard.label, task="logs", data=payload.get("data") or {},
                                  records=[Record(**r) for r in payload.get("records", [])])

            for report in _per_shard(shards, manifest, conns, "logs", look, QUICK_TIMEOUT_S):
                if report.error is not None or "logs" not in report.data:
                    why = report.error or (report.records[0].summary if report.records else "no logs")
                    console.print(Text(f"{report.host}: {why.splitlines()[0]}", style="bold red"))
                    codes.append(ExitCode(report.error_code) if report.error else ExitCode.JOB_NOT_FOUND)
                    continue
                for name, chunk in report.data["logs"].items():
                    show(report.host, name, chunk["text"])
    finally:
        conns.close()
    if as_json:
        import sys

        sys.stdout.write(json.dumps({"run_id": run_id, "logs": collected}, indent=2) + "\n")
    return max(codes)


def verify(inventory: Inventory, run_id: str, *, samples: int, reference: str,
           accept_new_host_key: bool = False) -> list[HostReport]:
    """Verify every shard of a group run where it is now: on its head host, under its own run id
    (``R.<shard>`` for a range a reassign moved); one report per shard, and the group's verdict.

    A cut shard whose run never ended done (stopped when the rest of its range moved) has no
    manifest of its own to verify: it is named in a warning, never passed over in silence.
    """
    from specops.verify import verify_step

    manifest = load_manifest(run_id)
    conns = Connections(inventory, accept_new_host_key)

    def one(shard: Shard, host: Host) -> HostReport:
        if shard.closed:
            state = jobs.run_state(host, shard.run_id)
            if state.state != "done":
                return HostReport(host=shard.label, task="verify", records=[Record(
                    name="fleet.verify", status="warn",
                    summary=f"{shard.label}: not verified: its run {shard.run_id} was cut at {shard.stop} (the rest "
                            f"moved to {', '.join(shard.moved_to)}) and ended {state.state}, so it has no manifest "
                            f"of [{shard.start}, {shard.stop})", detail={"range": [shard.start, shard.stop]})])
        report = verify_step(host, shard.run_id, samples, reference)
        report.host = shard.label
        return report

    try:
        shards = [s for s in manifest.shards if not s.empty]
        reports = _per_shard(shards, manifest, conns, "verify", one, timeout=None)
    finally:
        conns.close()
    failed = [r.host for r in reports if r.failed]
    unverified = [r.host for r in reports if not r.failed and any(x.name == "fleet.verify" for x in r.records)]
    verdict = Record(
        name="fleet.verify", status="fail" if failed else "warn" if unverified else "ok",
        summary=(f"{len(reports) - len(failed) - len(unverified)} of {len(reports)} shard(s) of run {run_id} "
                 f"verified" + (f"; failed: {', '.join(failed)}" if failed else "")
                 + (f"; not verifiable: {', '.join(unverified)}" if unverified else "")),
        fix=f"see the shards' records above (specops status --run-id {run_id})" if failed else None)
    return [*reports, HostReport(host=GROUP, task="verify", records=[verdict])]


# --------------------------------------------------------------------------- fetch and merge

def fetch(manifest: FleetManifest, conns: Connections, *, tensors: bool) -> list[HostReport]:
    """Every shard's run files into ``runs/R/hosts/``; the merged manifest (and samples) once all are done.

    Each host is fetched on its own thread; a host that does not answer is reported and
    the others are fetched regardless. Samples are taken from the shard whose range
    holds their index, so a cut shard's samples past its cut (made before it was
    stopped) are never used.
    """
    root = run_root(manifest.run_id)
    shards = [s for s in manifest.shards if not s.empty]

    def one(shard: Shard, host: Host) -> HostReport:
        report = jobs.fetch_run(host, shard.run_id, tensors=False, dest_root=root / "hosts", timeout=QUICK_TIMEOUT_S)
        report.host = shard.label
        # hashing on the host (files no manifest lists yet) reads every byte: a long bound, not none
        files = _listing(host, shard, sha256=True, timeout=FILES_TIMEOUT_S)
        report.data["listing"] = files
        changed = files.get("changed") or []
        if changed:  # never fetched, never merged: a good copy fetched before stays as it is
            paths = [c["path"] for c in changed]
            report.records.append(Record(
                name="fleet.changed", status="fail",
                summary=f"{len(changed)} sample file(s) of [{shard.start}, {shard.stop}) on {shard.head} changed since "
                        f"its run wrote them ({', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''}: size differs "
                        f"from the host's manifest); not fetched, not merged",
                detail={"changed": changed},
                fix=f"the copy on {shard.head} is damaged: remove it there ({files.get('output_dir')}/{paths[0]}"
                    f"{' ...' if len(paths) > 1 else ''}), then specops extract --run-id {manifest.run_id} makes it "
                    f"again"))
        have = len(files.get("files") or [])
        if have == shard.size:
            report.records.append(Record(name="fleet.files", status="ok",
                                         summary=f"all {have} sample(s) of [{shard.start}, {shard.stop}) on "
                                                 f"{shard.head}", detail={"hashed_on_host": files.get("hashed_here")}))
        else:
            report.records.append(Record(
                name="fleet.files", status="warn",
                summary=f"{have} of {shard.size} sample(s) of [{shard.start}, {shard.stop}) on {shard.head} yet "
                        f"(first missing {files.get('first_missing')})",
                detail={"missing_head": files.get("missing_head")},
                fix=f"let the run finish (specops status --run-id {manifest.run_id}), or resume it: specops extract "
                    f"--run-id {manifest.run_id}"))
        if tensors and files.get("files"):
            report.records.append(jobs.download_files(host, host.remote_path(files["output_dir"]), files["files"],
                                                      root / "samples", name="fleet.tensors"))
        return report

    reports = _per_shard(shards, manifest, conns, "fetch", one, timeout=0)
    by_label = {r.host: r for r in reports}
    # an hs run writes the token dataset (every row) beside its samples: one copy serves the merged dir
    with_dataset = [s for s in shards if ((by_label.get(s.label) or HostReport(host="", task="")).data.get(
        "listing") or {}).get("dataset_files")]
    if tensors and with_dataset:
        source = with_dataset[0]
        listing = by_label[source.label].data["listing"]
        host = conns.for_shard(manifest, source)
        by_label[source.label].records.append(jobs.download_files(
            host, host.remote_path(listing["output_dir"]), listing["dataset_files"], root / "samples",
            name="fleet.dataset_files"))
    merged = merge(manifest, {s.id: by_label.get(s.label) for s in shards})
    # the merged dir must hold what the merged manifest names (a download that failed leaves none)
    absent = [f["path"] for f in merged["files"] if tensors and not _local_copy_ok(root / "samples", f)]
    # a dir the shards share gets its merged manifest there, made on a host of it (no tensor moves)
    reports += storage.host_merges(manifest, conns, root)
    group = HostReport(host=GROUP, task="fetch", data={"dest": str(root), "manifest": str(root / "manifest.json")})
    if absent:
        group.records.append(Record(
            name="fleet.merge", status="fail",
            summary=f"{len(absent)} of {merged['samples']} merged sample file(s) are not in {root / 'samples'} "
                    f"({', '.join(absent[:3])}{', ...' if len(absent) > 3 else ''})",
            detail={"absent": absent[:50], "missing_head": merged["missing"][:50]},
            fix=f"see the download records above; fetch again (specops fetch --run-id {manifest.run_id} --tensors)"))
    elif merged["complete"]:
        group.records.append(Record(name="fleet.merge", status="ok",
                                    summary=f"{merged['samples']} sample(s) of {manifest.total} in one manifest "
                                            f"({root / 'manifest.json'})" + (f", files in {root / 'samples'}"
                                                                             if tensors else "")))
    else:
        group.records.append(Record(
            name="fleet.merge", status="warn",
            summary=f"{merged['samples']} of {manifest.total} sample(s) so far; {len(merged['missing'])} missing "
                    f"(first {merged['missing'][:5]})",
            detail={"missing_head": merged["missing"][:50]},
            fix=f"finish or resume the unfinished shards (specops status --run-id {manifest.run_id}), then fetch "
                f"again"))
    save_manifest(manifest)
    return [*reports, group]


def _local_copy_ok(local_dir: Path, entry: dict) -> bool:
    """The fetched copy of a merged sample is there, whole (its sha256 was checked when it came)."""
    path = local_dir / entry["path"]
    try:
        return path.stat().st_size == int(entry["bytes"])
    except OSError:
        return False


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


def fetch_run_id(inventory: Inventory, run_id: str, *, tensors: bool, as_json: bool,
                 accept_new_host_key: bool = False) -> ExitCode:
    manifest = load_manifest(run_id)
    conns = Connections(inventory, accept_new_host_key)
    try:
        reports = fetch(manifest, conns, tensors=tensors)
    finally:
        conns.close()
    print_fleet(reports, as_json=as_json)
    if not as_json:
        console.print(shard_table(manifest, {}))
    return overall_exit(reports)

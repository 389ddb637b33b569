"""A replica over several hosts, from the laptop: each host's place in it, as its run sees it.

The inventory names the replica (``replicas: {big: [a, b]}``, head first; see
:class:`specops.inventory.ReplicaSpec`); a group run makes it one shard (``Shard.hosts``);
this module gives each host's run its ``replica`` parameter (read on the host by
:mod:`remote.extract.replica` and the vllm-server engine), so the head starts the API server with
ranks ``0..k-1`` and every next host ``--headless`` ranks, all under the shard's run id.
"""
from __future__ import annotations

import time

from specops.errors import UsageError
from specops.inventory import DEFAULT_MASTER_PORT, Inventory, ReplicaSpec
from specops.result import Record


def node_block(inventory: Inventory, replica: ReplicaSpec, host: str) -> dict:
    """``params["replica"]`` for ``host`` of ``replica`` (see :mod:`remote.extract.replica`)."""
    head = inventory.hosts[replica.head]
    return {"name": replica.name, "hosts": list(replica.hosts), "node_rank": replica.hosts.index(host),
            "nnodes": len(replica.hosts), "ranks_per_node": replica.ranks_per_host, "tp": replica.tp,
            "master_addr": head.replica_address, "master_port": replica.master_port,
            "watch_port": replica.watch_port, "node_address": inventory.hosts[host].replica_address}


def replica_overrides(inventory: Inventory, host: str, overrides: dict) -> dict:
    """The run flags of ``host``'s run: a replica's host runs at the replica's TP (all its ranks).

    :raises UsageError: ``--tp`` that is not the replica's.
    """
    replica = inventory.replica_of(host)
    if replica is None:
        return overrides
    given = overrides.get("tp")
    if given not in (None, "") and str(given) != str(replica.tp):
        raise UsageError(f"--tp {given} for replica {replica.name!r}, whose tp is {replica.tp} (its ranks over "
                         f"{len(replica.hosts)} hosts)", f"drop --tp, or set tp of replica {replica.name!r} in "
                                                         f"{inventory.path}")
    return {**overrides, "tp": replica.tp}


def node_params(inventory: Inventory, host: str) -> dict:
    """What a run on ``host`` adds to its parameters: its place in its replica (nothing for a host
    that holds a whole replica)."""
    replica = inventory.replica_of(host)
    if replica is None:
        return {}
    return {"tp": replica.tp, "replica": node_block(inventory, replica, host)}


# --------------------------------------------------------------------------- preflight of a replica

#: hosts whose clocks differ by more than this (seconds) get a warn: their logs no longer line up.
CLOCK_SKEW_WARN_S = 2.0


def probe_hosts(inventory: Inventory, replica: ReplicaSpec, host_of, overrides: dict) -> dict:
    """``remote/extract/replica_probe.py`` on every host of ``replica`` at once (the head holds its ports
    open while the others connect): ``{host: payload or the exception}``, plus the laptop's
    clock reading around each call (``{host: (sent, received)}`` under ``"_clock"``)."""
    import concurrent.futures

    from specops.params import run_params

    def one(host: str):
        params = {**run_params(inventory.hosts[host], **{k: v for k, v in overrides.items() if k != "tp"}),
                  **node_params(inventory, host)}
        sent = time.time()
        payload = host_of(host).run_task("replica_probe", params)
        return payload, (sent, time.time())

    out, clock = {}, {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(replica.hosts)) as pool:
        futures = {host: pool.submit(one, host) for host in replica.hosts}
        for host, future in futures.items():
            try:
                out[host], clock[host] = future.result()
            except Exception as exc:  # noqa: BLE001 -- an unreachable host is a finding, named below
                out[host] = exc
    out["_clock"] = clock
    return out


def judge(replica: ReplicaSpec, answers: dict) -> list[Record]:
    """The replica's preflight records from every host's probe (see ``remote/extract/replica_probe.py``).

    Only hosts whose probe answered with its findings are compared; every other host is named
    (``replica.hosts`` fails), and no check says "every host" of hosts it did not hear from."""
    clock = answers.get("_clock") or {}
    name = f"replica {replica.name}"
    data, silent = {}, {}
    for host in replica.hosts:
        answer = answers.get(host)
        if isinstance(answer, dict) and "node_rank" in (answer.get("data") or {}):
            data[host] = answer["data"]
        else:
            silent[host] = _why_silent(answer)
    records = [_hosts(name, replica, data, silent, clock)]
    if not data:
        return records
    records.append(_agree(name, "replica.versions", {h: d.get("versions") for h, d in data.items()},
                          "vLLM, torch, transformers and speculators", replica, silent,
                          "install the same versions on every host of the replica (the ranks load one model "
                          "with one code)"))
    models = {h: d.get("model") or {} for h, d in data.items()}
    broken = {h: m["error"] for h, m in models.items() if m.get("error")}
    if broken:
        records.append(Record(name="replica.model", status="fail",
                              summary=f"{name}: the model cannot be read on " + "; ".join(
                                  f"{h}: {e}" for h, e in broken.items()),
                              fix="put a copy of the model at each host's model_path"))
    else:
        records.append(_agree(name, "replica.model", {h: m.get("sha256") for h, m in models.items()},
                              "model files (config, index and shard headers)", replica, silent,
                              "copy the head's model to the host(s) named (each host loads its ranks' slice "
                              "of the same checkpoint)", detail={h: m.get("files") for h, m in models.items()}))
    short = {h: d.get("devices") for h, d in data.items() if (d.get("devices") or {}).get("count", 0) < replica.ranks_per_host}
    said = ", ".join(f"{h}: {d.get('devices', {}).get('count')} {d.get('devices', {}).get('what')}" for h, d in data.items())
    records.append(Record(
        name="replica.devices", status="fail" if short else ("skipped" if silent else "ok"),
        summary=(f"{name}: tp {replica.tp} over {len(replica.hosts)} hosts is {replica.ranks_per_host} rank(s) per host; "
                 + (f"too few on {', '.join(short)} ({said})" if short else
                    f"room on the {len(data)} of {len(replica.hosts)} host(s) that answered ({said}; not known for "
                    f"{', '.join(silent)})" if silent else f"every host has room ({said})")),
        detail={h: d.get("devices") for h, d in data.items()},
        fix=(f"give each host {replica.ranks_per_host} device(s), or set tp of replica {replica.name} to "
             f"{len(replica.hosts)} x the devices of its smallest host") if short else None))
    foreign = {h: (d.get("address_here") or {}).get("error") for h, d in data.items()
               if "address_here" in d and not d["address_here"].get("ok")}
    if foreign:
        records.append(Record(name="replica.address", status="fail",
                              summary=f"{name}: node_address is not an address of " + "; ".join(
                                  f"{h} ({data[h].get('node_address')}: {e})" for h, e in foreign.items()),
                              fix="set node_address of each host to an IP address the host has (ip addr)"))
    records.extend(_ports(name, replica, data, silent))
    records.append(Record(name="replica.network", status="ok",
                          summary=f"{name}: network settings the ranks see: " + "; ".join(
                              f"{h}: {' '.join(f'{k}={v}' for k, v in (d.get('network_env') or {}).items()) or 'none set'}"
                              for h, d in data.items()) + (f"; {', '.join(silent)}: no answer" if silent else ""),
                          detail={h: d.get("network_env") for h, d in data.items()}))
    clocked = _clock(name, data, clock)
    if clocked is not None:
        records.append(clocked)
    return records


def _why_silent(answer) -> str:
    """Why a host gave no findings: the exception of a host that did not answer, or its probe's own failure."""
    if answer is None:
        return "not asked"
    if not isinstance(answer, dict):
        return f"no answer: {str(answer).splitlines()[0] if str(answer) else type(answer).__name__}"
    failed = [r for r in answer.get("records") or [] if isinstance(r, dict) and r.get("status") == "fail"]
    if failed:
        return f"its probe failed: {failed[0].get('summary')}"
    return "its probe returned no findings"


def _hosts(name: str, replica: ReplicaSpec, data: dict, silent: dict, clock: dict) -> Record:
    """The recap: how many of the replica's hosts answered, and whether they were checked at once.

    A replica's hosts are checked together (the head holds its ports open while the others reach
    them): the laptop's calls, timed by its one clock (no skew between hosts can fool it), overlap;
    calls one after another would not (a warn). Each host's own window (``ran``, its clock) is kept
    in the detail."""
    asked = len(replica.hosts)
    ran = {h: {"started": d.get("started_unix"), "ended": d.get("ended_unix")} for h, d in data.items()}
    detail = {"asked": list(replica.hosts), "answered": list(data), "silent": silent, "ran": ran,
              "calls": {h: {"sent": c[0], "received": c[1]} for h, c in clock.items() if h in data}}
    if silent:
        return Record(name="replica.hosts", status="fail",
                      summary=f"{name}: {len(data)} of {asked} hosts answered; " + "; ".join(
                          f"{h}: {why}" for h, why in silent.items()), detail=detail,
                      fix="every host of a replica must answer: fix the host(s) named, then run preflight again")
    calls = [c for h, c in clock.items() if h in data]
    if len(calls) < 2:
        return Record(name="replica.hosts", status="ok", summary=f"{name}: {len(data)} of {asked} hosts answered",
                      detail=detail)
    overlap = min(c[1] for c in calls) - max(c[0] for c in calls)
    detail["overlap_s"] = round(overlap, 3)
    if overlap > 0:
        return Record(name="replica.hosts", status="ok",
                      summary=f"{name}: {len(data)} of {asked} hosts answered, checked at once ({overlap:.1f} s in "
                              f"common)", detail=detail)
    return Record(name="replica.hosts", status="warn",
                  summary=f"{name}: {len(data)} of {asked} hosts answered, but one after another (the calls did not "
                          f"overlap): a worker's reach of the head's ports was not checked while the head held them",
                  detail=detail, fix="run preflight on the whole replica at once (--on the replica's name)")


def _clock(name: str, data: dict, clock: dict) -> Record | None:
    """How far apart the hosts' clocks are, as far as the laptop's calls can tell.

    A host read its clock (``started_unix``, then ``ended_unix``) while the laptop's call to it ran
    (``sent``..``received``, the laptop's clock): its offset from the laptop lies in
    ``[ended - received, started - sent]``, a window as wide as the call's round trip less the
    host's own work. Two hosts' clocks are surely apart by the gap between their windows, and at
    most by their span: a warn only for a skew these calls prove, never for a slow call.
    """
    windows = {}
    for host, d in data.items():
        started, ended = d.get("started_unix"), d.get("ended_unix")
        if host in clock and started is not None and ended is not None:
            sent, received = clock[host]
            windows[host] = (ended - received, started - sent)
    if len(windows) < 2:
        return None
    proven = max(0.0, max(lo for lo, _ in windows.values()) - min(hi for _, hi in windows.values()))
    at_most = max(hi for _, hi in windows.values()) - min(lo for lo, _ in windows.values())
    detail = {"offset_s": {h: {"min": round(lo, 3), "max": round(hi, 3)} for h, (lo, hi) in windows.items()},
              "skew_at_least_s": round(proven, 3), "skew_at_most_s": round(at_most, 3),
              "warn_above_s": CLOCK_SKEW_WARN_S}
    if proven > CLOCK_SKEW_WARN_S:
        return Record(name="replica.clock", status="warn",
                      summary=f"{name}: the hosts' clocks are at least {proven:.2f} s apart (at most {at_most:.2f} s, "
                              f"as this laptop's calls tell)", detail=detail,
                      fix="sync the hosts' clocks (chrony/NTP), or the hosts' logs will not line up")
    if at_most <= CLOCK_SKEW_WARN_S:
        summary = f"{name}: clocks within {at_most:.2f} s of each other (as this laptop's calls tell)"
    else:  # slow calls: the skew is bounded loosely, and nothing above the limit is shown
        summary = (f"{name}: no clock skew above {CLOCK_SKEW_WARN_S:g} s shown (these calls bound it only to "
                   f"{at_most:.2f} s: their round trips)")
    return Record(name="replica.clock", status="ok", summary=summary, detail=detail)


def _agree(name: str, record: str, values: dict, what: str, replica: ReplicaSpec, silent: dict, fix: str,
           detail=None) -> Record:
    """The hosts that answered hold one value (the head's, or the first answering host's when the head is silent)."""
    head = replica.head if replica.head in values else next(iter(values))
    reference = values.get(head)
    odd = [h for h, v in values.items() if v != reference]
    extra = {"values": values, **({"files": detail} if detail else {})}
    if odd:
        return Record(name=record, status="fail",
                      summary=f"{name}: {', '.join(odd)} differ(s) from {'the head ' if head == replica.head else ''}"
                              f"{head} in {what}: " + "; ".join(f"{h}: {values[h]}" for h in [head, *odd]),
                      detail={**extra, "differ": odd}, fix=fix)
    if silent:
        return Record(name=record, status="skipped",
                      summary=f"{name}: the {len(values)} of {len(replica.hosts)} host(s) that answered have the same "
                              f"{what}; {', '.join(silent)} not compared (no answer)", detail=extra)
    return Record(name=record, status="ok", summary=f"{name}: every host has the same {what}", detail=extra)


def _ports(name: str, replica: ReplicaSpec, data: dict, silent: dict) -> list[Record]:
    if replica.head not in data:
        return [Record(name="replica.master_port", status="skipped",
                       summary=f"{name}: the head {replica.head} did not answer: its ports were not checked")]
    head = data.get(replica.head) or {}
    listen = head.get("listen") or {}
    taken = {p: e for p, e in (listen.get("bound") or {}).items() if e}
    records = [_port_range(name, replica, head.get("ephemeral_ports"))]
    if taken:
        records.append(Record(name="replica.master_port", status="fail",
                              summary=f"{name}: the head {replica.head} cannot listen on " + "; ".join(
                                  f"port {p} ({e})" for p, e in taken.items()),
                              fix=f"set master_port of replica {replica.name} to a free port P (P and P + 1 are used)"))
        return records
    unreached = {h: {p: e for p, e in (d.get("reach") or {}).items() if e}
                 for h, d in data.items() if h != replica.head}
    unreached = {h: bad for h, bad in unreached.items() if bad}
    address = f"{head.get('node_address')}:{replica.master_port}/{replica.watch_port}"
    workers = [h for h in replica.hosts[1:] if h in data]
    records.append(Record(
        name="replica.master_port", status="fail" if unreached else ("skipped" if silent else "ok"),
        summary=(f"{name}: " + ("; ".join(f"{h} cannot reach the head on " + ", ".join(
            f"{head.get('node_address')}:{p} ({e})" for p, e in bad.items()) for h, bad in unreached.items())
            if unreached else f"{', '.join(workers) or 'no worker host'} reached the head on {address}; "
                              f"{', '.join(silent)} not checked (no answer)" if silent
            else f"every worker host reached the head on {address}")),
        detail={"head": listen, "workers": {h: d.get("reach") for h, d in data.items() if h != replica.head}},
        fix=("open the master port and the next one on the head to the other hosts (firewall), and check "
             "node_address of the head: it is the address vLLM's ranks connect to") if unreached else None))
    return records


def _port_range(name: str, replica: ReplicaSpec, span: list[int] | None) -> Record:
    """The master port and the watch against the head's ephemeral range: the kernel hands those ports to outgoing
    connections, one of which may hold the pair between this check and the run's start (the run waits out one
    that closes, but not one that stays)."""
    pair = f"{replica.master_port}/{replica.watch_port}"
    if span is None:
        return Record(name="replica.port_range", status="skipped",
                      summary=f"{name}: the head {replica.head} did not say its ephemeral port range")
    detail = {"ports": [replica.master_port, replica.watch_port], "ephemeral_range": span}
    if any(span[0] <= port <= span[1] for port in (replica.master_port, replica.watch_port)):
        return Record(name="replica.port_range", status="warn",
                      summary=f"{name}: ports {pair} lie in {replica.head}'s ephemeral range {span[0]}-{span[1]}, "
                              f"which the kernel hands to outgoing connections: one may hold them when the run "
                              f"starts", detail=detail,
                      fix=f"set master_port of replica {replica.name} below {span[0]} (the default is "
                          f"{DEFAULT_MASTER_PORT})")
    return Record(name="replica.port_range", status="ok",
                  summary=f"{name}: ports {pair} lie outside {replica.head}'s ephemeral range {span[0]}-{span[1]}",
                  detail=detail)


def preflight_replicas(inventory: Inventory, heads: list[str], host_of, overrides: dict) -> dict[str, list[Record]]:
    """Every replica among ``heads`` (a host that holds a whole replica is left out), all hosts of
    each at once: ``{head: records}``."""
    out = {}
    for head in heads:
        replica = inventory.replica_of(head)
        if replica is not None:
            out[head] = judge(replica, probe_hosts(inventory, replica, host_of, overrides))
    return out

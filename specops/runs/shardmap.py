"""The shard map of a group run: which hosts extract which global sample indices (pure, no I/O).

A group run splits ``dataset[0:total]`` (after ``max_samples``) into contiguous
ranges, one per host, sized by each host's capacity (its data-parallel width,
devices // tp) unless ``--shard-by`` says otherwise. Indices stay global: sample ``i``
is ``data_{i}`` (or ``hs_{i}``) on whichever host made it.

    >>> split(10, {"a": 1, "b": 1, "c": 1})
    {'a': (0, 4), 'b': (4, 7), 'c': (7, 10)}
    >>> split(2, {"a": 1, "b": 1, "c": 1})          # more hosts than samples
    {'a': (0, 1), 'b': (1, 2), 'c': (2, 2)}

A :class:`Shard` names a *set* of hosts (``hosts``): a host that holds a whole model
replica is a set of one; a replica spread over several hosts (vLLM's own multi-node
runtime, the inventory's ``replicas``) is a shard of several hosts, its first one the
head that runs the supervisor and writes the samples.

Moving a shard's unfinished tail to another host (:func:`reassign`) cuts the shard at
the first index its host has not written and adds a new shard for the rest, so the
ranges still partition ``[0, total)``: no sample twice, none lost
(:func:`coverage_problems` is the check).
"""
from __future__ import annotations

import math

from specops.wire.ranges import split  # noqa: F401 -- the group plan's math, shared with a Slurm job array
import re
import time
from typing import Any

from pydantic import BaseModel, Field

from specops import wire
from specops.errors import UsageError
from specops.result import STATE

#: the manifest schema this code writes and reads.
SCHEMA = 1
SHARD_BY_MODES = ("capacity", "equal")
#: the largest ``--shard-by`` weight: weights are ratios, and past this the float math of a
#: split (``total * w / sum``) stops being exact (1e308 overflows it).
MAX_WEIGHT = 1e6
_WEIGHT = re.compile(r"^\s*([^=\s]+)\s*=\s*([^=\s]+)\s*$")


class Shard(BaseModel):
    """One contiguous range of global sample indices and the hosts that extract it.

    :param id: ``s0``, ``s1``, ... in index order; a range moved off a shard is ``s1m1``.
    :param hosts: the hosts that hold one model replica for this range; the first is the
        head (where the run dir and the samples live; the others run headless ranks of it).
    :param start: first global index (inclusive).
    :param stop: last global index, exclusive; a cut shard's stop is where it was cut.
    :param run_id: the run id of this shard's run dir on its head host: the group's run
        id for the first shards, ``<run-id>.<shard id>`` for a moved range (a host keeps
        one run dir per run id, and may hold two shards of one group).
    :param output_dir: where the head host writes the samples (a path on that host).
    :param moved_from: the shard this range was cut from, if any.
    :param moved_to: shards that took this shard's tail; the shard is then closed at ``stop``.
    :param seen: the last status the laptop saw (state, samples_done, at): what a
        reassignment goes by when the host cannot be asked.
    :param cut_checked: False when the shard was cut at its last seen status because its
        host did not answer: a status counts samples, so the kept range may still hold a
        gap (a file lost in an earlier crash). Its host's disk is read when it answers
        again, and a gap is made again then.
    """

    id: str
    hosts: list[str]
    start: int
    stop: int
    run_id: str
    output_dir: str = ""
    moved_from: str | None = None
    moved_to: list[str] = Field(default_factory=list)
    seen: dict[str, Any] = Field(default_factory=dict)
    cut_checked: bool = True

    @property
    def head(self) -> str:
        return self.hosts[0]

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def empty(self) -> bool:
        return self.stop <= self.start

    @property
    def closed(self) -> bool:
        """Cut: its tail went to other shards; its own run is never started again."""
        return bool(self.moved_to)

    @property
    def label(self) -> str:
        """``s1@gpu-b`` (``s1@gpu-b+gpu-c`` for a shard of several hosts)."""
        return f"{self.id}@{'+'.join(self.hosts)}"

    def first_missing(self, status: dict | None = None) -> int:
        """The first index of this range not yet written, by ``status`` (else the last seen one).

        Samples are written in index order and a run resumes at its first missing index,
        so what is on disk is the prefix ``[start, start + samples_done)``.
        """
        status = status if status is not None else self.seen
        if (status or {}).get("state") == STATE.DONE:
            return self.stop
        done = int((status or {}).get("samples_done") or 0)
        return min(self.stop, self.start + max(0, done))

    def remember(self, status: dict) -> None:
        """Keep what a status says about progress (for a later reassignment or status)."""
        self.seen = {"state": status.get("state"), "samples_done": status.get("samples_done"),
                     "samples_total": status.get("samples_total"), "alive": status.get("alive"),
                     "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


class GroupMap(BaseModel):
    """``runs/<run-id>/group.json`` on the laptop: everything needed to act on the group later."""

    schema_version: int = SCHEMA
    run_id: str
    created_at: str = Field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    #: samples in the run: min(dataset rows, max_samples); every shard's range lies in [0, total).
    total: int
    #: the dataset as the hosts counted it: ``{"samples", "sha256"}`` (sha256 of the rows used).
    dataset: dict[str, Any] = Field(default_factory=dict)
    #: how the ranges were sized: ``capacity``, ``equal`` or ``weights``, and each host's weight.
    shard_by: str = "capacity"
    weights: dict[str, float] = Field(default_factory=dict)
    #: the run flags the group was started with (a resume reuses them).
    overrides: dict[str, Any] = Field(default_factory=dict)
    #: what every host agrees on: layer convention, sample format, layer ids.
    stack: dict[str, Any] = Field(default_factory=dict)
    #: per host: engine, versions, devices, tp, data-parallel width (from the plan probe).
    hosts: dict[str, dict[str, Any]] = Field(default_factory=dict)
    shards: list[Shard] = Field(default_factory=list)
    #: what happened to the map: planned, reassigned (who, where, at which index).
    history: list[dict[str, Any]] = Field(default_factory=list)

    def shard(self, shard_id: str) -> Shard:
        for shard in self.shards:
            if shard.id == shard_id:
                return shard
        raise KeyError(shard_id)

    def shards_on(self, host: str) -> list[Shard]:
        return [s for s in self.shards if host in s.hosts]

    def host_names(self) -> list[str]:
        """Every host of the map, in shard order, once."""
        seen: dict[str, None] = {}
        for shard in self.shards:
            for host in shard.hosts:
                seen.setdefault(host, None)
        return list(seen)

    def active(self) -> list[Shard]:
        """Shards with samples to make that are not closed."""
        return [s for s in self.shards if not s.empty]


# --------------------------------------------------------------------------- the math

def parse_shard_by(text: str | None, hosts: list[str]) -> tuple[str, dict[str, float] | None]:
    """``--shard-by``: ``capacity`` (default), ``equal``, or ``HOST=WEIGHT,...`` for every host.

    :returns: ``(mode, weights)``; weights only for explicit ``HOST=WEIGHT`` values.
    :raises UsageError: naming the flag, the bad part and the fix.
    """
    text = (text or "capacity").strip()
    if text in SHARD_BY_MODES:
        return text, None
    weights: dict[str, float] = {}
    for part in (p for p in text.split(",") if p.strip()):
        match = _WEIGHT.match(part)
        if not match:
            raise UsageError(f"--shard-by {text!r}: {part.strip()!r} is not HOST=WEIGHT",
                             "use capacity (devices / tp, the default), equal, or e.g. --shard-by gpu-a=2,gpu-b=1")
        name, raw = match.groups()
        try:
            weight = float(raw)
        except ValueError:
            weight = float("nan")
        if not (math.isfinite(weight) and weight > 0):
            raise UsageError(f"--shard-by {text!r}: weight {raw!r} of {name!r} is not a positive number",
                             "give each host a positive weight; to leave a host out, leave it out of --on")
        if weight > MAX_WEIGHT:
            raise UsageError(f"--shard-by {text!r}: weight {raw!r} of {name!r} is above {MAX_WEIGHT:g}",
                             "weights are ratios: give small numbers, e.g. --shard-by gpu-a=2,gpu-b=1")
        if name in weights:
            raise UsageError(f"--shard-by {text!r} names {name!r} twice", "give each host one weight")
        weights[name] = weight
    unknown = [h for h in weights if h not in hosts]
    missing = [h for h in hosts if h not in weights]
    if unknown:
        raise UsageError(f"--shard-by names {', '.join(unknown)}, not among the run's hosts ({', '.join(hosts)})",
                         "weigh only the hosts of --on")
    if missing:
        raise UsageError(f"--shard-by gives no weight to {', '.join(missing)}",
                         f"give every host a weight (e.g. {','.join(f'{h}=1' for h in hosts)}), or leave "
                         f"{missing[0]} out of --on")
    return "weights", {h: weights[h] for h in hosts}


def capacity_weights(widths: dict[str, int | None]) -> dict[str, float]:
    """Each host's data-parallel width as its weight; a host whose width is unknown counts as 1."""
    return {h: float(max(1, int(w or 1))) for h, w in widths.items()}


def plan(run_id: str, total: int, weights: dict[str, float], output_dirs: dict[str, str],
         members: dict[str, list[str]] | None = None) -> list[Shard]:
    """One shard per host (in the weights' order) with its contiguous range.

    :param members: a replica over several hosts by its head: ``{head: [head, worker, ...]}``;
        its shard holds them all (a host absent here holds a whole replica itself).
    """
    ranges = split(total, weights)
    return [Shard(id=f"s{i}", hosts=list((members or {}).get(host) or [host]), start=start, stop=stop, run_id=run_id,
                  output_dir=output_dirs.get(host, ""))
            for i, (host, (start, stop)) in enumerate(ranges.items())]


def moved_run_id(run_id: str, shard_id: str) -> str:
    """The run id of a moved range on its new host (that host may hold a shard of its own).

    The suffix is at most ``protocol.MOVED_SUFFIX_MAX`` long, which a user's run id leaves
    room for (``protocol.USER_RUN_ID_MAX``); a longer id never reaches a host.
    """
    protocol = wire.protocol
    moved = f"{run_id}.{shard_id}"
    if not protocol.RUN_ID_RE.match(moved):
        raise UsageError(f"the run id of the moved range, {moved[:40]!r}... ({len(moved)} characters), is longer "
                         f"than a host takes ({protocol.RUN_ID_MAX})",
                         f"this run's id is longer than the {protocol.USER_RUN_ID_MAX} characters a group run may "
                         f"have; start it again under a shorter run id")
    return moved


def root_id(shard_id: str) -> str:
    """The planned shard a shard descends from: ``s2`` for ``s2``, ``s2m1`` and ``s2m3``."""
    return shard_id.split("m", 1)[0]


def next_moved_id(manifest: GroupMap, shard: Shard) -> str:
    """The id the next range moved off ``shard`` gets: ``s1m1``, ``s1m2``, ...

    A move of a moved range keeps the root (``s1m1`` -> ``s1m2``, not ``s1m1m1``), so ids,
    and the run ids built from them, stay bounded however often a range moves.
    """
    root = root_id(shard.id)
    taken = {int(s.id[len(root) + 1:]) for s in manifest.shards
             if s.id.startswith(f"{root}m") and s.id[len(root) + 1:].isdigit()}
    k = max(taken, default=0) + 1
    if k >= wire.protocol.MOVE_LIMIT:
        raise UsageError(f"shard {root} of run {manifest.run_id} was moved {k - 1} times already",
                         "start the unfinished part as a new run")
    return f"{root}m{k}"


def reassign(manifest: GroupMap, shard: Shard, to_host: str, cut: int, output_dir: str,
             hosts: list[str] | None = None) -> Shard | None:
    """Close ``shard`` at ``cut`` and give ``[cut, old stop)`` to ``to_host`` as a new shard.

    ``cut`` is the first index not on the shard's host: what lies before it stays
    where it is, what lies after it is made once, by ``to_host``. Nothing to move
    (``cut`` at the end) returns None and changes nothing.

    :param hosts: the hosts of ``to_host``'s replica, head first, when it spans several.
    :raises ValueError: a cut outside the shard's range.
    """
    if not shard.start <= cut <= shard.stop:
        raise ValueError(f"cut {cut} is outside shard {shard.id} [{shard.start}, {shard.stop})")
    if cut == shard.stop:
        return None
    new_id = next_moved_id(manifest, shard)
    moved = Shard(id=new_id, hosts=list(hosts or [to_host]), start=cut, stop=shard.stop,
                  run_id=moved_run_id(manifest.run_id, new_id), output_dir=output_dir, moved_from=shard.id)
    old_stop = shard.stop
    shard.stop = cut
    shard.moved_to.append(new_id)
    manifest.shards.insert(manifest.shards.index(shard) + 1, moved)
    manifest.history.append({"event": "reassigned", "from": shard.label, "to": moved.label,
                             "range": [cut, old_stop], "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return moved


def coverage_problems(manifest: GroupMap) -> list[str]:
    """Why the shards do not partition ``[0, total)`` exactly once (empty: they do)."""
    problems = []
    ranges = sorted((s.start, s.stop, s.id) for s in manifest.shards if not s.empty)
    at = 0
    for start, stop, sid in ranges:
        if start > at:
            problems.append(f"indices {at}..{start - 1} belong to no shard")
        elif start < at:
            problems.append(f"shard {sid} overlaps indices {start}..{min(at, stop) - 1}")
        at = max(at, stop)
    if at < manifest.total:
        problems.append(f"indices {at}..{manifest.total - 1} belong to no shard")
    if at > manifest.total:
        problems.append(f"shards reach index {at - 1}, past the {manifest.total} samples")
    for shard in manifest.shards:
        if not shard.hosts:
            problems.append(f"shard {shard.id} has no host")
    return problems


def owner_of(manifest: GroupMap, index: int) -> Shard:
    """The shard whose range holds global sample ``index``."""
    for shard in manifest.shards:
        if shard.start <= index < shard.stop:
            return shard
    raise KeyError(index)


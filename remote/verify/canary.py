"""The canary inside ``extract``: the run's first samples checked while the run goes on.

The ``vllm-server`` engine asks the server for the prompt logprobs of the run's first
``canary_samples`` samples (set on the laptop: the inventory field or ``--canary-samples N``,
default :data:`remote.wire.contract.CANARY_SAMPLES`, 0: no canary; resolved once into the run's
:attr:`remote.extract.runplan.Plan.canary_samples`) in the same request that captures their states
(:mod:`remote.extract.engines.vllm_server.prompt_logprobs`). As each of them lands, the engine
calls :meth:`Canary.check`: the logits check of :mod:`remote.verify.logits` on that one
file -- the captured last state through the checkpoint's final norm and ``lm_head`` (only
those two tensors, read once per run), against the engine's own logprobs. A fail raises
:class:`CanaryFailed`: the run stops with that check named as its error (the engine's
``error_record``), minutes after the server is ready instead of after the whole dataset.
``canary: false`` in the run's params keeps the records but never stops the run.

Each check's record goes to ``<run_dir>/prompt_logprobs/canary.json`` (a list, one record
per checked sample); ``fetch`` brings that dir back with the logs (:data:`remote.wire.contract.RUN_DIRS`). A check computes at most the first :data:`MAX_POSITIONS` positions of
its sample (the landing already checked that the file holds the request's tokens). A run
whose ids lack the last state (``input:N``) records a ``skipped`` canary and goes on; a
canary that cannot run records a ``warn`` and the run goes on. Stdlib only at import.
"""
from __future__ import annotations

import threading
import time
import traceback
from pathlib import Path

from remote.system import modelconfig
from remote.wire import contract, fsutil, layers, protocol

#: positions a canary check computes at most (its first ones): a real ``lm_head`` is ~10 GFLOP a
#: position in float32 and bf16, on a landing thread that the engine keeps at one torch thread.
MAX_POSITIONS = 512


class CanaryFailed(RuntimeError):
    """A canary sample failed the logits check; :attr:`record` is the check's record."""

    def __init__(self, record: dict):
        self.record = record
        super().__init__(f"canary: {record['name']} {record['status']}: {record['summary']}")

    def error(self) -> dict:
        """The run's error (``status.json``): the check named, its cause and fix."""
        from remote.wire import status

        return status.error("CanaryFailed", self.record["summary"], where="canary", check=self.record["name"],
                            fix=self.record.get("fix"), detail=self.record.get("detail"),
                            source=f"{contract.PROMPT_LOGPROBS_DIR}/{contract.CANARY_FILE}")


class Canary:
    """The logits check of single landed samples, the final norm and ``lm_head`` loaded on first use.

    :param layer_ids: the run's ids in ``convention``; :param folder: the run's prompt logprobs dir.
    """

    def __init__(self, model_path: str, layer_ids, convention: str, params: dict, folder, expected: int = 0):
        self.model_path, self.layer_ids, self.convention = str(model_path), list(layer_ids), convention
        self.stop = params.get("canary") is not False
        self.folder = Path(folder)
        #: the head is dropped once this many samples were checked (a real lm_head is GBs in float32)
        self.expected = int(expected)
        self.head = None
        self.records: list[dict] = []
        self._lock = threading.Lock()
        self.config, self.num_layers, self.last = None, None, None
        try:
            self.config = modelconfig.read(self.model_path)
            self.num_layers = modelconfig.decoder_layers(self.config)
            top = self.num_layers if convention == layers.INPUT else self.num_layers - 1
            self.last = top if top in self.layer_ids else None
        except Exception as exc:  # checked in _check, where a record says so; never the run's failure
            self.broken = f"{type(exc).__name__}: {exc}"
        else:
            self.broken = None

    def check(self, index: int, path) -> dict:
        """Check landed sample ``index`` (its file at ``path``); its record.

        :raises CanaryFailed: the check failed and the run's ``canary`` is on.
        """
        with self._lock:  # one check at a time: the head is loaded once, the checks share it
            t0 = time.monotonic()
            try:
                record = self._check(index, Path(path))
            except Exception as exc:  # the canary's own failure never stops a run: it says so instead
                traceback.print_exc()
                record = protocol.record("canary.logits", protocol.WARN, f"the canary check of sample {index} "
                                         f"could not run: {type(exc).__name__}: {exc}",
                                         detail={"index": index, "error": f"{type(exc).__name__}: {exc}"},
                                         fix="verify the run with specops verify --reference logits")
            record["detail"]["seconds"] = round(time.monotonic() - t0, 3)
            self.records.append(record)
            fsutil.write_json(self.folder / contract.CANARY_FILE, self.records)
            if self.expected and len(self.records) >= self.expected:
                self.head = None  # every canary sample is checked: the run needs the memory back
        if record["status"] == protocol.FAIL and self.stop:
            raise CanaryFailed(record)
        return record

    def _check(self, index: int, path: Path) -> dict:
        from remote.verify import logits
        from remote.verify.run import load_sample

        name = "canary.logits"
        if self.broken:
            raise RuntimeError(f"the model's config could not be read: {self.broken}")
        if self.last is None:
            return protocol.record(name, protocol.SKIPPED, f"skipped: the run does not capture the last state "
                                   f"({self.convention}:{self.num_layers}); ids {self.layer_ids}",
                                   detail={"index": index})
        found = self.folder / contract.prompt_logprobs_name(index)
        if not found.exists():
            why = logits.unavailable_why(self.folder.parent) or f"no prompt logprobs were recorded for sample {index}"
            return protocol.record(name, protocol.SKIPPED, f"skipped: {why}", detail={"index": index, "why": why})
        if self.head is None:
            self.head = logits.Head(self.model_path, self.config, self.num_layers)
        manifest = {"layer_ids": self.layer_ids, "file_layer_ids": sorted(self.layer_ids)}
        data = load_sample(path, manifest)
        n = MAX_POSITIONS + 1  # tokens: positions + the first
        states = {lid: h[:n] for lid, h in zip(self.layer_ids, data["hidden_states"])}
        kept = _first_tokens(found, n)
        scales = data.get("scales")
        sample = logits.Sample(index, path.name, data["input_ids"][:n], states, kept,
                               scales=scales[:n] if scales is not None else None)
        sample.result = logits.compare(self.head, states[self.last], sample.ids, sample.logprobs,
                                       scales=sample.scales)
        if sample.result["status"] == protocol.FAIL:
            run = _RunView(self.convention)
            others = [sample, *self._recorded_others(index, n)]
            sample.cause = logits.find_cause(self.head, sample, others, self.last, run, self.num_layers,
                                             self.model_path, self.config)
        record = logits.logits_record([sample], _RunView(self.convention), self.last)
        record["name"] = name
        record["detail"]["index"] = index
        return record


    def _recorded_others(self, index: int, n: int) -> list:
        """The other samples whose prompt logprobs are recorded so far (their first ``n`` tokens), for
        :func:`remote.verify.logits.find_cause` to try: a file holding another request's states is named."""
        from remote.verify import logits

        others = []
        for found in sorted(self.folder.glob("prompt_logprobs_*.json")):
            match = contract.PROMPT_LOGPROBS_RE.match(found.name)
            if not match or int(match.group(1)) == index:
                continue
            try:
                kept = _first_tokens(found, n)
            except (OSError, ValueError):  # being written by another landing thread: not a candidate yet
                continue
            other = int(match.group(1))
            others.append(logits.Sample(other, contract.sample_name(other, contract.HS), kept["token_ids"], {}, kept))
        return others


#: the canary's status -> the status of the record that shows it after the run (a failed canary whose
#: run went on, ``canary: false``, is a warning there: the run itself is done).
SHOWN_AS = {"ok": protocol.OK, "warn": protocol.WARN, "fail": protocol.WARN, "skipped": protocol.SKIPPED,
            "off": protocol.SKIPPED, "not run": protocol.SKIPPED}


def summarize(records, asked: int, engine: str) -> dict | None:
    """What the canary of a run found, for its manifest, status and summary (None: an engine that runs no
    canary): ``{"status", "asked", "checked", "samples", "top1_agree", "positions", "floor_ratio_max",
    "seconds", "per_sample", "summary"}``.

    ``status`` is the worst record's (ok, warn, skipped, fail), ``off`` with ``canary_samples: 0``, and
    ``not run`` when samples were asked but no check recorded (the canary samples were written by an
    earlier attempt of a resumed run whose canary.json is gone, or the engine gave no logprobs).
    ``shown`` is the status of the record that shows it afterwards (:data:`SHOWN_AS`).

    >>> summarize([], 0, "vllm-server")["summary"]
    'off (canary_samples: 0)'
    >>> summarize([], 2, "speculators-0.3") is None
    True
    """
    if engine not in contract.CANARY_ENGINES:
        return None
    if not asked:
        return {"status": "off", "shown": protocol.SKIPPED, "asked": 0, "checked": 0, "samples": [],
                "summary": "off (canary_samples: 0)"}
    records = [r for r in records or () if isinstance(r, dict) and isinstance(r.get("detail"), dict)]
    if not records:
        return {"status": "not run", "shown": protocol.SKIPPED, "asked": asked, "checked": 0, "samples": [],
                "summary": f"not run: no check of the {asked} canary sample(s) was recorded"}
    per_sample = []
    for rec in records:
        numbers = next(iter((rec["detail"].get("samples") or {}).values()), {})
        per_sample.append({"index": rec["detail"].get("index"), "status": rec["status"],
                           "top1_agree": numbers.get("top1_agree"), "positions": numbers.get("positions"),
                           "floor_ratio": numbers.get("floor_ratio"), "seconds": rec["detail"].get("seconds")})
    # records are kept in the order samples landed: shown by sample index
    per_sample.sort(key=lambda s: (s["index"] is None, s["index"] or 0))
    status = max((r["status"] for r in records), key=contract.SEVERITY.__getitem__)
    checked = [s for s in per_sample if s["top1_agree"] is not None]
    out = {"status": status, "shown": SHOWN_AS.get(status, protocol.WARN), "asked": asked, "checked": len(checked),
           "samples": [s["index"] for s in per_sample], "per_sample": per_sample,
           "top1_agree": sum(s["top1_agree"] for s in checked) if checked else None,
           "positions": sum(s["positions"] or 0 for s in checked) if checked else None,
           "floor_ratio_max": max((s["floor_ratio"] for s in checked if s["floor_ratio"] is not None), default=None),
           "seconds": round(sum(s["seconds"] or 0.0 for s in per_sample), 3)}
    text = f"{status}: {len(checked)} of {asked} sample(s) {out['samples']} checked"
    if checked:
        text += f", top-1 {out['top1_agree']}/{out['positions']}"
        if out["floor_ratio_max"] is not None:
            text += f", up to {out['floor_ratio_max']:.2f}x the rounding floor"
    text += f", {out['seconds']:.1f} s"
    if status != protocol.OK:
        first = next(r for r in records if r["status"] == status)
        text += f" ({first['summary'][:160]})"
    out["summary"] = text
    return out


def shown_record(name: str, found: dict) -> dict:
    """The record ``name`` that shows a run's canary (:func:`summarize`'s answer) in ``status`` and the
    extract's output."""
    status = found.get("shown") or protocol.WARN
    return protocol.record(name, status, f"canary {found.get('summary')}", detail=found,
                           fix="verify the run: specops verify --run-id ... --reference logits"
                           if status == protocol.WARN else None)


def summarize_run(run_dir, asked: int, engine: str) -> dict | None:
    """:func:`summarize` of the records the canary wrote in ``run_dir`` (a missing or unreadable file: none)."""
    import json

    try:
        records = json.loads((Path(run_dir) / contract.PROMPT_LOGPROBS_DIR / contract.CANARY_FILE).read_text())
    except (OSError, ValueError):
        records = []
    return summarize(records if isinstance(records, list) else [], asked, engine)


def _first_tokens(path: Path, n: int) -> dict:
    """A sample's recorded prompt logprobs, cut to its first ``n`` tokens (the positions a check computes)."""
    from remote.extract.engines.vllm_server import prompt_logprobs

    kept = prompt_logprobs.read(path)
    return dict(kept, token_ids=kept["token_ids"][:n], positions=kept["positions"][:n - 1])


class _RunView:
    """What :func:`remote.verify.logits.logits_record` reads of a run."""

    def __init__(self, convention: str):
        self.convention = convention

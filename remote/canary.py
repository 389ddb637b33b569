"""The canary inside ``extract``: the run's first samples checked while the run goes on.

The ``vllm-server`` engine asks the server for the prompt logprobs of the run's first
``canary_samples`` samples (set on the laptop: the inventory field or ``--canary-samples N``,
default :data:`remote.contract.CANARY_SAMPLES`, 0: no canary; resolved once into the run's
:attr:`remote.runplan.Plan.canary_samples`) in the same request that captures their states
(:mod:`remote.engines.vllm_server.prompt_logprobs`). As each of them lands, the engine
calls :meth:`Canary.check`: the logits check of :mod:`remote.verify.logits` on that one
file -- the captured last state through the checkpoint's final norm and ``lm_head`` (only
those two tensors, read once per run), against the engine's own logprobs. A fail raises
:class:`CanaryFailed`: the run stops with that check named as its error (the engine's
``error_record``), minutes after the server is ready instead of after the whole dataset.
``canary: false`` in the run's params keeps the records but never stops the run.

Each check's record goes to ``<run_dir>/prompt_logprobs/canary.json`` (a list, one record
per checked sample); ``fetch`` brings that dir back with the logs (:data:`remote.contract.RUN_DIRS`). A check computes at most the first :data:`MAX_POSITIONS` positions of
its sample (the landing already checked that the file holds the request's tokens). A run
whose ids lack the last state (``input:N``) records a ``skipped`` canary and goes on; a
canary that cannot run records a ``warn`` and the run goes on. Stdlib only at import.
"""
from __future__ import annotations

import threading
import time
import traceback
from pathlib import Path

from remote import contract, fsutil, layers, modelconfig, protocol


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
        return {"rank": None, "type": "CanaryFailed", "where": "canary", "check": self.record["name"],
                "message": self.record["summary"], "fix": self.record.get("fix"), "traceback": "",
                "detail": self.record.get("detail"), "source": str(contract.PROMPT_LOGPROBS_DIR + "/" +
                                                                  contract.CANARY_FILE)}


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


def _first_tokens(path: Path, n: int) -> dict:
    """A sample's recorded prompt logprobs, cut to its first ``n`` tokens (the positions a check computes)."""
    from remote.engines.vllm_server import prompt_logprobs

    kept = prompt_logprobs.read(path)
    return dict(kept, token_ids=kept["token_ids"][:n], positions=kept["positions"][:n - 1])


class _RunView:
    """What :func:`remote.verify.logits.logits_record` reads of a run."""

    def __init__(self, convention: str):
        self.convention = convention

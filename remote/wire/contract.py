"""What both sides of the SSH wire agree on, defined once (stdlib only).

The host writes these values and the laptop reads them: run states and the exit code
each means, record statuses and their order, the engine table, the run-id rule, the
sample file names and the run parameters' defaults. The host imports it as
``remote.wire.contract``, the laptop as ``specops.wire.contract``: one file, so a second
copy never has to be kept in step::

    >>> RunState("failed").is_final, RunState("failed").exit_code
    (True, 100)
    >>> RunState.LOADING == "loading", ENGINES["vllm-server"].convention
    (True, 'input')
    >>> run_id_problem("../x")
    "run id '../x' is not a valid run id"
    >>> run_id_fix(8)
    'use 1-8 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit'

Importing it does nothing beyond defining these names (the laptop relies on that).

.. note:: Python 3.10 runs the host side, so :class:`RunState` is a ``str`` enum built
   by hand (``enum.StrEnum`` is 3.11+); a state compares equal to its JSON string.
"""
from __future__ import annotations

import enum
import re
from typing import NamedTuple

# --------------------------------------------------------------------------- run states


class RunState(str, enum.Enum):
    """Every state a run passes through, in order, as ``status.json`` spells it.

    The last three are final; ``missing`` is the laptop's word for "the host has no such
    run" and is never written to a status file.
    """

    MISSING = "missing"
    PENDING = "pending"
    LOADING = "loading"
    EXTRACTING = "extracting"
    #: a training run's (remote/train/supervisor.py) working state
    TRAINING = "training"
    WRITING = "writing"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    def __str__(self) -> str:
        return self.value

    @property
    def is_final(self) -> bool:
        """Done, failed or aborted: the run will not change any more by itself."""
        return self in (RunState.DONE, RunState.FAILED, RunState.ABORTED)

    @property
    def exit_code(self) -> int:
        """The job exit code this state means (SkyPilot's ``JobExitCode``): 0, 100, 101, 102 or 103."""
        return JOB_EXIT_CODES.get(self, JOB_RUNNING_EXIT)


#: the states a status file can hold, in the order a run passes through them.
STATES = tuple(s.value for s in RunState if s is not RunState.MISSING)
FINAL_STATES = tuple(s.value for s in RunState if s.is_final)
#: the job exit code of every state that is not "still running" (:data:`JOB_RUNNING_EXIT`).
JOB_RUNNING_EXIT = 101
JOB_EXIT_CODES = {RunState.DONE: 0, RunState.FAILED: 100, RunState.MISSING: 102, RunState.ABORTED: 103}


def job_exit_code(state) -> int:
    """The job exit code of a state as a string (an unknown one is still running)."""
    try:
        return RunState(state).exit_code
    except ValueError:
        return JOB_RUNNING_EXIT


# --------------------------------------------------------------------------- record statuses

OK, CHANGED, SKIPPED, WARN, FAIL = "ok", "changed", "skipped", "warn", "fail"
#: every record status, in the order a person reads them.
STATUSES = (OK, CHANGED, SKIPPED, WARN, FAIL)
#: how bad each status is: the worst of a host's records decides its recap and exit code.
SEVERITY = {SKIPPED: 0, OK: 1, CHANGED: 2, WARN: 3, FAIL: 4}

# --------------------------------------------------------------------------- engines

#: the layer conventions (:mod:`remote.wire.layers` says what each means).
OUTPUT, INPUT = "output", "input"
LAYER_CONVENTIONS = (OUTPUT, INPUT)
#: the sample file formats (:mod:`remote.extract.samples`): speculators 0.3's and speculators >= 0.5's.
PT, HS = "pt", "hs"


class EngineFacts(NamedTuple):
    #: the convention its layer ids are written in.
    convention: str
    #: the sample file format it writes.
    sample_format: str


#: the engines' names: speculators 0.3's in-process generator (vLLM 0.16), vLLM's own
#: OpenAI server with the hidden-states connector (speculators >= 0.5), the transformers reference.
SPECULATORS_03, VLLM_SERVER, HF_REFERENCE = "speculators-0.3", "vllm-server", "hf-reference"
#: engine name -> what a run with it captures and writes.
ENGINES = {
    SPECULATORS_03: EngineFacts(OUTPUT, PT),
    VLLM_SERVER: EngineFacts(INPUT, HS),
    HF_REFERENCE: EngineFacts(OUTPUT, PT),
}
#: ``engine: auto`` (the default): the host picks from its installed speculators.
AUTO_ENGINE = "auto"
#: what a user may name: ``auto`` first, then every engine.
ENGINE_CHOICES = (AUTO_ENGINE, *ENGINES)
#: other spellings people type.
ENGINE_ALIASES = {"hf_reference": HF_REFERENCE, "hf": HF_REFERENCE,
                  "speculators_v03": SPECULATORS_03, "speculators": SPECULATORS_03,
                  "vllm_server": VLLM_SERVER, "server": VLLM_SERVER}

#: what ``engine: auto`` (the default) picks from the host's installed speculators:
#: specifier -> engine, first match wins. 0.3/0.4 still ship the in-process generator;
#: 0.5 removed it, and from then on hidden states come from vLLM's own server.
ENGINE_FOR_SPECULATORS = (("<0.5", SPECULATORS_03), (">=0.5", VLLM_SERVER))


def canonical_name(name: str) -> str:
    """The registry name for ``name``; raises ValueError naming the known engines."""
    key = ENGINE_ALIASES.get(name, name)
    if key not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; known engines: {sorted(ENGINES)}")
    return key


BF16, FP8 = "bf16", "fp8"
STATE_FORMATS = (BF16, FP8)
#: the tensor of an fp8 file that holds the per-token scales (hs-connectors' ``fp8_utils.SCALES_KEY``).
FP8_SCALES_KEY = "hidden_states_scales"
#: the engines that can write fp8 states.
FP8_ENGINES = (VLLM_SERVER,)
#: fp8's speed, measured (issue 43: GPU round 22 on an H100 at real width, vLLM 0.26, a DeepSeek-V3-shaped target,
#: hidden 7168, 64 x 4096-token samples, the CLI's step budget (4096 on a GPU) and concurrency, the median of three
#: passes each; tests/fixtures/gpu/round22/fp8_speed): the share of plain prefill extraction landed (manifest done)
#: and made durable with specops' fp8 connector (quantized on the GPU by vLLM's fused per-token kernel, the
#: engine's default) and with bf16, and landed with hs-connectors 0.9.0's own fp8 connector (quantized on the host
#: CPU after a bf16 copy: the fallback where specops' cannot run).
FP8_SPEED = {"fp8_of_plain": 0.869, "bf16_of_plain": 0.875, "stock_fp8_of_plain": 0.293,
             "fp8_durable_of_plain": 0.426, "bf16_durable_of_plain": 0.306,
             "measured": "H100 at DeepSeek-V3 width, vLLM 0.26"}
#: the same, in words (preflight's capacity advice)
FP8_SPEED_COST = (f"{FP8_SPEED['fp8_of_plain']} of plain prefill landed vs bf16's {FP8_SPEED['bf16_of_plain']}, "
                  f"{FP8_SPEED['fp8_durable_of_plain']} on disk vs bf16's {FP8_SPEED['bf16_durable_of_plain']} "
                  f"({FP8_SPEED['measured']}; hs-connectors' own fp8 connector, the fallback: "
                  f"{FP8_SPEED['stock_fp8_of_plain']} landed)")
#: format -> the read backend speculators' trainer needs (``--hidden-states-backend``): its default
#: ``file`` backend reads an fp8 file without its scales, silently wrong.
READ_BACKENDS = {BF16: "file", FP8: "fp8"}


def state_format(params: dict) -> str:
    """The run's ``format`` parameter (bf16 when unset)."""
    return params.get("format") or BF16


# --------------------------------------------------------------------------- run ids

#: a run id as a host takes it: a run dir's name (and an output dir's), at most RUN_ID_MAX characters.
RUN_ID_MAX = 128
#: a group run names a range moved to another host ``<run-id>.<shard id>``; shard ids are
#: ``s<k>`` or ``s<k>m<n>`` (a move of a move keeps its root: ``s2m3``, never ``s2m1m1``), with
#: k and n below MOVE_LIMIT, so this is the longest suffix ever appended to a user's id.
MOVE_LIMIT = 10000
MOVED_SUFFIX_MAX = len(f".s{MOVE_LIMIT - 1}m{MOVE_LIMIT - 1}")
#: the longest run id a user may give: the host's limit less the longest suffix we append.
USER_RUN_ID_MAX = RUN_ID_MAX - MOVED_SUFFIX_MAX


def run_id_pattern(limit: int = RUN_ID_MAX) -> re.Pattern:
    """The run-id rule for ids of at most ``limit`` characters (letters, digits, ``._-``; not ``.``/``-`` first)."""
    return re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,%d}$" % (limit - 1))


RUN_ID_RE = run_id_pattern(RUN_ID_MAX)
USER_RUN_ID_RE = run_id_pattern(USER_RUN_ID_MAX)


def run_id_problem(run_id, limit: int = RUN_ID_MAX) -> str | None:
    """Why ``run_id`` is not a run id of at most ``limit`` characters, in one line; None when it is one."""
    text = str(run_id)
    if run_id_pattern(limit).match(text):
        return None
    shown = f"{text[:40]!r}{'...' if len(text) > 40 else ''}"
    length = f" ({len(text)} characters, at most {limit})" if len(text) > limit and RUN_ID_RE.match(text) else ""
    return f"run id {shown} is not a valid run id{length}"


def run_id_fix(limit: int = RUN_ID_MAX) -> str:
    """What a valid run id of at most ``limit`` characters is made of (the fix of :func:`run_id_problem`)."""
    return f"use 1-{limit} characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"


# --------------------------------------------------------------------------- sample files

#: format -> the name of sample ``{index}``, and the subdir of the output dir it lives in.
SAMPLE_FILES = {PT: ("data_{index}.pt", ""), HS: ("hs_{index}.safetensors", "hidden_states")}
MANIFEST = "manifest.json"
SUMMARY = "summary.json"
#: a run dir's own files (:mod:`remote.run.rundir`); the laptop fetches these by name.
PARAMS_FILE, STATUS_FILE = "params.json", "status.json"
#: what a whole epoch checkpoint of a train run holds. speculators writes them one file after another into
#: the numbered dir, so a SIGTERM or a kill mid-save leaves a dir without the last ones, and its own resume
#: (the highest numbered dir) would then fail reading the optimizer state. The laptop reads it too: a run
#: over several hosts copies the head's last whole epoch to the other nodes (specops.trainnodes).
CHECKPOINT_COMPLETE = ("model.safetensors", "optimizer_state_dict.pt", "training_state.json")
#: ``eval``: the host task's pid in its eval dir (``<work_dir>/evals/<name>``) while it runs, for Ctrl-C to stop it
EVAL_PID_FILE = "eval.pid"
RUN_FILES = (PARAMS_FILE, STATUS_FILE, MANIFEST, SUMMARY)

#: the engine's own prompt logprobs of a run's first samples (the canary samples), one JSON file per
#: sample in this subdir of the run dir: what ``verify --reference logits`` and the canary compare
#: the captured last state with (:mod:`remote.verify.logits`). ``unavailable.json`` there says why an
#: engine gave none.
PROMPT_LOGPROBS_DIR = "prompt_logprobs"
PROMPT_LOGPROBS_UNAVAILABLE = "unavailable.json"
#: the canary's records (:mod:`remote.verify.canary`), in the same subdir.
CANARY_FILE = "canary.json"
#: how many of a run's first samples ask for their prompt logprobs (the run parameter
#: ``canary_samples``: inventory field and ``--canary-samples``; 0 turns the canary off), and how many
#: top tokens each position keeps (vLLM's ``max_logprobs`` is 20 by default), unless the run's params
#: say otherwise.
CANARY_SAMPLES, PROMPT_LOGPROBS_TOP = 2, 5
#: what a run does with a sample longer than ``seq_len`` (``long_samples``): keep its first
#: ``seq_len`` tokens (and warn), stop before the load naming the sample, or leave the sample out
#: (remote/extract/dataset.py; the manifest counts each).
LONG_SAMPLES = ("truncate", "refuse", "drop")
#: how a chat row becomes samples (``turns``): per-turn = one sample per assistant turn, supervised from
#: that turn's render boundary to its end (end-of-turn token included: speculators 0.9's prepare-data);
#: whole = one sample per row, the text of every assistant reply supervised (speculators 0.3); auto =
#: the rule of the speculators installed where the run reads the data (remote/extract/dataset.py).
CHAT_TURNS = ("auto", "per-turn", "whole")
#: chunked prefill for the vllm-server engine (``chunked_prefill``): auto = on where the installed
#: connector writes a request's states once it is done (remote/extract/engines/vllm_server/chunking.py).
CHUNKED_PREFILL = ("auto", "on", "off")
#: the most canary samples a run may ask for: each is checked on a landing thread while the run goes
#: on (a real ``lm_head`` is ~10 GFLOP a position), and ``fetch`` brings every kept file back.
CANARY_SAMPLES_MAX = 32
#: the engines that can give prompt logprobs with the states (the others run no canary).
CANARY_ENGINES = (VLLM_SERVER,)
#: the engines whose requests ask for one generated token (``max_tokens: 1``), which needs a position of
#: its own: their longest sample is one token short of the model's ``max_position_embeddings``.
GENERATING_ENGINES = (VLLM_SERVER,)


def seq_len_limit(engine: str, max_positions: int) -> int:
    """The longest ``seq_len`` ``engine`` can extract within ``max_positions`` (vLLM refuses a
    ``--max-model-len`` beyond the model's positions unless told it may give wrong outputs)."""
    return max_positions - 1 if engine in GENERATING_ENGINES else max_positions
#: a run dir's subdirs the laptop fetches whole with :data:`RUN_FILES` (small files): the logs, the
#: errors, and the canary's records with the engine's prompt logprobs of the canary samples.
RUN_DIRS = ("logs", "errors", PROMPT_LOGPROBS_DIR)


def prompt_logprobs_name(index) -> str:
    """The file (in :data:`PROMPT_LOGPROBS_DIR`) of sample ``index``'s prompt logprobs."""
    return f"prompt_logprobs_{index}.json"


PROMPT_LOGPROBS_RE = re.compile(r"^prompt_logprobs_(\d+)\.json$")


def sample_name(index, fmt: str = PT) -> str:
    """The file name of sample ``index`` (no directory): ``data_3.pt`` / ``hs_3.safetensors``."""
    return SAMPLE_FILES[fmt][0].format(index=index)


def sample_pattern(fmt: str = PT) -> re.Pattern:
    """The file names of ``fmt``'s samples; group 1 is the index."""
    head, _, tail = SAMPLE_FILES[fmt][0].partition("{index}")
    return re.compile(f"^{re.escape(head)}(\\d+){re.escape(tail)}$")


# --------------------------------------------------------------------------- run parameters

#: what a run uses when neither the inventory nor a flag says otherwise.
DEFAULTS = {
    "engine": AUTO_ENGINE,
    # the draft algorithm a run captures states for, trains and serves (remote.wire.layers.ALGORITHMS)
    "algorithm": "eagle3",
    "tp": 1,
    "seq_len": 2048,
    "batch_size": 8,
    "max_samples": 1000,
    "gpu_memory_utilization": 0.9,
    "canary_samples": CANARY_SAMPLES,
    "long_samples": LONG_SAMPLES[0],
    "turns": CHAT_TURNS[0],
    # a sample with fewer supervised tokens is left out (counted in the manifest); 1: none with nothing to learn
    "minimum_valid_tokens": 1,
}


def state_format_problem(fmt, engine) -> str | None:
    """Why ``engine`` (a name, an alias or ``auto``: judged once it is concrete) cannot write states of ``fmt``
    (``needs the vllm-server engine; ...``, said after the format), or None: the one rule of fp8 (the laptop checks it before connecting, the run's plan on the host)."""
    name = ENGINE_ALIASES.get(engine, engine)
    if fmt == FP8 and name != AUTO_ENGINE and name not in FP8_ENGINES:
        return f"needs the {' or '.join(FP8_ENGINES)} engine; engine {name} writes its states unquantized"
    return None


def param(params: dict, name: str):
    """Run parameter ``name`` from ``params``, or its :data:`DEFAULTS` value when unset (missing, None or empty)."""
    value = params.get(name)
    return DEFAULTS[name] if value in (None, "") else value

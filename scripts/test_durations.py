"""Write tests/durations.json (seconds per test module) from a pytest junit report.

    make test PYTEST_ARGS="--junitxml=/tmp/junit.xml"
    .venv/bin/python scripts/test_durations.py /tmp/junit.xml

The xdist scheduler in tests/conftest.py hands out the longest module first; refresh the
file when modules are added or their cost changes a lot (an unknown module counts as a
typical one, so a stale file only costs balance, never a test).
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def module_seconds(junit_xml: Path) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).iter("testcase"):
        # classname is the dotted module path, plus the class for tests in a class
        parts = case.get("classname", "").split(".")
        while parts and not (REPO / Path(*parts).with_suffix(".py")).is_file():
            parts.pop()
        if parts:
            seconds[str(Path(*parts).with_suffix(".py"))] += float(case.get("time") or 0)
    return {module: round(total, 1) for module, total in sorted(seconds.items())}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    seconds = module_seconds(Path(argv[0]))
    if not seconds:
        print(f"{argv[0]}: no test case of this repo's tests in it", file=sys.stderr)
        return 1
    (REPO / "tests" / "durations.json").write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"tests/durations.json: {len(seconds)} modules, {sum(seconds.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

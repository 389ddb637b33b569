"""remote/wire/protocol.py is the one home of the markers and exit codes: host, template and controller.

The controller imports that very file on the laptop (as ``specops.wire.protocol``),
so it must import nothing but the standard library and change nothing when loaded; the
entry template gets the values from it when rendered. These tests run the real rendered
entry script and the real parser in ``specops/transport/remote_task.py``.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from specops import wire
from specops.transport.remote_task import StdinResult, needs_bundle
from specops.transport.render import render_entry

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import json, os, sys
before = (list(sys.path), dict(os.environ), set(sys.modules))
import specops.transport.host
from specops import wire
protocol = wire.protocol
after = (list(sys.path), dict(os.environ), set(sys.modules))
print(json.dumps({"path_same": before[0] == after[0], "env_same": before[1] == after[1],
                  "new_remote": sorted(m for m in after[2] - before[2]
                                     if m.split(".")[0] == "remote"),
                  "file": protocol.__file__, "codes": [protocol.NEED_BUNDLE_EXIT, protocol.ENTRY_ERROR_EXIT]}))
"""


def test_protocol_loads_on_the_laptop_without_side_effects(tmp_path):
    """In a fresh controller python, from another directory: no sys.path, env or sys.modules change."""
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["path_same"] and out["env_same"], out
    assert out["new_remote"] == [], out  # the laptop's name for it is specops.wire: no `remote` package
    assert Path(out["file"]).resolve() == (REPO / "remote" / "wire" / "protocol.py").resolve()
    assert out["codes"] == [75, 78]


def test_rendered_entry_takes_markers_from_protocol_and_host_reads_them(tmp_path):
    """The rendered script, run for real without its bundle, asks for it the way remote_task.py expects."""
    protocol = wire.protocol
    script = render_entry("facts", {"_bundle_dir": str(tmp_path / "bundles" / "0123456789abcdef0123")})
    for marker in (protocol.NEED_BUNDLE_MARKER, protocol.ENTRY_ERROR_MARKER):
        assert script.count(marker) == 1, marker  # one constant, no literal copies elsewhere
    (tmp_path / "bundles").mkdir()
    proc = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=60)
    assert proc.returncode == protocol.NEED_BUNDLE_EXIT, proc.stdout + proc.stderr
    assert needs_bundle(StdinResult(proc.stdout, proc.stderr, proc.returncode))
    # a python too old ends in the entry-error marker that remote_task.py turns into one error
    old = render_entry("facts", {"_bundle_dir": str(tmp_path / "bundles" / "x"), "_python_min": [99, 0]})
    proc = subprocess.run([sys.executable, "-"], input=old, capture_output=True, text=True, timeout=60)
    assert proc.returncode == protocol.ENTRY_ERROR_EXIT
    line = proc.stdout.split(protocol.ENTRY_ERROR_MARKER, 1)[1].splitlines()[0]
    assert json.loads(line)["kind"] == "python-too-old"

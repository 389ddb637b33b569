"""``specops eval``: a draft's acceptance on held-out prompts, served by vLLM with its target.

The work happens on the host (``remote/train/evaluate.py``), in the foreground: the draft's
config checked against the states it belongs to before anything loads (aux layer ids,
verifier, vocab: a mismatch is a fail showing both values and the fix), then vLLM started
with the draft as ``eagle3`` and ``k`` speculative tokens, the dataset rows after the
extraction's sent greedily, and acceptance read from the server's own /metrics: mean
acceptance length, the rate per position, output tokens/s (``--baseline``: the plain
server's too, a second start).

    >>> evaluate(inventory, "modern", draft="d1", k=3)
    eval.acceptance ok: train run d1, epoch 39, k=3: mean acceptance length 1.31, 61 of 243 draft tokens ...
"""
from __future__ import annotations

import time
from pathlib import PurePosixPath

from specops import wire
from specops.errors import SpecopsError, TaskInterrupted, UsageError
from specops.inventory import Inventory
from specops.result import HostReport, Record
from specops.transport.host import Host
from specops.transport.parallel import report_from_payload, run_on_hosts
from specops.transport.pool import HostPool

#: a CPU server start is 40-300 s, a second one with --baseline as long again.
EVAL_TIMEOUT_S = 3600.0


def eval_params(host: Host, draft: str, *, from_run: str | None = None, k: int | None = None, prompts=8,
                max_tokens: int = 32, baseline: bool = False, force: bool = False, name: str | None = None,
                measure: dict | None = None, algorithm: str | None = None) -> dict:
    params = {"work_dir": host.spec.work_dir, "draft": draft, "prompts": prompts, "max_tokens": int(max_tokens),
              "baseline": bool(baseline), "force": bool(force), "python": host.spec.python, "device": host.spec.device,
              "env": dict(host.spec.env), "tp": host.spec.tp, "trust_remote_code": host.spec.trust_remote_code,
              **(measure or {})}
    if name:
        params["name"] = name
    if from_run:
        params["from_run"] = from_run
    if k is not None:
        params["k"] = int(k)
    if algorithm:
        params["algorithm"] = str(algorithm)
    return params


def eval_step(host: Host, draft: str, **options) -> HostReport:
    """One eval on one host. On a host behind Slurm the task (its servers and the measurement) runs on a compute
    node through ``srun``, as verify does (``eval.node`` names the node), never on the login node; what it writes
    lands in the run dir on the shared filesystem."""
    from specops.slurm import launcher

    payload = host.run_task("draft_eval", eval_params(host, draft, **options), timeout=EVAL_TIMEOUT_S,
                            launcher=launcher(host.spec, "eval"))
    report = report_from_payload(host.name, "eval", payload)
    return report


def _whole(name: str, value, low: int, high: int | None = None) -> int | None:
    if value in (None, ""):
        return None
    flag = f"-{name}" if len(name) == 1 else f"--{name}"
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise UsageError(f"{flag} {value!r} is not a whole number", f"pass {flag} N") from None
    if number < low or (high is not None and number > high):
        raise UsageError(f"{flag} {number} is out of range",
                         f"pass {flag} N with N >= {low}" + (f" and N <= {high}" if high is not None else ""))
    return number


def _checked(name: str, value):
    """``value`` of eval's parameter ``name`` judged by its one declaration (remote/wire/argspec.py EVAL_ARGS).

    :raises UsageError: naming the flag, what it must be and the fix."""
    arg = wire.argspec.EVAL_ARGS[name]
    flag = f"--{arg.flag_of(name)}"
    try:
        return wire.argspec.judge(arg, value, name)
    except wire.argspec.BadValue as exc:
        raise UsageError(f"{flag} {value!r} {exc}", exc.fix_for(flag)) from None


def prompts_option(value):
    """``--prompts``: N held-out rows (a whole number), or a prompt file's path on the host (sent as given: its
    ``~`` is the host's)."""
    if value in (None, ""):
        return 8
    text = str(value).strip()
    if text.lstrip("+-").isdigit():
        return _checked("prompts", text)
    return str(value)


def _repeated(value) -> list:
    """A repeatable flag's values, each also split on commas (``--concurrency 1,4,16``)."""
    if value in (None, "", []):
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


def min_acceptance_option(values) -> dict:
    """``--min-acceptance-length X`` / ``CATEGORY=X`` (repeatable) as the gate's mapping (``*``: every category)."""
    out = {}
    for item in _repeated(values):
        category, _, number = item.rpartition("=")
        category = category.strip() or "*"
        try:
            bar = float(number)
        except ValueError:
            raise UsageError(f"--min-acceptance-length {item!r}: {number!r} is not a number",
                             "pass --min-acceptance-length X or CATEGORY=X, e.g. 2.0 or coding=2.1") from None
        if not 1.0 <= bar <= 64.0:
            raise UsageError(f"--min-acceptance-length {item!r}: {bar} is outside 1..64 (a mean acceptance length "
                             f"counts the bonus token: 1 is no draft token accepted)",
                             "pass a bar of at least 1, e.g. 2.0")
        if category in out:
            raise UsageError(f"--min-acceptance-length gives {category!r} twice", "give each category one bar")
        out[category] = bar
    return _checked("min_acceptance_length", out) if out else {}


def measure_options(temperature=None, concurrency=None, min_acceptance_length=None) -> dict:
    """The sweep and gate flags as eval's parameters, each judged by its declaration before anything connects."""
    out = {}
    if _repeated(temperature):
        out["temperature"] = _checked("temperature", _repeated(temperature))
    if _repeated(concurrency):
        out["concurrency"] = _checked("concurrency", _repeated(concurrency))
    bars = min_acceptance_option(min_acceptance_length)
    if bars:
        out["min_acceptance_length"] = bars
    return out


def record_history(reports: list[HostReport], draft: str, force: bool) -> list:
    """Append each host's measured eval to the history (specops.evals); the paths written."""
    from specops import evals

    written = []
    for report in reports:
        by_name = {r.name: r for r in report.records}
        acc = by_name.get("eval.acceptance")
        if acc is None or not (acc.detail or {}).get("draft_sha256"):
            continue
        gate = by_name.get("eval.gate")
        entry = evals.entry_of(report.host, draft, acc.detail, gate.model_dump() if gate else None, force=force)
        dest = evals.eval_dir(report.host, acc.detail)
        try:
            files, why_not = evals.draw(acc.detail, dest)
        except (OSError, ValueError) as exc:  # the measurement stands and is kept; its pictures are a nicety
            files, why_not = [], f"{type(exc).__name__}: {exc}"
        entry["files"] = str(dest)
        written.append(evals.append(entry))
        report.records.append(Record(
            name="eval.files", status="ok" if why_not is None else "warn",
            summary=f"{', '.join(files)} in {dest}; kept in the eval history ({written[-1]}: specops evals)"
                    + ("" if why_not is None else f"; no pictures: {why_not}"),
            detail={"dir": str(dest), "files": files, "history": str(written[-1])}))
    return written


def evaluate(inventory: Inventory, selector: str | None, *, draft: str | None, from_run: str | None = None,
             k=None, prompts=8, max_tokens=32, baseline: bool = False, force: bool = False, temperature=None,
             concurrency=None, min_acceptance_length=None, accept_new_host_key: bool = False,
             algorithm: str | None = None) -> list[HostReport]:
    """Evaluate ``draft`` (a train run id or a checkpoint dir on the host) on every selected host; each measured
    eval is appended to the history (``specops evals``)."""
    if not draft:
        raise UsageError("--draft is required", "pass a train run id (specops train --run-id) or a draft dir on the host")
    if from_run:
        from specops.runid import check_run_id

        check_run_id(from_run)
    # the eval's dir on the host is named here, so that Ctrl-C can find what it started there
    name = f"{PurePosixPath(str(draft)).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    options = {"from_run": from_run, "k": _whole("k", k, 1, 16), "prompts": prompts_option(prompts),
               "max_tokens": _whole("max-tokens", max_tokens, 1) or 32, "baseline": bool(baseline),
               "force": bool(force), "name": name, "algorithm": algorithm,
               "measure": measure_options(temperature, concurrency, min_acceptance_length)}
    try:
        reports = run_on_hosts(inventory, selector, "eval", lambda h: eval_step(h, draft, **options),
                               accept_new_host_key=accept_new_host_key)
    except KeyboardInterrupt:
        stopped = [stop_eval(host, name) for host in HostPool(inventory, accept_new_host_key).selected(selector)]
        raise TaskInterrupted(f"eval interrupted (Ctrl-C): {'; '.join(stopped)}",
                              "run the same eval again; nothing of this one is kept but its server log") from None
    record_history(reports, str(draft), bool(force))
    return reports


def stop_eval(host: Host, name: str) -> str:
    """Stop eval ``name`` on ``host`` (SIGTERM to the host task, whose own handler stops the vLLM server it
    started, and the server dies with it anyway: remote.extract.engines.vllm_server.DIE_WITH_PARENT); what was done."""
    import shlex

    from specops import wire

    pid_file = f"{host.spec.work_dir.rstrip('/')}/evals/{name}/{wire.contract.EVAL_PID_FILE}"
    try:
        out = host.run(f"pid=$(cat {shlex.quote(pid_file)} 2>/dev/null) && kill -TERM \"$pid\" && echo \"$pid\"",
                       timeout=30)
    except SpecopsError as exc:
        return f"{host.name}: could not reach it to stop the eval ({exc.message}); its server stops with it"
    finally:
        host.close()
    pid = (out.stdout or "").strip()
    return (f"{host.name}: stopped the eval (pid {pid}) and the vLLM server it started" if pid else
            f"{host.name}: the eval had not started its server yet (nothing left running)")

"""Whether the installed hidden-states connector lets a prompt be prefilled in chunks (stdlib only).

A connector that writes a request's states from a per-step hook (``save_kv_layer``,
``wait_for_save``) sees one chunk of a chunked prompt at a time, so chunked prefill must be
off and every prompt must fit one step. vLLM moved the write to ``get_finished`` (PR 43805:
after the request's last chunk, read back from the KV cache); from there on a prompt longer
than the step budget extracts whole. vLLM's own docs still say "off" (its issue 52074), so
the answer is read from the connector's source, along its class chain, as the drift checks
read APIs: nothing is imported.

:func:`when_it_writes` answers from a class chain (nearest class first: a method defined
nearer wins, as at run time); ``remote.extract.engines.vllm_server.command`` walks the installed
connector's chain.
"""
from __future__ import annotations

import ast

from remote.wire import argspec

#: calls that put a sample on disk
WRITE_CALLS = frozenset({"save_file", "save", "torch.save"})
#: hooks vLLM calls on every forward step
PER_STEP_HOOKS = ("save_kv_layer", "wait_for_save")
#: the hook vLLM calls once a request is done
FINISHED_HOOK = "get_finished"


def _methods(chain) -> dict:
    """``{name: FunctionDef}`` of the chain's methods, the nearest definition of each."""
    found = {}
    for _path, cls in chain:
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(node.name, node)
    return found


def _uses(func) -> tuple[set, set]:
    """(names of the calls in ``func``, names of ``self.<method>`` it refers to, called or handed on)."""
    calls, own = set(), set()
    for node in ast.walk(func):
        if isinstance(node, ast.Call):
            target = node.func
            if isinstance(target, ast.Name):
                calls.add(target.id)
            elif isinstance(target, ast.Attribute):
                calls.add(target.attr)
                if isinstance(target.value, ast.Name):
                    calls.add(f"{target.value.id}.{target.attr}")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            own.add(node.attr)  # self._write_tensors handed to an executor writes too
    return calls, own


def when_it_writes(chain) -> dict:
    """Which of the connector's hooks write a sample file, and whether chunked prefill is safe.

    :param chain: ``[(path, ast.ClassDef), ...]``, the connector's class first, then its bases.
    :returns: ``{"safe": bool, "writes_in": [hook names], "why": str}``.
    """
    methods = _methods(chain)
    memo: dict[str, bool] = {}

    def writes(name: str, seen=()) -> bool:
        if name in memo:
            return memo[name]
        func = methods.get(name)
        if func is None or name in seen:
            return False
        calls, own = _uses(func)
        memo[name] = bool(calls & WRITE_CALLS) or any(writes(m, seen + (name,)) for m in own if m in methods)
        return memo[name]

    writes_in = [hook for hook in PER_STEP_HOOKS + (FINISHED_HOOK,) if writes(hook)]
    where = chain[0][1].name if chain else "the connector"
    if not writes_in:
        return {"safe": False, "writes_in": [],
                "why": f"{where}: no hook of it writes a file that the source shows (read nothing to go on): "
                       f"chunked prefill stays off"}
    per_step = [hook for hook in writes_in if hook in PER_STEP_HOOKS]
    if per_step:
        return {"safe": False, "writes_in": writes_in,
                "why": f"{where} writes from {', '.join(per_step)} (every step): a chunked prompt would land "
                       f"chunk by chunk, so chunked prefill stays off"}
    return {"safe": True, "writes_in": writes_in,
            "why": f"{where} writes in {FINISHED_HOOK} (once the request's last chunk is done): "
                   f"chunked prefill is safe"}


#: server flags that would make the files wrong: with prefix caching on, a request's
#: ``hidden_states`` and ``token_ids`` lengths differ (vLLM issue 44485)
REFUSED_FLAGS = ("--enable-prefix-caching",)


def installed_verdict(connector: tuple) -> dict:
    """:func:`when_it_writes` for the connector ``(class name, module or None)`` as installed
    (a name without a module is looked up in vLLM's connector factory)."""
    from remote.drift.connector_source import installed_connector_chain

    return when_it_writes(installed_connector_chain(connector)[1])


def resolve(asked, verdict: dict) -> dict:
    """Chunked prefill for a run: ``{"on", "asked", "why"}``.

    :raises ValueError: naming the field and the fix, for a value its entry of the parameter table
        (``RUN_ARGS["chunked_prefill"]``: auto = on where the connector allows it) refuses, and for ``on``
        where the connector writes every step (its files would be partial).
    """
    asked = "auto" if asked in (None, "") else asked
    try:
        argspec.judge(argspec.RUN_ARGS["chunked_prefill"], asked)
    except argspec.BadValue as exc:
        raise ValueError(f"{exc.about('chunked_prefill', asked)}; {exc.fix_for('chunked_prefill')}") from None
    if asked == "off":
        return {"on": False, "asked": asked, "why": "chunked_prefill: off, as asked: every sample is one step"}
    if not verdict["safe"]:
        if asked == "on":
            raise ValueError(f"chunked_prefill: on, but {verdict['why']}; set chunked_prefill: auto or off "
                             f"(every sample is then one step: max_num_batched_tokens covers the longest)")
        return {"on": False, "asked": asked, "why": verdict["why"]}
    return {"on": True, "asked": asked, "why": verdict["why"]}


#: flags the engine sets from the run's own parameters: given again in ``server_args``, vLLM takes
#: the last one and the server captures other layers, writes elsewhere or serves another model
#: than the run records (a second ``--speculative-config`` is how the GPU round plants a shifted
#: final id). Each with the run parameter that sets it.
ENGINE_FLAGS = {"--speculative-config": "layer_ids", "--kv-transfer-config": "format / kv_connector / writer_threads",
                "--model": "model_path", "--host": None, "--port": None,
                "--tensor-parallel-size": "tp", "-tp": "tp", "--max-model-len": "seq_len"}


#: what a server without extraction (eval's, the benchmarks' baseline) leaves to ``server_args``:
#: eval serves its draft through its own ``--speculative-config``
EXTRACTION_ONLY_FLAGS = ("--speculative-config", "--kv-transfer-config")


def _engine_flags(plain: bool) -> dict:
    return {k: v for k, v in ENGINE_FLAGS.items() if not (plain and k in EXTRACTION_ONLY_FLAGS)}


def flag_of(arg: str, known) -> str | None:
    """The flag of ``known`` that the server argument ``arg`` sets, as vLLM's parser reads it (None: none):
    its ``FlexibleArgumentParser`` turns ``_`` into ``-`` in a ``--`` name (``--enable_prefix_caching``),
    takes ``--name.key=value`` as part of ``--name``, and argparse takes a unique prefix
    (``--enable-prefix``) for the whole flag."""
    key = str(arg).split("=", 1)[0]
    if key.startswith("--"):
        key = "--" + key[2:].split(".", 1)[0].replace("_", "-")
    if key in known:
        return key
    if key.startswith("--") and len(key) > 3:
        prefixed = [flag for flag in known if flag.startswith(key)]
        if len(prefixed) == 1:
            return prefixed[0]
    return None


def refused_flags(server_args, plain: bool = False) -> list[str]:
    """The flags of ``server_args`` that would make the extracted files wrong (``plain``: of a
    server without extraction, which sets no speculative or KV-transfer config of its own), as given."""
    known = (*REFUSED_FLAGS, *_engine_flags(plain))
    return [a for a in (str(x) for x in server_args or ()) if flag_of(a, known)]


def _as_given(arg: str, flag: str) -> str:
    key = arg.split("=", 1)[0]
    return flag if key == flag else f"{key} (vLLM reads it as {flag})"


def flag_value(args, flag: str) -> str | None:
    """The value ``args`` (an argv list) give ``flag``, read as vLLM's parser reads it (``--flag V``, ``--flag=V``,
    underscores for dashes, a unique prefix; the last one wins); None when not given."""
    value = None
    args = [str(a) for a in args or ()]
    for i, arg in enumerate(args):
        if flag_of(arg, (flag,)) != flag:
            continue
        if "=" in arg:
            value = arg.split("=", 1)[1]
        elif i + 1 < len(args):
            value = args[i + 1]
    return value


def server_args_problem(server_args, plain: bool = False) -> str | None:
    """What is wrong with ``server_args`` (None: nothing), naming each refused flag and its fix."""
    given = [str(x) for x in server_args or ()]
    own = _engine_flags(plain)
    problems = []
    for arg in given:
        flag = flag_of(arg, REFUSED_FLAGS)
        if flag:
            problems.append(f"{_as_given(arg, flag)} would make the extracted files wrong (a request's states and "
                            f"token ids differ in length with prefix caching): drop {arg.split('=', 1)[0]} from "
                            f"the run's server_args")
    seen = {}
    for arg in given:
        flag = flag_of(arg, own)
        if flag and flag not in seen:
            seen[flag] = arg
    for flag, arg in seen.items():
        param = ENGINE_FLAGS[flag]
        problems.append(f"{_as_given(arg, flag)} is set by the engine" + (f" from the run's {param}" if param else "")
                        + f" (vLLM would take the last one given, and the files would not be what the run "
                        f"records): drop {arg.split('=', 1)[0]} from server_args"
                        + (f" and set {param}" if param else ""))
    # the memory plan reads these (a value vLLM's parser would refuse at the start is refused here first)
    for flag, what, example in (("--max-num-batched-tokens", "tokens: give the step budget", 8192),
                                ("--max-num-seqs", "requests: give the sequences a step holds", 256),
                                ("--block-size", "tokens: give the KV block", 64)):
        value = flag_value(given, flag)
        if value is not None and not (value.isdigit() and int(value) > 0):
            problems.append(f"{flag} {value!r} is not a positive whole number of {what} as one, e.g. "
                            f"{flag} {example}")
    return "server_args: " + "; ".join(problems) if problems else None

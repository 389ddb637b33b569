"""Checkpoint probe: safetensors shards against their index, headers, sizes, and fit.

A safetensors file is ``<8-byte little-endian header length N><N bytes of JSON header>
<data>``, the header mapping each tensor to ``{"dtype", "shape", "data_offsets": [begin,
end]}`` relative to the start of the data. So a complete file is exactly
``8 + N + max(end)`` bytes: a shorter one is a truncated download, caught here by
reading a few KB per shard instead of loading hundreds of GB.

The index and every header entry are checked for their shape before use: an index that
is a list, a ``weight_map`` that is not an object, a header entry whose ``shape`` is not
a list of integers -- each is a fail record naming the file, the key and what belongs
there.
"""
from __future__ import annotations

import os
import re

from remote.probes import Context
from remote.system.jsonfile import Malformed
from remote.system.weights import INDEX_NAME, ShardError, find_weights, read_header
from remote.wire.protocol import FAIL, OK, SKIPPED, WARN, record
from remote.wire.words import MiB, human_bytes

#: Weights above this share of the per-GPU budget leave too little room for the KV cache.
TIGHT_SHARE = 0.9


def probe(ctx: Context) -> list:
    """Index vs disk, every shard's header and size, totals, and fit per TP rank."""
    model_path = ctx.params["model_path"]
    if not os.path.isdir(model_path):
        return [record("checkpoint.files", SKIPPED, f"model dir {model_path} does not exist", detail={})]
    try:
        index, expected, on_disk, others = find_weights(model_path)
    except Malformed as exc:
        return [record("checkpoint.files", FAIL, exc.summary, detail=exc.detail(), fix=exc.fix)]
    except (OSError, ValueError) as exc:
        return [record("checkpoint.files", FAIL, f"{INDEX_NAME} is unreadable: {exc}", detail={"file": INDEX_NAME},
                       fix=f"re-download {INDEX_NAME}")]
    if not expected:
        if others:
            return [record("checkpoint.files", WARN, f"no safetensors, only {', '.join(others[:3])}: shards "
                           "not checked", detail={"files": others})]
        return [record("checkpoint.files", FAIL, f"no weights in {model_path}", detail={},
                       fix="download the model's *.safetensors (and their index) into the model dir")]
    records = [_files_record(index, expected, on_disk)]
    shard_records, tensors_by_shard, bad = _shards_records(ctx, model_path, index, expected, on_disk)
    records += shard_records
    records.append(_layers_record(ctx, tensors_by_shard, bad or set(expected) - set(on_disk)))
    records.append(_fit_record(ctx))
    return records


def _files_record(index, expected, on_disk):
    missing = sorted(set(expected) - set(on_disk))
    extra = sorted(set(on_disk) - set(expected))
    detail = {"index": INDEX_NAME if index else None, "expected": len(expected), "missing": missing,
              "extra": extra}
    if missing:
        return record("checkpoint.files", FAIL, f"{len(missing)} of {len(expected)} shards missing: "
                      f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}", detail=detail,
                      fix="download the missing shards into the model dir (huggingface-cli download resumes)")
    if extra:
        return record("checkpoint.files", WARN, f"{len(expected)} shards present; {len(extra)} not in the index: "
                      f"{', '.join(extra[:3])}", detail=detail,
                      fix="remove stray *.safetensors the index does not name (a loader may pick them up)")
    return record("checkpoint.files", OK, f"{len(expected)} shard(s) present"
                  + (f", as named by {INDEX_NAME}" if index else ""), detail=detail)


def _shards_records(ctx, model_path, index, expected, on_disk):
    bad, tensors_by_shard, total_data, total_files = {}, {}, 0, 0
    for name in expected:
        if name not in on_disk:
            continue
        try:
            facts = read_header(os.path.join(model_path, name))
        except (OSError, ShardError) as exc:
            bad[name] = str(exc)
            continue
        tensors_by_shard[name] = set(facts["tensors"])
        total_data += facts["data_bytes"]
        total_files += facts["file_bytes"]
    # The index must point each tensor at a shard that really holds it.
    misplaced = []
    for tensor, shard in ((index or {}).get("weight_map") or {}).items():
        if shard in tensors_by_shard and tensor not in tensors_by_shard[shard]:
            misplaced.append(f"{tensor} -> {shard}")
    ctx.checkpoint.update({"shards": len(expected), "data_bytes": total_data, "file_bytes": total_files,
                           "readable": len(tensors_by_shard), "tensors": sum(map(len, tensors_by_shard.values()))})
    detail = dict(ctx.checkpoint, bad=bad, misplaced=misplaced[:20])
    records = []
    if bad:
        first = sorted(bad)[0]
        records.append(record("checkpoint.headers", FAIL, f"{len(bad)} shard(s) broken; {first}: {bad[first]}",
                              detail=detail, fix=f"re-download {', '.join(sorted(bad)[:3])}"
                              + (" ..." if len(bad) > 3 else "")))
    elif misplaced:
        records.append(record("checkpoint.headers", FAIL, f"{len(misplaced)} tensor(s) not in the shard the index "
                              f"names, e.g. {misplaced[0]}", detail=detail,
                              fix=f"re-download {INDEX_NAME} together with the shards (they are from different "
                                  f"revisions)"))
    else:
        records.append(record("checkpoint.headers", OK, f"{len(tensors_by_shard)} header(s) readable, sizes "
                              f"consistent, {ctx.checkpoint['tensors']} tensors", detail=detail))
    declared = ((index or {}).get("metadata") or {}).get("total_size")
    records.append(record("checkpoint.size", OK, f"{human_bytes(total_data)} of weights in {len(expected)} "
                          f"shard(s)", detail={"data_bytes": total_data, "file_bytes": total_files,
                                               "index_total_size": declared}))
    return records, tensors_by_shard, bad


#: ``<prefix>layers.<i>.<rest>``: a decoder layer's tensor (``model.layers.3.mlp.up_proj.weight``,
#: ``language_model.model.layers.3...``); the first ``layers.`` in the name counts.
LAYER_TENSOR = re.compile(r"^(.*?\blayers)\.(\d+)\.(.+)$")
#: prefixes of towers that are not the language model (their layers are no decoder layers)
NOT_DECODER = re.compile(r"vision|visual|vit|audio|mm_proj|projector|encoder", re.IGNORECASE)


def decoder_layers(names) -> tuple:
    """``(prefix, {layer: {module: {tensor suffix}}})`` of the decoder's layers among ``names``.

    Tensors are grouped by module (``self_attn.q_proj`` holds ``.weight`` and, quantized,
    ``.weight_scale``), so a layer left unquantized is not taken for an incomplete one.
    The prefix holding the most tensors is the decoder's; ``(None, {})`` when none matches.
    """
    by_prefix: dict = {}
    for name in names:
        m = LAYER_TENSOR.match(name)
        if not m or NOT_DECODER.search(m.group(1)):
            continue
        prefix, layer, rest = m.group(1), int(m.group(2)), m.group(3)
        module = rest.rpartition(".")[0] or rest
        by_prefix.setdefault(prefix, {}).setdefault(layer, {}).setdefault(module, set()).add(rest)
    if not by_prefix:
        return None, {}
    prefix = max(by_prefix, key=lambda k: sum(len(t) for mods in by_prefix[k].values() for t in mods.values()))
    return prefix, by_prefix[prefix]


def layer_gaps(names, num_layers: int) -> tuple:
    """``(prefix, {layer: [missing tensor names]})`` for the config's layers ``0..num_layers-1``.

    A layer with no tensor at all is expected to hold what its nearest layer holds. A
    layer whose modules are a strict subset of another layer's misses the difference
    (the closest such layer is the model): layers of different kinds (dense and MoE)
    are never subsets of each other. Layers past the count (DeepSeek's MTP layer) are
    not decoder layers and are ignored.
    """
    prefix, found = decoder_layers(names)
    if prefix is None:
        return None, {}
    present = sorted(i for i in found if i < num_layers)
    gaps = {}
    for i in range(num_layers):
        if i not in found:
            if not present:
                gaps[i] = [f"{prefix}.{i}.*"]
                continue
            peer = min(present, key=lambda j: (abs(j - i), j))
            gaps[i] = sorted(f"{prefix}.{i}.{t}" for tensors in found[peer].values() for t in tensors)
            continue
        mods = set(found[i])
        bigger = [j for j in present if j != i and mods < set(found[j])]
        if bigger:
            peer = min(bigger, key=lambda j: (len(found[j]), abs(j - i)))
            gaps[i] = sorted(f"{prefix}.{i}.{t}" for mod in set(found[peer]) - mods for t in found[peer][mod])
    return prefix, gaps


def _layers_record(ctx, tensors_by_shard, unreadable):
    """Every decoder layer the config counts holds its tensors (else vLLM fails after the load)."""
    n = ctx.model.get("num_layers")
    if type(n) is not int or n < 1:
        return record("checkpoint.layers", SKIPPED, "no layer count (model config unreadable)", detail={})
    if unreadable:
        return record("checkpoint.layers", SKIPPED, "not every shard is readable (see checkpoint.files/headers): "
                      "layers not checked", detail={"unreadable": sorted(unreadable)[:10]})
    names = set().union(*tensors_by_shard.values()) if tensors_by_shard else set()
    prefix, gaps = layer_gaps(names, n)
    if prefix is None:
        return record("checkpoint.layers", SKIPPED, "no tensor named <prefix>.layers.<i>.*: the decoder layers' "
                      "weights are not checked", detail={"num_layers": n})
    detail = {"prefix": prefix, "num_layers": n, "incomplete": {str(i): t[:20] for i, t in gaps.items()},
              "missing_count": {str(i): len(t) for i, t in gaps.items()}}
    if gaps:
        first = min(gaps)
        shown = ", ".join(gaps[first][:4]) + (f" (+{len(gaps[first]) - 4} more)" if len(gaps[first]) > 4 else "")
        layers_txt = ", ".join(map(str, sorted(gaps)[:10])) + (" ..." if len(gaps) > 10 else "")
        return record("checkpoint.layers", FAIL, f"{len(gaps)} of {n} decoder layers lack weights in every shard "
                      f"(layers {layers_txt}); layer {first} misses {shown}", detail=detail,
                      fix="re-download the checkpoint's shards together with their index (huggingface-cli download "
                          "resumes); vLLM fails after the load with 'weights were not initialized from checkpoint'")
    return record("checkpoint.layers", OK, f"all {n} decoder layers ({prefix}.<i>) hold their weights",
                  detail=detail)


def _fit_record(ctx):
    """Weights per TP rank against what each rank may use: GPU memory x utilization, or RAM."""
    total = ctx.checkpoint.get("data_bytes") or 0
    tp = ctx.params["tp"]
    per_rank = total // max(tp, 1)
    detail = {"weight_bytes": total, "tp": tp, "bytes_per_rank": per_rank,
              "note": "weights split evenly over TP ranks (replicated norms/embeddings make it slightly more)"}
    if ctx.params["device"] == "cuda":
        from remote.probes.parallel import gpus_in_use

        gpus = gpus_in_use(ctx)  # every replica's GPUs
        if not gpus:
            return record("checkpoint.fit", SKIPPED, "no GPU facts to compare with", detail=detail)
        util = ctx.params["gpu_memory_utilization"]
        rows, short, tight = [], [], []
        for g in gpus:
            total_b, free_b = (g["memory_total_mib"] or 0) * MiB, (g["memory_free_mib"] or 0) * MiB
            budget = int(util * total_b)
            rows.append({"index": g["index"], "total_bytes": total_b, "free_bytes": free_b, "budget_bytes": budget})
            if free_b < budget or per_rank > budget:
                short.append(g)
            elif per_rank > TIGHT_SHARE * budget:
                tight.append(g)
        detail.update(gpus=rows, gpu_memory_utilization=util)
        if short:
            g = rows[gpus.index(short[0])]
            if g["free_bytes"] < g["budget_bytes"]:
                why = (f"GPU {g['index']} has {human_bytes(g['free_bytes'])} free but gpu_memory_utilization "
                       f"{util} asks {human_bytes(g['budget_bytes'])}: vLLM refuses to start")
                fix = (f"free GPU {g['index']} or lower gpu_memory_utilization to at most "
                       f"{g['free_bytes'] / max(g['total_bytes'], 1):.2f}")
            else:
                why = (f"{human_bytes(per_rank)} of weights per rank exceed GPU {g['index']}'s budget "
                       f"{human_bytes(g['budget_bytes'])} ({util} x {human_bytes(g['total_bytes'])})")
                fix = "raise TP (more GPUs per host) or gpu_memory_utilization, or use a quantized checkpoint"
            return record("checkpoint.fit", FAIL, why, detail=detail, fix=fix)
        status = WARN if tight else OK
        return record("checkpoint.fit", status, f"{human_bytes(per_rank)} per rank vs budget "
                      f"{human_bytes(min(r['budget_bytes'] for r in rows))} per GPU"
                      + (": little room left for the KV cache" if tight else ""), detail=detail,
                      fix="raise TP or gpu_memory_utilization" if tight else None)
    avail = (ctx.host.get("ram") or {}).get("available_bytes")
    kv = ctx.host.get("cpu_kvcache_bytes") or 0
    from remote.probes.parallel import layout_of

    dp = max(1, layout_of(ctx).dp)  # every data-parallel replica holds the weights and its KV cache
    need = (total + kv * tp) * dp
    detail.update(ram_available_bytes=avail, kvcache_bytes_per_rank=kv, need_bytes=need, dp=dp)
    if not avail:
        return record("checkpoint.fit", SKIPPED, "no RAM facts to compare with", detail=detail)
    if need > avail:
        return record("checkpoint.fit", FAIL, f"weights {human_bytes(total)} + KV cache {human_bytes(kv)} x TP {tp} "
                      + (f"x dp {dp} replicas " if dp > 1 else "")
                      + f"exceed available RAM {human_bytes(avail)}", detail=detail,
                      fix="lower VLLM_CPU_KVCACHE_SPACE, free RAM, or use a bigger host")
    status = WARN if need > TIGHT_SHARE * avail else OK
    return record("checkpoint.fit", status, f"weights {human_bytes(total)} + KV cache {human_bytes(kv * tp)} "
                  + (f"x dp {dp} replicas ({human_bytes(need)}) " if dp > 1 else "")
                  + f"vs RAM {human_bytes(avail)} available", detail=detail,
                  fix="free RAM or lower VLLM_CPU_KVCACHE_SPACE" if status == WARN else None)

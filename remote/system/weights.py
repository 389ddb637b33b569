"""A model's weight files on this machine: which shards, and each safetensors header, read without torch.

A safetensors file is ``<8-byte little-endian header length N><N bytes of JSON header>
<data>``, the header mapping each tensor to ``{"dtype", "shape", "data_offsets": [begin,
end]}`` relative to the start of the data. So a complete file is exactly
``8 + N + max(end)`` bytes: a shorter one is a truncated download, found by reading a few
KB per shard instead of loading hundreds of GB (the checkpoint probe, the layer verifier
and eval's draft reader all read them here).
"""
from __future__ import annotations

import json
import os

from remote.system.jsonfile import OBJECT, Malformed, describe, expect, field
from remote.wire.words import human_bytes

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: The format caps the header at 100 MB; a bigger length means a corrupt or foreign file.
MAX_HEADER_BYTES = 100 * 1000 * 1000
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class ShardError(Exception):
    """A shard that cannot be used, with the reason in one line."""


def read_header(path: str) -> dict:
    """Parse one shard's header by hand (stdlib only) and check its size against it.

    :returns: ``{"header_bytes", "data_bytes", "file_bytes", "expected_bytes", "tensors":
        {name: {"dtype", "shape", "data_offsets"}}, "metadata"}``.
    :raises ShardError: unreadable, corrupt header, or file shorter than the header says.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ShardError(f"{size} bytes: too short to hold a header (truncated)")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or n > size - 8:
            raise ShardError(f"header length {n} does not fit in a {size}-byte file (truncated or not safetensors)")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ShardError(f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ShardError("header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise ShardError(f"header key '__metadata__' is {describe(metadata)}, expected an object")
    for key, value in (metadata or {}).items():  # the format allows strings only (safetensors refuses others)
        if not isinstance(value, str):
            raise ShardError(f"header key '__metadata__'.{key} is {describe(value)}, expected a string")
    data_end = 0
    for name, info in header.items():
        dtype, shape, (begin, end) = header_entry(name, info)
        numel = 1
        for dim in shape:
            numel *= dim
        if dtype in DTYPE_BYTES and end - begin != numel * DTYPE_BYTES[dtype]:
            raise ShardError(f"tensor {name!r}: {end - begin} bytes for {dtype}{shape} (corrupt header)")
        data_end = max(data_end, end)
    expected = 8 + n + data_end
    facts = {"header_bytes": n, "data_bytes": data_end, "file_bytes": size, "expected_bytes": expected,
             "tensors": header, "metadata": metadata}
    if size < expected:
        raise ShardError(f"truncated: {size} of {expected} bytes ({human_bytes(expected - size)} missing)")
    return facts


def _is_count(value) -> bool:
    return type(value) is int and value >= 0


def header_entry(name: str, info) -> tuple:
    """``(dtype, shape, (begin, end))`` of one header entry, or :class:`ShardError` naming the bad key."""
    what = f"header key {name!r}"
    if not isinstance(info, dict):
        raise ShardError(f"{what} is {describe(info)}, expected an object with dtype, shape and data_offsets")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise ShardError(f"{what}: dtype is {_found(info, 'dtype')}, expected a string such as 'BF16'")
    if not (isinstance(shape, list) and all(map(_is_count, shape))):
        raise ShardError(f"{what}: shape is {_found(info, 'shape')}, expected a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
            and offsets[0] <= offsets[1]):
        raise ShardError(f"{what}: data_offsets is {_found(info, 'data_offsets')}, expected [begin, end], "
                         f"two non-negative integers with begin <= end")
    return dtype, shape, tuple(offsets)


def _found(info: dict, key: str) -> str:
    return describe(info[key]) if key in info else "missing"


def read_index(path: str) -> dict:
    """The parsed index, its shape checked: an object whose ``weight_map`` maps names to shard files.

    :raises ValueError: not JSON. :raises Malformed: JSON of the wrong shape.
    """
    with open(path, encoding="utf-8") as fh:
        index = json.load(fh)
    fix = f"re-download {INDEX_NAME} (it must map every tensor name to its shard file)"
    expect(index, OBJECT, INDEX_NAME, "", fix=fix)
    weight_map = field(index, "weight_map", OBJECT, INDEX_NAME, required=True, fix=fix)
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise Malformed(INDEX_NAME, f"weight_map[{tensor!r}]", "a shard file name (a string)", shard, fix=fix)
    field(index, "metadata", OBJECT, INDEX_NAME, fix=fix)
    return index


def find_weights(model_path: str) -> tuple:
    """``(index or None, expected shard names, safetensors files on disk, other weight files)``."""
    try:
        names = sorted(os.listdir(model_path))
    except OSError:
        return None, [], [], []
    on_disk = [n for n in names if n.endswith(".safetensors")]
    others = [n for n in names if n.endswith((".bin", ".pt", ".pth", ".gguf"))]
    index = None
    if INDEX_NAME in names:
        index = read_index(os.path.join(model_path, INDEX_NAME))
        expected = sorted(set(index["weight_map"].values()))
    elif SINGLE_NAME in names:
        expected = [SINGLE_NAME]
    else:
        expected = list(on_disk)
    return index, expected, on_disk, others

"""A GGUF file's bytes planned before any tensor is written: the header (key-values, tensor infos, padding), every
tensor's offset and the file's size (``gguf.md`` §1), byte-equal to gguf-py's writer given the same keys in the
same order.

Every offset follows from names, shapes, types and the key-value bytes alone, so a resumable writer lays the
file out in the plan, writes each tensor at its offset, in any order, and checks the whole at the end.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from resumerge.inputs.gguf.header import MAGIC
from resumerge.inputs.safetensors_format import DTYPE_SIZES, PlannedTensor, ShardLayout, numel

ALIGNMENT = 32
VERSION = 3
# value types (gguf.md §1)
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12
_PACK = MappingProxyType({
    U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q", I64: "<q",
    F64: "<d",
})


@dataclass(frozen=True)
class Value:
    """One metadata value with its GGUF type (an array's element type in ``sub``)."""

    type: int
    value: Any
    sub: int | None = None


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a planned GGUF: its name, numpy shape of values, ggml type and stored byte count."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    nbytes: int


@dataclass(frozen=True)
class GgufLayout:
    """A planned GGUF: header bytes (padded to the data start), each tensor's offset from the data start, and the
    file's size (every tensor padded to the alignment, the last one too, as gguf-py writes it)."""

    header: bytes
    offsets: tuple[int, ...]
    file_size: int


def pad(n: int, alignment: int = ALIGNMENT) -> int:
    """``n`` rounded up to a multiple of ``alignment``."""
    return -(-n // alignment) * alignment


def _string(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _scalar(kind: int, value: Any) -> bytes:
    if kind == STRING:
        return _string(value)
    return struct.pack(_PACK[kind], value)


def pack_value(value: Value) -> bytes:
    """The bytes of ``value`` after its key: its type, then the value (an array: element type, count, elements)."""
    if value.type != ARRAY:
        return struct.pack("<I", value.type) + _scalar(value.type, value.value)
    sub = value.sub if value.sub is not None else STRING
    items: Sequence[Any] = value.value
    if not len(items):
        raise ValueError("a GGUF array cannot be empty")
    if sub != STRING:
        body = np.asarray(items, dtype=np.dtype(_PACK[sub])).tobytes()
    else:
        body = b"".join(_string(item) for item in items)
    return struct.pack("<IIQ", ARRAY, sub, len(items)) + body


def plan_layout(metadata: Sequence[tuple[str, Value]], tensors: Sequence[TensorInfo]) -> GgufLayout:
    """The layout of a GGUF holding ``metadata`` (in order) and ``tensors`` (in data order)."""
    parts = [MAGIC, struct.pack("<IQQ", VERSION, len(tensors), len(metadata))]
    parts += [_string(key) + pack_value(value) for key, value in metadata]
    offsets, at = [], 0
    for t in tensors:
        dims = tuple(reversed(t.shape))
        parts.append(_string(t.name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, t.ggml_type, at))
        offsets.append(at)
        at += pad(t.nbytes)
    header = b"".join(parts)
    header += bytes(pad(len(header)) - len(header))
    return GgufLayout(header, tuple(offsets), len(header) + at)


def with_u32(header: bytes, key: str, value: int) -> bytes:
    """``header`` (a :func:`plan_layout` header) with the U32 value of its key ``key`` set to ``value`` (the same
    length: nothing after it moves); ``header`` as it is where it has no such key."""
    named = _string(key) + struct.pack("<I", U32)
    at = header.find(named)
    if at < 0:
        return header
    at += len(named)
    return header[:at] + struct.pack("<I", value) + header[at + 4:]


def shard_layout(header: bytes, parts: Sequence[tuple[str, str, tuple[int, ...]]], file_size: int) -> ShardLayout:
    """The shard writer's layout of a planned GGUF: its ``header``, then each stored part (name, stored dtype,
    shape) in data order, each padded to the alignment (the gaps and the tail are zeros), ``file_size`` in all; the
    experts' slices of one stacked tensor (``STACK#e``: :mod:`.stackcodec`) end to end, padded after the last."""
    order, offset = [], 0
    for i, (name, dtype, shape) in enumerate(parts):
        nbytes = numel(shape) * DTYPE_SIZES[dtype]
        order.append(PlannedTensor(name, dtype, shape, offset, nbytes))
        stack = stack_of(name)
        offset += nbytes
        if stack is None or i + 1 == len(parts) or stack_of(parts[i + 1][0]) != stack:
            offset = pad(offset)  # every tensor (a stack: its first slice) starts aligned
    return ShardLayout(header=header, order=tuple(order), size=file_size)


def slice_name(stack: str, expert: int) -> str:
    """The stored name of expert ``expert``'s slice of stacked GGUF tensor ``stack`` (``STACK#e``)."""
    return f"{stack}#{expert}"


def stack_of(stored: str) -> str | None:
    """The stacked GGUF tensor whose expert slice stored part ``stored`` is (:func:`slice_name`); None for a whole
    tensor."""
    stack, found, _ = stored.partition("#")
    return stack if found else None


"""Decoding bytes through a table: each stored byte (or pair of bytes) becomes one or more float32 values.

torch's own FP8 → float32 cast runs one element at a time on CPU; every format of this package stores codes of at
most 8 bits, so a byte's values are looked up instead. A table row is gathered as one wide scalar (4, 8 or 16
bytes: int32, int64, complex128 — a bit-exact copy, about 3× faster than gathering a 2-D table's rows), two bytes
at a time where that row is at most 16 bytes (a 65,536-row table, 0.5–1 MiB, indexed by the pair read as one
uint16: widened to the gather's int32 index in one copy, no offset to add), in slabs that keep the index buffer in
cache. Tables depend on the host's byte order only through how they are built, never through how they are indexed.

Tables are built on the CPU and copied once to any other device (:meth:`ByteTable.to`, :func:`per_device`), so
bytes on a GPU decode there (a GPU gathers a whole tensor in one launch: the slabs are for the CPU's caches).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Concatenate, ParamSpec, TypeVar, cast

from resumerge.machine.torch_import import torch

__all__ = ["ByteTable", "byte_table", "decode_bytes", "per_device"]

# Indices per gather: enough to amortise a kernel launch, few enough that the int32 index slab stays in L1/L2.
SLAB = 1 << 15
# Row width in bytes -> the scalar dtype that copies it in one piece.
_WIDE = MappingProxyType({4: "int32", 8: "int64", 16: "complex128"})

_P = ParamSpec("_P")
_T = TypeVar("_T", "ByteTable", "torch.Tensor")  # a string: naming torch.Tensor here would import torch


@dataclass(frozen=True)
class ByteTable:
    """Byte ``b``'s ``per_byte`` float32 values (``single``, rows viewed as one wide scalar each), and the
    same for every two-byte pair (``pair``, row ``v`` for the uint16 ``v`` the pair reads as), or None when a
    pair's row would be wider than 16 bytes."""

    per_byte: int
    single: torch.Tensor
    pair: torch.Tensor | None

    def to(self, device: torch.device) -> ByteTable:
        """This table on ``device`` (itself when it is there already)."""
        if self.single.device == device:
            return self
        return ByteTable(self.per_byte, self.single.to(device), None if self.pair is None else self.pair.to(device))


def per_device(build: Callable[_P, _T]) -> Callable[Concatenate[torch.device, _P], _T]:
    """``build`` (a table's maker, run on the CPU) as a function of ``(device, *args)`` that gives its result on
    ``device``: built once per process on the CPU (so every device's copy holds the CPU's exact bits, whatever the
    device's own kernels would round) and copied once to each other device, both kept by ``functools.cache``.
    ``build``'s arguments must be hashable."""
    cached: Callable[Concatenate[torch.device, _P], _T]

    def on(device: torch.device, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        if device.type == "cpu":
            return build(*args, **kwargs)
        return cached(torch.device("cpu"), *args, **kwargs).to(device)

    # functools.cache's stub types the call as (*Hashable) -> _T: the cast gives callers back build's arguments.
    cached = cast("Callable[Concatenate[torch.device, _P], _T]", functools.cache(on))
    return cached


def _wide(rows: torch.Tensor) -> torch.Tensor:
    name = _WIDE.get(rows.shape[1] * 4)
    return rows.contiguous() if name is None else rows.contiguous().view(getattr(torch, name)).view(-1)


def byte_table(values: torch.Tensor) -> ByteTable:
    """The table of a ``[256, k]`` float32 CPU tensor (row ``b``: the ``k`` values byte ``b`` holds, in element
    order). Formats build theirs once per process and device (:func:`per_device`)."""
    if values.shape[0] != 256 or values.ndim != 2 or values.dtype != torch.float32:
        raise ValueError(f"a byte table is [256, k] float32, got {tuple(values.shape)} {values.dtype}")
    per_byte = values.shape[1]
    pair = None
    if per_byte * 8 <= 16:
        words = torch.arange(65536, dtype=torch.int32).to(torch.int16)  # every uint16's bits, in order
        first, second = words.view(torch.uint8).view(-1, 2).long().unbind(1)
        pair = _wide(torch.cat([values[first], values[second]], dim=1))
    return ByteTable(per_byte, _wide(values), pair)


def decode_bytes(data: torch.Tensor, table: ByteTable, out: torch.Tensor) -> torch.Tensor:
    """Write into ``out`` (float32, contiguous, ``data.numel() · per_byte`` elements) the values of every byte of
    ``data`` (uint8, contiguous), in order, on ``data``'s device (``out``'s too). Returns ``out``."""
    table = table.to(data.device)  # a format's cached copy there is passed in: then this is the table itself
    flat = data.reshape(-1)
    if table.pair is not None and flat.numel() % 2 == 0:
        source, lookup = flat.view(torch.uint16), table.pair
    else:
        source, lookup = flat, table.single
    target = out.view(-1).view(lookup.dtype) if lookup.ndim == 1 else out.view(-1, lookup.shape[1])
    count = source.numel()
    step = SLAB if data.device.type == "cpu" else max(count, 1)
    index = torch.empty(min(step, count), dtype=torch.int32, device=data.device)
    for a in range(0, count, step):
        b = min(count, a + step)
        slab = index[: b - a]
        slab.copy_(source[a:b])
        torch.index_select(lookup, 0, slab, out=target[a:b])
    return out

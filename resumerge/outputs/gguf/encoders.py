"""GGUF's F16, BF16, Q8_0 and legacy Q4_0, Q4_1, Q5_0, Q5_1 tensors encoded with torch for a GGUF output
(:class:`~resumerge.outputs.gguf.outcodec.GgufOutCodec`): vectorised over torch's compute threads, and byte-equal
to gguf-py's ``quants`` (llama.cpp's reference rounding), which is single-threaded numpy and was the run's bound
(bench/RESULTS.md, GGUF); and every type's encoder registered by its id (``_TORCH``: these; :data:`SEARCHED`:
the searched types of :mod:`.kquants`, :mod:`.iquants` and :mod:`.iq3quants`) against its row of the ggml types'
table (:mod:`resumerge.inputs.gguf.ggmltypes`: the block layouts both sides read). Their decoders are the input side's
(:mod:`resumerge.inputs.gguf.blocks`, :mod:`resumerge.inputs.gguf.legacy`).

Q8_0 (``ggml-common.h`` ``block_q8_0``): each 32 values of a row are a block of 34 bytes, the scale
``d = max|x| / 127`` as float16 then 32 int8 ``q = round(x * (1/d))`` (a multiplication by the float32 reciprocal,
not a division; 0 where ``d`` is 0), rounded half away from zero. Every step is one IEEE float32 operation in the
same order as gguf-py's, so the bytes agree; ``tests/test_gguf_blocks.py`` checks them against gguf-py on ties, zeros,
huge and tiny values. BF16 is torch's round-to-nearest-even, with a NaN kept quiet and its high bits as gguf-py keeps
it. Values are float32 rows whose last dimension is whole blocks; the result is one row of bytes per value row.

The legacy types (their layouts: :mod:`resumerge.inputs.gguf.legacy`):

- Q4_0 / Q5_0 (symmetric, 16 / 32 levels): ``d = x_m / -8`` (``-16``) where ``x_m`` is the block's first value of
  the largest magnitude, ``q = trunc(x * (1/d) + 8.5)`` (``16.5``) clipped to 15 (31).
- Q4_1 / Q5_1 (affine): ``d = (max - min) / 15`` (``31``), ``m = min``, ``q = trunc((x - min) * (1/d) + 0.5)``
  clipped.

``1/d`` is 0 where ``d`` is 0. Every step is one IEEE float32 operation in gguf-py's order, and a code outside
0..255 (only from a scale that under- or overflows) is cast as numpy casts float32 to uint8 on x86 (through int32:
0 for NaN, infinities and 2**31 or more; else the low byte), so the bytes agree on every finite input. One
difference, by choice: where a block's max or min is a zero present with both signs, gguf-py's numpy returns the
zero its SIMD lanes meet last (it differs between machines); this module takes the first, as llama.cpp's loop does,
so only the sign bit of a zero ``d`` or ``m`` can differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np

from resumerge.inputs.gguf import legacy
from resumerge.inputs.gguf.blocks import CHUNK
from resumerge.inputs.gguf.ggmltypes import BF16, F16, F32, Q8_0, TYPES
from resumerge.inputs.gguf.legacy import Kind
from resumerge.outputs.gguf import iq3quants, iquants, kquants, legacyweighted, mxfp4quants, tquants

if TYPE_CHECKING:
    from collections.abc import Callable

    from resumerge.machine.torch_import import torch

__all__ = ["SEARCHED", "UNWEIGHTED", "WEIGHTED", "encode", "encodes", "kernel_family", "warm_kernels"]

_Q8_VALUES, _Q8_BYTES = TYPES[Q8_0].block
# the block types encoded in numpy (and its compiled kernels, :mod:`.jit`) to llama.cpp's bytes with and without an
# importance matrix: ggml type -> its encoder (rows, ggml type, importance or None, out)
SEARCHED: Mapping[int, Callable[[np.ndarray, int, np.ndarray | None, np.ndarray], np.ndarray]] = MappingProxyType({
    **dict.fromkeys(kquants.K_TYPES, kquants.encode_k), **dict.fromkeys(iquants.I_TYPES, iquants.encode_iq),
    **dict.fromkeys(iq3quants.I3_TYPES, iq3quants.encode_iq3)})
# the types whose encoding reads an importance matrix (llama-quantize's, one entry a tensor): those, and the legacy
# 4- and 5-bit types' weighted paths
WEIGHTED = frozenset(SEARCHED) | frozenset(legacyweighted.LEGACY)
# the block types encoded in numpy that read no importance matrix (the ternary ones, MXFP4): as SEARCHED's
UNWEIGHTED = MappingProxyType({**dict.fromkeys(tquants.TQ_TYPES, tquants.encode_tq),
                               **dict.fromkeys(mxfp4quants.MXFP4_TYPES, mxfp4quants.encode_mxfp4)})


def _q8_0_chunk(blocks: torch.Tensor, out: torch.Tensor, scratch: tuple[torch.Tensor, ...]) -> None:
    """Q8_0 bytes of ``blocks`` (float32, (n, 32)) into ``out`` (uint8, (n, 34)), the temporaries in ``scratch``
    (three float32 buffers of at least n blocks), every step in place or into them: no temporary of a chunk's size
    (a bool mask added to a float one is cast into one)."""
    from resumerge.machine.torch_import import torch

    n = blocks.shape[0]
    a, y, whole = (buffer[:n] for buffer in scratch)
    torch.abs(blocks, out=a)
    d = a.amax(dim=1, keepdim=True)
    d /= torch.full_like(d, 127.0)  # a true division (a scalar divisor may become a reciprocal multiply)
    inverse = torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / d)
    torch.mul(blocks, inverse, out=y)
    # round half away from zero, exactly (floor(|y| + 0.5) is not: the addition rounds 0.49999997 up)
    torch.abs(y, out=a)
    torch.floor(a, out=whole)
    a -= whole  # the fraction, exact in float32; doubled (exact) and floored it is 1 from a half up, else 0
    a *= 2
    whole += a.floor_()
    torch.copysign(whole, y, out=whole)
    out[:, :2] = d.to(torch.float16).view(torch.uint8)
    out[:, 2:].view(torch.int8).copy_(whole)


def _q8_0(rows: torch.Tensor, ggml_type: int, into: torch.Tensor | None = None) -> torch.Tensor:
    from resumerge.machine.torch_import import torch

    blocks = rows.reshape(-1, _Q8_VALUES)
    out = torch.empty((blocks.shape[0], _Q8_BYTES), dtype=torch.uint8) if into is None else \
        into.view(torch.uint8).view(-1, _Q8_BYTES)
    size = (min(CHUNK, blocks.shape[0]), _Q8_VALUES)
    scratch = tuple(torch.empty(size) for _ in range(3))
    for start in range(0, blocks.shape[0], CHUNK):
        _q8_0_chunk(blocks[start:start + CHUNK], out[start:start + CHUNK], scratch)
    return out.reshape(*rows.shape[:-1], rows.shape[-1] // _Q8_VALUES * _Q8_BYTES)


def _legacy(rows: torch.Tensor, ggml_type: int, into: torch.Tensor | None = None) -> torch.Tensor:
    from resumerge.machine.torch_import import torch

    kind, block_bytes = legacy.KINDS[ggml_type], TYPES[ggml_type].size
    blocks = rows.reshape(-1, _Q8_VALUES)
    out = torch.empty((blocks.shape[0], block_bytes), dtype=torch.uint8) if into is None else \
        into.view(torch.uint8).view(-1, block_bytes)
    size = (min(CHUNK, blocks.shape[0]), _Q8_VALUES)
    scratch = (torch.empty(size), torch.empty(size))
    for start in range(0, blocks.shape[0], CHUNK):
        _legacy_blocks(blocks[start:start + CHUNK], out[start:start + CHUNK], kind, scratch)
    return out.reshape(*rows.shape[:-1], rows.shape[-1] // _Q8_VALUES * block_bytes)


def _bf16(rows: torch.Tensor) -> torch.Tensor:
    from resumerge.machine.torch_import import torch

    bits = rows.to(torch.bfloat16).view(torch.int16)
    nan = rows.isnan()
    if bool(nan.any()):  # gguf-py keeps a NaN's sign and high mantissa bits and sets the quiet bit
        high = torch.bitwise_right_shift(rows.view(torch.int32), 16) | 0x40
        bits = torch.where(nan, high.to(torch.int16), bits)
    return bits


def _plain(rows: torch.Tensor, ggml_type: int, into: torch.Tensor | None = None) -> torch.Tensor:
    """F32, F16 or BF16 (bfloat16 bits as int16) values of ``rows``, copied into ``into`` when given."""
    from resumerge.machine.torch_import import torch

    if ggml_type == F32:
        stored = rows
    elif ggml_type == F16:
        stored = rows.to(torch.float16)
    else:
        stored = _bf16(rows)
    if into is not None:
        into.view(stored.dtype).copy_(stored.reshape(into.shape))
        return into
    return stored


# the types encoded with torch: ggml type -> its encoder (rows, ggml type, into or None)
_TORCH: Mapping[int, Callable[[torch.Tensor, int, torch.Tensor | None], torch.Tensor]] = MappingProxyType({
    F32: _plain, F16: _plain, BF16: _plain, Q8_0: _q8_0, **dict.fromkeys(legacy.KINDS, _legacy)})


def encodes(ggml_type: int) -> bool:
    """Whether :func:`encode` encodes ``ggml_type`` (its row: :mod:`resumerge.inputs.gguf.ggmltypes`)."""
    return ggml_type in _TORCH or ggml_type in SEARCHED or ggml_type in UNWEIGHTED


def encode(values: torch.Tensor, ggml_type: int, into: torch.Tensor | None = None,
           importance: np.ndarray | None = None) -> torch.Tensor:
    """``values`` (float32 on the CPU) stored as ``ggml_type``: float32 (F32), float16 (F16), bfloat16 bits as int16
    (BF16), or uint8 block bytes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants of :mod:`.kquants`, the i-quants
    of :mod:`.iquants`, TQ1_0 and TQ2_0 of :mod:`.tquants`, MXFP4 of :mod:`.mxfp4quants`: ``values.shape[-1]``
    whole blocks); a block type written straight into ``into`` when given
    (contiguous, of the result's bytes), the others copied there. ``importance`` (float32, one per column): a
    :data:`WEIGHTED` type's importance weights (llama.cpp's imatrix entry over its count), None for the
    quantizer's path without them."""
    from resumerge.machine.torch_import import torch

    rows = values.to(torch.float32).contiguous()
    searched = SEARCHED.get(ggml_type) or UNWEIGHTED.get(ggml_type)
    weighted = importance is not None and ggml_type in legacyweighted.LEGACY  # the legacy types' importance paths
    if searched is not None or weighted:
        block, size = TYPES[ggml_type].block
        shape = (*rows.shape[:-1], rows.shape[-1] // block * size)
        out = torch.empty(shape, dtype=torch.uint8) if into is None else into.view(torch.uint8).view(shape)
        if searched is not None:
            searched(rows.numpy(), ggml_type, importance, out.numpy())
        elif importance is not None:
            legacyweighted.encode_legacy_weighted(rows.numpy(), ggml_type, importance, out.numpy())
        return out
    coder = _TORCH.get(ggml_type)
    if coder is None:
        raise ValueError(f"ggml type {ggml_type} is not one this module encodes")
    return coder(rows, ggml_type, into)


def _codes(blocks: torch.Tensor, kind: Kind, y: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The codes (uint8, (n, 32)) of ``blocks`` (float32, (n, 32)), with ``d`` and ``m`` ((n, 1) float32; ``m`` is
    ``d`` for a symmetric kind); ``y`` and ``a`` are float32 scratch of the blocks' shape."""
    from resumerge.machine.torch_import import torch

    # amin and amax are fast; which of equal extremes (only zeros of both signs differ) or of equal magnitudes of
    # both signs is taken matters, so blocks with such a tie (or a NaN) take the first, as llama.cpp does: argmin
    # and argmax give the first index (10x slower, so only when some block needs it)
    low, high = blocks.amin(1, keepdim=True), blocks.amax(1, keepdim=True)
    if kind.affine:
        tied = (low == 0) | (high == 0) | low.isnan()
        if bool(tied.any()):
            low = torch.where(tied, blocks.gather(1, blocks.argmin(1, keepdim=True)), low)
            high = torch.where(tied, blocks.gather(1, blocks.argmax(1, keepdim=True)), high)
        d = (high - low) / torch.full_like(low, kind.levels)  # a true division, not a reciprocal multiply
        torch.sub(blocks, low, out=y)
        offset, m = 0.5, low
    else:
        half = (kind.levels + 1) // 2
        peak = torch.where(high > -low, high, low)  # the extreme of the larger magnitude
        tied = ~((high > -low) | (-low > high))  # equal magnitudes of both signs (zeros too), or a NaN
        if bool(tied.any()):
            torch.abs(blocks, out=a)
            peak = torch.where(tied, blocks.gather(1, a.argmax(1, keepdim=True)), peak)
        d = peak / torch.full_like(peak, -half)
        y.copy_(blocks)
        offset, m = half + 0.5, d
    y *= torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / d)
    y += offset
    y.trunc_()
    if bool((y.amin() >= 0) & (y.amax() < 256)):  # every code a byte already (no NaN): clipped as numpy clips
        return y.clamp_(max=kind.levels).to(torch.uint8), d, m
    # numpy's float32 -> uint8 cast on x86: through int32 (0 for NaN, ±inf, |v| >= 2**31), then the low byte
    torch.abs(y, out=a)
    codes = torch.where(a < 2.0**31, y, torch.zeros_like(y)).to(torch.int32)
    codes &= 0xFF
    return codes.clamp_(max=kind.levels).to(torch.uint8), d, m


def _legacy_blocks(blocks: torch.Tensor, out: torch.Tensor, kind: Kind, scratch: tuple[torch.Tensor, ...]) -> None:
    """The bytes of ``blocks`` (float32, (n, 32)) as ``kind`` into ``out`` (uint8, (n, its block bytes)), the
    temporaries in ``scratch`` (two float32 buffers of at least n blocks)."""
    from resumerge.machine.torch_import import torch

    n = blocks.shape[0]
    y, a = (buffer[:n] for buffer in scratch)
    codes, d, m = _codes(blocks, kind, y, a)
    out[:, -16:].copy_((codes[:, :16] & 0x0F) | ((codes[:, 16:] & 0x0F) << 4))
    if kind.levels == 31:
        weights = torch.tensor([1 << bit for bit in range(8)], dtype=torch.uint8)
        bits = (codes >> 4).view(n, 4, 8) * weights
        out[:, kind.high_at:kind.high_at + 4] = bits.sum(dim=2, dtype=torch.uint8)
    out[:, :2] = d.to(torch.float16).view(torch.uint8)
    if kind.affine:
        out[:, 2:4] = m.to(torch.float16).view(torch.uint8)


def kernel_family(ggml_type: int) -> str:
    """The module whose encoder ``ggml_type`` (of :data:`SEARCHED` or :data:`UNWEIGHTED`) is: the types of one
    family share their compiled kernels (the K-quants' searches, the 2-bit i-quants'), so a compilation split over
    processes keeps a family in one (:func:`resumerge.merge.engine.footprint.compile_ahead`)."""
    coder = iquants.block_encoder(ggml_type) if ggml_type in iquants.I_TYPES else \
        SEARCHED.get(ggml_type) or UNWEIGHTED[ggml_type]
    return str(getattr(coder, "func", coder).__module__)


def warm_kernels(spec: str) -> None:
    """Encode one 256-value row at each type of ``spec`` (``"12,14w"``: type ids, ``w`` where weighted by an
    importance matrix; :func:`resumerge.merge.engine.footprint.kernel_spec`): numba's runtime started and each
    kernel loaded (from its disk cache, or compiled), as a run's first tensors of those types do. What a process
    holds after it is what a run encoding them holds beside its units (about 80 MB over numba's import for the
    K-quants, nearly all its runtime's: :func:`resumerge.merge.engine.footprint.run_baseline` measures it)."""
    from resumerge.machine.torch_import import torch

    row = torch.from_numpy(np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32))
    for each in filter(None, spec.split(",")):
        weighted = each.endswith("w")
        encode(row, int(each.rstrip("w")), importance=np.ones(256, np.float32) if weighted else None)

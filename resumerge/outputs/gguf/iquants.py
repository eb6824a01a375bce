"""GGUF's 4-bit non-linear i-quants (IQ4_NL, IQ4_XS) encoded to the bytes llama.cpp's quantizer writes
(``ggml_quantize_chunk``), with or without an importance matrix (``shared/reference/iquants.md`` §1).

Both code each value as one of 16 fixed, unevenly spaced levels (:data:`~resumerge.inputs.gguf.blocks.IQ4_VALUES`,
-127 ... 113) times its 32-value block's scale. IQ4_NL stores that scale as a float16 (18 bytes a block); IQ4_XS
groups eight blocks into a super-block of 256 with one float16 ``d`` and a 6-bit signed multiple of ``d / 32`` per
block (136 bytes). llama.cpp finds each block's scale by least squares over 16 candidates (``ntry`` 7, on both
paths: ``ggml_quantize_chunk`` never takes the reference path that tries one): the level grid set by the value of
the largest magnitude, then inverse scales ``(k - 127) / max`` for k = -7 ... 7, each candidate's codes the nearest
levels (``best_index_int8``: a tie goes to the upper level), its fit ``Σwqx² / Σwq²`` adopted on a strict
improvement. The weights are ``x²`` without a matrix, else ``qw · sqrt(σ² + x²)`` with σ² the super-block's mean
square times 2. A block whose largest magnitude is under 1e-15 gets scale 0. Then the codes are recomputed from
the float32 scale (IQ4_NL) or from ``d`` times the block's 6-bit multiple (IQ4_XS; ``d`` the float32 before its
rounding to float16, as llama.cpp keeps it).

Every operation is float32 and in llama.cpp's order: the numpy path vectorises across blocks, values laid out
element-major ``(32, S)`` so that each sum is :func:`.ksearch.fsum`'s sequential one. Where numba is installed the
search and the final codes run compiled (:mod:`.iqloop`), a scalar loop per block as C's, to the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from types import MappingProxyType

import numpy as np

from resumerge.inputs.gguf.blocks import IQ4_VALUES
from resumerge.inputs.gguf.ggmltypes import IQ4_NL, IQ4_XS, TYPES
from resumerge.outputs.gguf import iq1quants, iq2quants, iqloop
from resumerge.outputs.gguf import ksearch as ks
from resumerge.outputs.gguf.kfloat import EPS, F

__all__ = ["I_TYPES", "best_index", "encode_iq", "search", "search_numpy"]

_Array = np.ndarray

_BLOCK = 32  # values a scale
_NTRY = 7
_LEVELS = np.array(IQ4_VALUES, dtype=F)
# floor(v) + 127 -> the index of the first level above v, held within 1 ... 15 (v within -127 ... 113)
_ABOVE = np.clip(np.searchsorted(_LEVELS, np.arange(-127, 114, dtype=F), side="right"), 1, 15).astype(np.intp)
# values coded together: a chunk's working arrays stay in the cache
_CHUNK = 1 << 16


def best_index(v: _Array) -> _Array:
    """``best_index_int8`` of each float32 of ``v``: the index of the nearest level, ties and NaN to the upper
    one (0 at or below the lowest level, 15 at or above the highest), as intp."""
    clipped = np.clip(v, F(-127), F(113))
    nan = np.isnan(clipped)
    if nan.any():
        clipped[nan] = 113
    above = _ABOVE[np.floor(clipped).astype(np.intp) + 127]
    below = above - 1
    # the C scalar's comparison, each difference one float32 rounding
    nearer_below = (v - _LEVELS[below]) < (_LEVELS[above] - v)
    found: _Array = np.where(nearer_below, below, above)
    found[v <= F(-127)] = 0
    found[v >= F(113)] = 15
    return found


def _weights(x: _Array, qw: _Array | None) -> _Array:
    """Each value's weight, x (n, B) element-major super-blocks, ``qw`` their importance laid out alike:
    ``x²``, or ``qw · sqrt(σ² + x²)`` with σ² the super-block's Σx² (in index order) times 2/n."""
    squares: _Array = x * x
    if qw is None:
        return squares
    sigma2 = ks.fsum(squares) * F(2.0 / x.shape[0])
    weights: _Array = qw * np.sqrt(sigma2 + squares)
    return weights


def _fit(x: _Array, w: _Array, inverse: _Array) -> tuple[_Array, _Array]:
    """Σ(w·q)·x and Σ(w·q)·q (in index order) of the codes of inverse scales ``inverse`` (S,) on blocks ``x``
    (32, S)."""
    q = _LEVELS[best_index(inverse * x)]
    wq = w * q
    return ks.fsum(wq * x), ks.fsum(wq * q)


def search_numpy(x: _Array, w: _Array) -> _Array:
    """Each block's scale (columns of ``x`` (32, S), weights ``w`` alike): :func:`search` in numpy."""
    amax, peak = ks.largest(x)
    zero = ~(amax >= EPS)
    peak = np.where(zero, F(1), peak)
    scale = -peak / F(IQ4_VALUES[0])
    sumqx, sumq2 = _fit(x, w, F(1) / scale)
    positive = sumq2 > 0
    scale = np.where(positive, sumqx / np.where(positive, sumq2, F(1)), F(0))
    best = scale * sumqx
    for k in range(-_NTRY, _NTRY + 1):
        sumqx, sumq2 = _fit(x, w, F(k + IQ4_VALUES[0]) / peak)
        adopt = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        if adopt.any():
            scale = np.where(adopt, sumqx / np.where(adopt, sumq2, F(1)), scale)
            best = np.where(adopt, scale * sumqx, best)
    found: _Array = np.where(zero, F(0), scale)
    return found


def search(block: _Array, qw: _Array | None, offset: int) -> _Array:
    """Each 32-value block's scale (float32 (B, n/32)) of super-blocks ``block`` (float32 (B, n), n 32 or 256),
    weighted as llama.cpp weights them: super-block b by row ``(offset + b) % len(qw)`` of ``qw`` (rows of n), or
    by x² without ``qw``. Compiled (:mod:`.iqloop`) where numba is, to the same bits."""
    kernels = iqloop.kernels()
    b, n = block.shape
    if kernels is not None:
        scales = np.empty((b, n // _BLOCK), dtype=F)
        kernels.search(block, np.empty((0, n), dtype=F) if qw is None else qw, offset, _LEVELS, _ABOVE, scales)
        return scales
    xt = np.ascontiguousarray(block.T)
    weights = None if qw is None else np.ascontiguousarray(qw[(offset + np.arange(b)) % qw.shape[0]].T)
    w = _weights(xt, weights)
    found = search_numpy(_blocks_of(xt), _blocks_of(w))
    return np.ascontiguousarray(found.reshape(n // _BLOCK, b).T)


def _blocks_of(xt: _Array) -> _Array:
    """Element-major super-blocks (n, B) as element-major 32-value blocks (32, n/32 * B): block j of super-block b
    in column ``j*B + b``."""
    n, b = xt.shape
    return np.ascontiguousarray(xt.reshape(n // _BLOCK, _BLOCK, b).transpose(1, 0, 2)).reshape(_BLOCK, -1)


def codes(block: _Array, inverse: _Array) -> _Array:
    """The level indices (uint8 (B, n)) of super-blocks ``block`` (B, n) scaled by each 32-value block's inverse
    scale ``inverse`` (B, n/32). Compiled where numba is."""
    kernels = iqloop.kernels()
    if kernels is not None:
        out = np.empty(block.shape, dtype=np.uint8)
        kernels.codes(block, np.ascontiguousarray(inverse), _LEVELS, _ABOVE, out)
        return out
    b, n = block.shape
    scaled = block.reshape(b, n // _BLOCK, _BLOCK) * inverse[:, :, None]
    return best_index(scaled).astype(np.uint8).reshape(b, n)


def _inverse(scale: _Array) -> _Array:
    """``scale ? 1/scale : 0`` (a NaN scale is true, as in C)."""
    live = scale != 0
    inverse: _Array = np.where(live, F(1) / np.where(live, scale, F(1)), F(0))
    return inverse


def _iq4_nl(block: _Array, qw: _Array | None, offset: int, out: _Array) -> None:
    scale = search(block, qw, offset)
    out[:, 0:2] = ks.f16(scale[:, 0])[0].view(np.uint8).reshape(-1, 2)
    _pack(codes(block, _inverse(scale)), out[:, 2:])


def _iq4_xs(block: _Array, qw: _Array | None, offset: int, out: _Array) -> None:
    scales = search(block, qw, offset).T  # (8, B)
    amax, peak = ks.largest(scales)
    max_scale = np.where(amax > 0, peak, F(0))  # a scan from 0 keeps 0 where no |scale| exceeds it
    d = -max_scale / F(32)
    multiple = np.clip(ks.ni(_inverse(d) * scales), -32, 31)
    sub_d = d * multiple
    l6 = (multiple + 32).astype(np.uint16)  # (8, B), 0 ... 63
    out[:, 0:2] = ks.f16(d)[0].view(np.uint8).reshape(-1, 2)
    high = np.bitwise_or.reduce((l6 >> 4) << np.arange(0, 16, 2, dtype=np.uint16)[:, None], axis=0)
    out[:, 2:4] = high.astype("<u2").view(np.uint8).reshape(-1, 2)
    low = (l6 & 0xF).astype(np.uint8)
    out[:, 4:8] = (low[0::2] | (low[1::2] << 4)).T
    _pack(codes(block, _inverse(sub_d).T), out[:, 8:])


def _pack(found: _Array, out: _Array) -> None:
    """Level indices (B, n) as nibbles into ``out`` (B, n/2): byte ``16i + j`` holds value ``32i + j`` (low) and
    ``32i + 16 + j`` (high)."""
    pairs = found.reshape(found.shape[0], -1, 2, 16)
    out[...] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(out.shape)


# ggml type -> its encoder of super-blocks (block, importance rows or None, offset, out); its row (the block's
# values and bytes): resumerge.inputs.gguf.ggmltypes
_ENCODERS: Mapping[int, Callable[[_Array, _Array | None, int, _Array], None]] = MappingProxyType({
    IQ4_NL: _iq4_nl, IQ4_XS: _iq4_xs, **{kind: partial(iq2quants.encode, kind) for kind in iq2quants.IQ2_TYPES},
    **{kind: partial(iq1quants.encode, kind) for kind in iq1quants.IQ1_TYPES}})
# the types encode_iq encodes
I_TYPES = tuple(_ENCODERS)


def block_encoder(ggml_type: int) -> Callable[..., None]:
    """The encoder of super-blocks :func:`encode_iq` calls for ``ggml_type`` (one of :data:`I_TYPES`)."""
    return _ENCODERS[ggml_type]


def encode_iq(rows: _Array, ggml_type: int, importance: _Array | None = None, out: _Array | None = None) -> _Array:
    """llama.cpp's bytes of ``rows`` (float32, (..., n) with n whole blocks of the type) as i-quant
    ``ggml_type``: uint8 (..., n / block values * block bytes), into ``out`` when given (uint8, contiguous, of that
    many bytes). ``importance`` (float32, (n,)): llama.cpp's per-column importance for this tensor (an imatrix entry
    divided by its count), or None for the quantizer's path without one."""
    values_per_block, size = TYPES[ggml_type].block
    n = rows.shape[-1]
    per_row = n // values_per_block
    values = np.ascontiguousarray(rows, dtype=F).reshape(-1, values_per_block)
    result = np.empty((values.shape[0], size), dtype=np.uint8) if out is None else out.reshape(-1, size)
    qw = None if importance is None else np.ascontiguousarray(importance, dtype=F).reshape(per_row, values_per_block)
    encoder = _ENCODERS[ggml_type]
    chunk = _CHUNK // values_per_block
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for start in range(0, values.shape[0], chunk):
            # super-block b of the chunk weighted by its own slice of the row's importance
            encoder(values[start:start + chunk], qw, start % per_row, result[start:start + chunk])
    return result.reshape(*rows.shape[:-1], per_row * size)

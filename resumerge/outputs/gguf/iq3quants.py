"""GGUF's 3-bit i-quants (IQ3_XXS, IQ3_S) encoded to the bytes llama.cpp's quantizer writes (``ggml_quantize_chunk``:
``quantize_iq3_xxs``, ``quantize_iq3_s``), with or without an importance matrix (``shared/reference/iquants.md`` §1).

Both code a 256-value super-block as eight blocks of 32, each block as eight quadruples of magnitudes, each a point
of a D4-lattice grid (:mod:`resumerge.inputs.gguf.iq3grid`: 256 points a byte, or 512 a byte and a high bit), signs
apart, times the block's scale, a 4-bit multiple of the super-block's float16 ``d``. IQ3_XXS (98 bytes) keeps seven
sign bits per eight values (the eighth makes the count of minus signs even: the value of least weighted square
gives way) and the scale in the top four bits of the signs' word; IQ3_S (110 bytes) keeps all eight signs, the high
bits of its indices and its scales apart.

llama.cpp finds each block's scale by trying inverse scales ``(15 + 0.2 s) / max`` (s within ±15 for IQ3_XXS, ±9
for IQ3_S), the magnitudes rounded to levels ``nearest_int((id·|x| - 1) / 2)`` within 0 ... 7, a quadruple off the
grid replaced by its neighbour (:mod:`.iq3neighbours`) of least error weighted by the roots of the weights, each
candidate's fit ``Σwxq / Σwq²`` adopted on a strict improvement; then, where a quadruple of the adopted codes was
off the grid, the codes rounded again at the adopted scale (IQ3_XXS: only those quadruples) and the scale fitted
once more. The weights are ``x²`` without a matrix, else ``qw · sqrt(σ² + x²)``, σ² the super-block's mean square
times 2. ``d`` is the largest block scale / 31 times a fudge factor (1.0125, 1.033) and each block's 4-bit scale
``nearest_int((scale / (max / 31) - 1) / 2)``. Two of llama.cpp's quirks are kept: IQ3_S's empty block (its values
all 0) does not advance where the next block's codes and signs are written, and IQ3_XXS's block counts as empty
under a largest magnitude of 1e-8.

The numpy path vectorises across blocks, values laid out element-major (32, S) so that each sum is
:func:`.ksearch.fsum`'s sequential one; where numba is installed the compiled kernel (:mod:`.iq3loop`) runs C's
scalar loop instead, to the same bits.
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np

from resumerge.inputs.gguf.ggmltypes import IQ3_S, IQ3_XXS, TYPES
from resumerge.outputs.gguf import iq3loop
from resumerge.outputs.gguf import ksearch as ks
from resumerge.outputs.gguf.iq3neighbours import Neighbours, neighbours
from resumerge.outputs.gguf.kfloat import F

__all__ = ["I3_TYPES", "encode_iq3"]

_Array = np.ndarray

# ggml type -> its grid's points (its row, the block's bytes: resumerge.inputs.gguf.ggmltypes)
_GRID = MappingProxyType({IQ3_XXS: 256, IQ3_S: 512})
# the types encode_iq3 encodes
I3_TYPES = tuple(_GRID)
_FUDGE = MappingProxyType({IQ3_XXS: F(1.0125), IQ3_S: F(1.033)})
_QK = 256
# super-blocks coded together: a chunk's working arrays stay small
_CHUNK = 256


def _encode_chunk(block: _Array, qw: _Array | None, offset: int, ggml_type: int, out: _Array) -> None:
    """Super-blocks ``block`` (float32 (B, 256)) as ``ggml_type`` into ``out`` (uint8 (B, bytes)): super-block b
    weighted by row ``(offset + b) % len(qw)`` of ``qw``, or by x² without one."""
    grid = neighbours(_GRID[ggml_type])
    xxs = ggml_type == IQ3_XXS
    d = np.zeros(block.shape[0], dtype=F)
    kernels = iq3loop.kernels()
    if kernels is not None:
        kernels.encode(block, np.empty((0, _QK), dtype=F) if qw is None else qw, offset, xxs, grid.odd, grid.levels,
                       grid.kmap, grid.flat, out, d)
    else:
        weights = None if qw is None else qw[(offset + np.arange(block.shape[0])) % qw.shape[0]]
        _encode_numpy(block, weights, xxs, grid, out, d)
    out[:, 0:2] = ks.f16(d)[0].view(np.uint8).reshape(-1, 2)


def _element_major(a: _Array) -> _Array:
    """Super-blocks (B, 256) as element-major 32-value blocks (32, 8B): block j of super-block b in column 8b + j."""
    return np.ascontiguousarray(a.reshape(-1, 32).T)


def _scan_max(x: _Array, start: _Array) -> _Array:
    """Per column, ``m = start; m = MAX(m, x_i)`` in index order (C's ``MAX``: ``m > x_i ? m : x_i``)."""
    m = start
    for row in x:
        m = np.where(m > row, m, row)
    return m


def _signs(x: _Array, w: _Array, xxs: bool) -> tuple[_Array, _Array]:
    """The magnitudes (32, S) and each block's four sign bytes (4, S) of blocks ``x`` (32, S) weighted ``w``:
    IQ3_XXS's seven bits with the even count's flip (the first least ``w·x·x`` of an odd group), IQ3_S's eight."""
    negative = ~(x >= 0)  # NaN too, as C's test
    xval = np.where(negative, -x, x)
    bits = negative.reshape(4, 8, -1).astype(np.int32) << np.arange(8, dtype=np.int32)[None, :, None]
    signs = bits.sum(axis=1)
    if xxs:
        odd = negative.reshape(4, 8, -1).sum(axis=1) % 2 == 1
        square = (w * x * x).reshape(4, 8, -1)
        least, imin = square[:, 0], np.zeros(odd.shape, dtype=np.int32)
        for i in range(1, 8):
            take = square[:, i] < least
            least = np.where(take, square[:, i], least)
            imin = np.where(take, i, imin)
        group, column = np.nonzero(odd)
        rows = 8 * group + imin[group, column]
        xval[rows, column] = -xval[rows, column]
        signs[group, column] ^= 1 << imin[group, column]
        signs &= 127
    return xval, signs


def _codes(xval: _Array, waux: _Array, inverse: _Array, near: _Array, grid: Neighbours) -> tuple[_Array, _Array]:
    """Each quadruple's levels (8, 4, S) at inverse scales ``inverse`` (S,) of blocks' magnitudes ``xval`` (32, S),
    one off the grid replaced by its neighbour of least error at scale ``near`` weighted by ``waux``; and which were
    on it (8, S)."""
    levels = np.clip(ks.ni(F(0.5) * (inverse * xval - F(1))), 0, 7).astype(np.int32).reshape(8, 4, -1)
    u = levels[:, 0] | (levels[:, 1] << 3) | (levels[:, 2] << 6) | (levels[:, 3] << 9)
    on = grid.kmap[u] >= 0
    group, column = np.nonzero(~on)
    if group.size:
        candidates = grid.padded[u[group, column]]  # (n, most), -1 past each count
        points = grid.odd[np.maximum(candidates, 0)]  # (n, most, 4)
        x4, w4 = xval.reshape(8, 4, -1), waux.reshape(8, 4, -1)
        scale = near[column][:, None]
        d2 = np.zeros(candidates.shape, dtype=F)
        for i in range(4):
            diff = scale * points[:, :, i] - x4[group, i, column][:, None]
            d2 += w4[group, i, column][:, None] * diff * diff
        # a neighbour is taken on d2 < the best so far, from FLT_MAX: NaN, inf and FLT_MAX never are; none taken
        # (llama.cpp aborts): the first
        d2 = np.where((candidates >= 0) & (d2 < np.finfo(F).max), d2, np.inf)
        chosen = candidates[np.arange(group.size), np.argmin(d2, axis=1)]
        levels[group, :, column] = grid.levels[chosen]
    return levels, on


def _fit(xval: _Array, w: _Array, levels: _Array) -> tuple[_Array, _Array]:
    """Σ w·x·q and Σ w·q·q (q = 2l + 1) over each block, in index order (the terms C-ordered: numpy sums an axis
    that is contiguous in memory pairwise)."""
    q = (2 * levels.reshape(32, -1) + 1).astype(F)
    return ks.fsum(np.ascontiguousarray(w * xval * q)), ks.fsum(np.ascontiguousarray(w * q * q))


def _search(xval: _Array, w: _Array, waux: _Array, top: _Array, xxs: bool,
            grid: Neighbours) -> tuple[_Array, _Array]:
    """Each non-empty block's scale (S,) and levels (8, 4, S): the candidates, then the refinement."""
    ntry = 15 if xxs else 9
    columns = top.shape[0]
    scale, best = top / F(15), np.zeros(columns, dtype=F)
    codes = np.zeros((8, 4, columns), dtype=np.int32)
    on = np.full((8, columns), xxs)
    for step in range(-ntry, ntry + 1):
        inverse = (F(15) + F(step) * F(0.2)) / top
        trial, trial_on = _codes(xval, waux, inverse, F(1) / inverse, grid)
        sumqx, sumq2 = _fit(xval, w, trial)
        adopt = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        scale = np.where(adopt, sumqx / np.where(adopt, sumq2, F(1)), scale)
        best = np.where(adopt, scale * sumqx, best)
        codes = np.where(adopt[None, None], trial, codes)
        on = np.where(adopt[None], trial_on, on)
    again = np.flatnonzero((~on).any(axis=0) & (scale > 0))
    if again.size:
        sub = scale[again]
        trial, _ = _codes(xval[:, again], waux[:, again], F(1) / sub, sub, grid)
        if xxs:  # only the quadruples off the grid are rounded again
            trial = np.where(on[:, again][:, None], codes[:, :, again], trial)
        sumqx, sumq2 = _fit(xval[:, again], w[:, again], trial)
        codes[:, :, again] = trial
        scale[again] = np.where(sumq2 > 0, sumqx / np.where(sumq2 > 0, sumq2, F(1)), sub)
    return scale, codes


def _encode_numpy(block: _Array, qw: _Array | None, xxs: bool, grid: Neighbours, out: _Array, d: _Array) -> None:
    """:func:`_encode_chunk` in numpy: ``qw`` (B, 256) each super-block's own importance, or None."""
    supers = block.shape[0]
    squares = block * block
    sigma2 = F(2) * ks.fsum(np.ascontiguousarray(squares.T)) / F(_QK)
    weight = squares if qw is None else qw * np.sqrt(sigma2[:, None] + squares)
    x, w = _element_major(block), _element_major(weight)
    waux = np.sqrt(w)
    xval, signs = _signs(x, w, xxs)
    top = _scan_max(xval[1:], xval[0])
    live = np.flatnonzero(~(top < F(1e-8)) if xxs else top != 0)
    columns = 8 * supers
    scale = np.zeros(columns, dtype=F)
    codes = np.zeros((8, 4, columns), dtype=np.int32)
    if live.size:
        scale[live], codes[:, :, live] = _search(xval[:, live], w[:, live], waux[:, live], top[live], xxs, grid)
    flip = scale < 0
    scale = np.where(flip, -scale, scale)
    signs = np.where(flip, ~signs & (127 if xxs else 255), signs)
    index = grid.kmap[codes[:, 0] | (codes[:, 1] << 3) | (codes[:, 2] << 6) | (codes[:, 3] << 9)]  # (8, S)
    scales = scale.reshape(supers, 8)
    max_scale = _scan_max(scales.T, np.zeros(supers, dtype=F))
    sub = max_scale / F(31)
    nibbles = np.clip(ks.ni(F(0.5) * ((F(1) / sub)[:, None] * scales - F(1))), 0, 15).astype(np.uint32)
    written = max_scale != 0
    d[...] = np.where(written, sub * (F(1.0125) if xxs else F(1.033)), F(0))
    out[...] = 0
    empty = np.ones(columns, dtype=bool)
    empty[live] = False
    if xxs:
        out[:, 2:66] = index.T.reshape(supers, 64)
        word = np.where(empty, 0, signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21)).astype(np.uint32)
        word = word.reshape(supers, 8) | (nibbles << 28)
        out[:, 66:98] = word.astype("<u4").view(np.uint8).reshape(supers, 32)
        out[~written] = 0  # llama.cpp clears an all-empty super-block's codes and signs
        return
    # an empty block does not advance where the next block's codes and signs go
    place = (np.cumsum(~empty.reshape(supers, 8), axis=1) - 1).reshape(-1)
    rows, blocks_of = np.repeat(np.arange(supers), 8), np.tile(np.arange(8), supers)
    for k in range(8):
        keep = ~empty
        out[rows[keep], 2 + 8 * place[keep] + k] = index[k, keep] & 255
        if k < 4:
            out[rows[keep], 74 + 4 * place[keep] + k] = signs[k, keep]
    high = ((index >> 8) << np.arange(8)[:, None]).sum(axis=0) * ~empty
    out[rows, 66 + blocks_of] = high
    pairs = np.where(written[:, None], nibbles, 0).reshape(supers, 4, 2)
    out[:, 106:110] = pairs[:, :, 0] | (pairs[:, :, 1] << 4)


def encode_iq3(rows: _Array, ggml_type: int, importance: _Array | None = None, out: _Array | None = None) -> _Array:
    """llama.cpp's bytes of ``rows`` (float32, (..., n), n whole 256-value super-blocks) as IQ3_XXS or IQ3_S:
    uint8 (..., n / 256 * block bytes), into ``out`` when given (uint8, contiguous, of that many bytes).
    ``importance`` (float32, (n,)): llama.cpp's per-column importance for this tensor (an imatrix entry over its
    count), or None for the quantizer's path without one."""
    size = TYPES[ggml_type].size
    n = rows.shape[-1]
    per_row = n // _QK
    values = np.ascontiguousarray(rows, dtype=F).reshape(-1, _QK)
    result = np.empty((values.shape[0], size), dtype=np.uint8) if out is None else out.reshape(-1, size)
    qw = None if importance is None else np.ascontiguousarray(importance, dtype=F).reshape(per_row, _QK)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for start in range(0, values.shape[0], _CHUNK):
            _encode_chunk(values[start:start + _CHUNK], qw, start % per_row, ggml_type,
                          result[start:start + _CHUNK])
    return result.reshape(*rows.shape[:-1], per_row * size)

"""The lookup tables llama.cpp's 2-bit i-quant quantizer builds at init (``iq2xs_init_impl``), built here the same
way for :mod:`.iq2loop`: each grid's points in the quantizer's coordinates, the map from any group of eight 2-bit
levels to its grid point, and, for a group that is no grid point, the grid points nearest it to try instead.

The quantizer rounds a group of eight magnitudes to levels l = 0, 1, 2 (coordinates 2l + 1) and reads the 16-bit
key (level i at bits 2i) in the map: a grid point's index, or, off the grid, where its neighbour list starts. A
group's neighbours are the grid points at the smallest squared distances from it (integer, in those
coordinates): every point at the nearest ``nwant`` distinct distances (two for IQ2_XXS and IQ2_XS, one for IQ2_S),
listed by (distance, index) as llama.cpp's ``qsort`` with ``iq2_compare_func`` leaves them. The lists are stored
as C stores them: a count, then the indices; the map holds ``-(start + 1)`` for an off-grid key.

Only the keys a quantizer forms (every level 0 ... 2) get neighbour lists (6,561 of the map's 43,692 keys): llama.cpp
lists them for all, which no lookup reads. Built once a process per type on first use (a fraction of a second
for IQ2_S's 1024 points, about a second for the 1-bit grid's 2048), never at import.
"""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from resumerge.inputs.gguf.ggmltypes import IQ2_S, IQ2_XS, IQ2_XXS
from resumerge.inputs.gguf.iq2blocks import kgrid

__all__ = ["Tables", "build", "tables"]

_KEYS = 43692  # kmap_size: every key of levels 0 ... 2 (the largest, all 2s, is 43690)
_NWANT = MappingProxyType({IQ2_XXS: 2, IQ2_XS: 2, IQ2_S: 1})
_ROWS = 256  # keys whose distances are taken together: 2048 at once made a 47 MB peak for the 1-bit grid


class Tables(NamedTuple):
    """One type's tables: ``grid`` (int8 (points, 8): coordinates 2l + 1), ``kmap`` (int32 (43692,): key -> point
    index, or ``-(start + 1)``; -1 for a key with a level 3, never formed), ``neighbours`` (uint16: at each start, a
    count then that many point indices)."""

    grid: np.ndarray
    kmap: np.ndarray
    neighbours: np.ndarray


def _coordinates(keys: np.ndarray) -> np.ndarray:
    """The eight coordinates ``2l + 1`` (int16 (n, 8)) of 16-bit keys (level i at bits 2i)."""
    levels = (keys.astype(np.int32)[:, None] >> (2 * np.arange(8))) & 3
    coordinates: np.ndarray = (2 * levels + 1).astype(np.int16)
    return coordinates


@functools.cache
def tables(ggml_type: int) -> Tables:
    """The quantizer's tables of ``ggml_type`` (IQ2_XXS, IQ2_XS or IQ2_S), built on first use."""
    return build(kgrid(ggml_type), _NWANT[ggml_type])


def build(points: np.ndarray, nwant: int) -> Tables:
    """The tables of a grid of ``points`` (uint16 keys) whose off-grid keys list the points at the nearest
    ``nwant`` distinct distances (the 1-bit grid's too: :mod:`.iq1quants`)."""
    grid = _coordinates(points)
    kmap = np.full(_KEYS, -1, dtype=np.int32)
    kmap[points] = np.arange(points.size, dtype=np.int32)
    keys = np.arange(_KEYS)
    # the keys a quantizer can form (every level 0 ... 2: no 2-bit field 3) off the grid; the others are never
    # looked up (llama.cpp lists neighbours for them too: 41,644 keys where 4,513 are read, for the 1-bit grid)
    off = np.flatnonzero((kmap < 0) & ((keys & (keys >> 1) & 0x5555) == 0))
    counts: list[np.ndarray] = []
    found: list[np.ndarray] = []
    points_f = grid.astype(np.float32)
    norms = (points_f * points_f).sum(axis=1)
    for at in range(0, off.size, _ROWS):
        keys = _coordinates(off[at:at + _ROWS]).astype(np.float32)
        # |k - g|² = |k|² + |g|² - 2 k·g: small integers, exact in float32 in any order (a product of eight terms,
        # not a (keys, points, 8) difference). einsum's own loop, not BLAS's: split over OpenBLAS's threads on a busy
        # machine, the product spun at their barrier for a second of CPU a process (0.3 of 0.6 s for the 1-bit grid)
        d2 = ((keys * keys).sum(axis=1)[:, None] + norms[None, :]
              - 2 * np.einsum("ik,jk->ij", keys, points_f)).astype(np.int32)
        # the nwant-th smallest distinct distance of each key: the farthest a neighbour may be
        bound = d2.min(axis=1)
        for _ in range(nwant - 1):
            bound = np.where(d2 > bound[:, None], d2, np.iinfo(np.int32).max).min(axis=1)
        row, col = np.nonzero(d2 <= bound[:, None])
        # by key, then distance, then point index: qsort's order with iq2_compare_func
        order = np.lexsort((col, d2[row, col], row))
        counts.append(np.bincount(row, minlength=keys.shape[0]))
        found.append(col[order])
    count = np.concatenate(counts)
    starts = np.concatenate([[0], np.cumsum(count + 1)[:-1]])
    neighbours = np.empty(count.size + count.sum(), dtype=np.uint16)
    neighbours[starts] = count
    body = np.ones(neighbours.size, dtype=bool)
    body[starts] = False
    neighbours[body] = np.concatenate(found)
    kmap[off] = -(starts + 1)
    coordinates = grid.astype(np.int8)
    for table in (coordinates, kmap, neighbours):
        table.setflags(write=False)
    return Tables(coordinates, kmap, neighbours)

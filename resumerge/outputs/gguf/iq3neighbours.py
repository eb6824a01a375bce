"""Where a 3-bit i-quant's encoder looks when four rounded levels are not a point of its grid: llama.cpp's map of
the 4096 level quadruples (``iq3xs_init_impl``), built here from the point sets of
:mod:`resumerge.inputs.gguf.iq3grid`.

A quadruple on the grid maps to its point's index. One off it maps to its neighbours: the grid points at the
nearest squared distances (the two nearest distances for IQ3_XXS's 256 points, three for IQ3_S's 512), distances
between the odd magnitudes ``2l + 1``, in order of (distance, index) as llama.cpp sorts them. The encoder tries
each in that order and keeps the first of the least weighted error.

Two layouts of the same lists: llama.cpp's flat one for the compiled kernels (``kmap[u]`` the point's index, or
``-(start + 1)`` with ``flat[start]`` the count and the indices after it) and a padded table (one row per
quadruple, -1 past its count) for the numpy path.

May import: numpy, resumerge.inputs.gguf.iq3grid.
"""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from resumerge.inputs.gguf import iq3grid

__all__ = ["Neighbours", "neighbours"]

_QUADRUPLES = 4096  # 8 levels ** 4
_ROWS = 256  # quadruples whose distances are taken together
# the distinct nearest distances kept: llama.cpp's nwant
_DISTANCES = MappingProxyType({256: 2, 512: 3})


class Neighbours(NamedTuple):
    """One grid's points and map (read-only arrays)."""

    levels: np.ndarray  # int32 (size, 4): each point's levels 0 ... 7
    odd: np.ndarray  # float32 (size, 4): each point's magnitudes 2l + 1
    kmap: np.ndarray  # int32 (4096,): the point's index, or -(start + 1) into ``flat``
    flat: np.ndarray  # int32: at each start, a count and that many point indices
    padded: np.ndarray  # int32 (4096, most): each quadruple's neighbours, -1 past its count (on the grid: all -1)


@functools.cache
def neighbours(size: int) -> Neighbours:
    """The map of the 256-point (IQ3_XXS) or 512-point (IQ3_S) grid, built once a process (a few milliseconds)."""
    levels = iq3grid.levels(size).astype(np.int32)
    quads = (np.arange(_QUADRUPLES, dtype=np.int32)[:, None] >> (3 * np.arange(4, dtype=np.int32))) & 7
    packed = (levels << (3 * np.arange(4, dtype=np.int32))).sum(axis=1)
    index = np.full(_QUADRUPLES, -1, dtype=np.int32)
    index[packed] = np.arange(size, dtype=np.int32)
    # By quadruples a chunk at a time: the whole (4096, points, 4) difference held at once was a 44 MB peak for
    # IQ3_S's 512 points, above what the run's memory baseline (measured once the table is built) counts.
    counts = np.empty(_QUADRUPLES, dtype=np.int64)
    chunks: list[np.ndarray] = []  # each chunk's ranks as far as its longest list
    for at in range(0, _QUADRUPLES, _ROWS):
        # squared distances between magnitudes: 4 * the levels' squared differences
        d2 = 4 * ((quads[at:at + _ROWS, None, :] - levels[None, :, :]) ** 2).sum(axis=2)
        ranks = np.argsort(d2, axis=1, kind="stable")  # by distance, then index
        ranked = np.take_along_axis(d2, ranks, axis=1)
        # how many distinct distances come before each entry: kept while under the wanted count
        steps = np.cumsum(np.diff(ranked, axis=1) > 0, axis=1, dtype=np.int32)
        counts[at:at + _ROWS] = 1 + (steps < _DISTANCES[size]).sum(axis=1)
        chunks.append(ranks[:, :int(counts[at:at + _ROWS].max())].astype(np.int32))
    order = np.full((_QUADRUPLES, max(c.shape[1] for c in chunks)), -1, dtype=np.int32)
    for at, chunk in zip(range(0, _QUADRUPLES, _ROWS), chunks, strict=True):
        order[at:at + _ROWS, :chunk.shape[1]] = chunk
    off = np.flatnonzero(index < 0)
    most = int(counts[off].max())
    padded = np.where(np.arange(most) < counts[:, None], order[:, :most], -1).astype(np.int32)
    padded[index >= 0] = -1
    kmap = index.copy()
    pieces, start = [], 0
    for u in off:
        kmap[u] = -(start + 1)
        pieces.append(np.concatenate([[counts[u]], order[u, :counts[u]]]))
        start += 1 + int(counts[u])
    flat = np.concatenate(pieces).astype(np.int32)
    odd = (2 * levels + 1).astype(np.float32)
    found = Neighbours(levels, odd, kmap, flat, padded)
    for array in found:
        array.flags.writeable = False
    return found

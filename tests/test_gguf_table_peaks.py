"""The i-quant encoders' lookup tables are built without a large transient peak. A run's memory baseline is measured
once the kernels are loaded and the tables built (:func:`resumerge.outputs.gguf.encoders.warm_kernels`, in a fresh
process: its resident set after), but in the run itself the first tensor of a type builds them while the governor
has admitted units up to the budget, so what the build holds only while it runs is held above the budget. Built at
once, the neighbour searches held 44 MB (IQ3_S's 4096 × 512 × 4 differences) and 47 MB (the 1-bit grid's 2048 keys
× 2048 points): a ``q8_0,q4_k_m,iq4_xs,iq2_m`` release at ``plan``'s smallest budget (445 MB) peaked at 490 MB.
Built a chunk at a time, the same tables (tests/test_gguf_iq2.py, test_gguf_iq3.py, test_gguf_iq1.py hold their
bytes against llama.cpp's) take a few MB; ``tests/test_gguf_memory.py`` runs such a release at the budget."""

from __future__ import annotations

import functools
import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest

from resumerge.inputs.gguf import iq1blocks, iq3grid
from resumerge.inputs.gguf.ggmltypes import IQ2_S, IQ2_XS, IQ2_XXS
from resumerge.inputs.gguf.iq2blocks import kgrid
from resumerge.outputs.gguf import iq2grid, iq3neighbours

# What a table's build may hold beyond the table while it runs: well inside the 5 % a budget ``plan`` names leaves
# above its figure (22 MB of a 440 MB budget, the smallest runs').
_TRANSIENT = 12 << 20

# Each table's build from its grid's points (read before the trace: the grids are the decoders', not the build's).
BUILDS: dict[str, Callable[[], Callable[[], tuple[np.ndarray, ...]]]] = {
    "iq2_xxs": lambda: functools.partial(iq2grid.build, kgrid(IQ2_XXS), 2),
    "iq2_xs": lambda: functools.partial(iq2grid.build, kgrid(IQ2_XS), 2),
    "iq2_s": lambda: functools.partial(iq2grid.build, kgrid(IQ2_S), 1),
    "iq1": lambda: functools.partial(iq2grid.build, iq1blocks.kgrid(), 3),
    "iq3_xxs": lambda: functools.partial(iq3neighbours.neighbours.__wrapped__, 256),
    "iq3_s": lambda: functools.partial(iq3neighbours.neighbours.__wrapped__, 512),
}


@pytest.mark.parametrize("table", sorted(BUILDS))
def test_a_table_s_build_holds_little_beyond_the_table(table: str) -> None:
    """The build's peak of traced allocations (numpy's included) less what the table keeps is under
    :data:`_TRANSIENT`."""
    build = BUILDS[table]()
    iq3grid.levels(256), iq3grid.levels(512)  # the grids' own, as above
    tracemalloc.start()
    try:
        built = build()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    kept = sum(array.nbytes for array in built)
    assert peak - kept <= _TRANSIENT, (table, peak - kept, kept)


@pytest.mark.parametrize("table", ["iq1", "iq2_s", "iq2_xs", "iq2_xxs"])
def test_a_2_bit_grid_s_neighbours_are_the_brute_force_ones(table: str) -> None:
    """However :func:`iq2grid.build` takes its distances (a product of the coordinates, chunked), each off-grid key
    a quantizer forms lists every grid point at its ``nwant`` nearest distinct squared distances, by distance then
    index, as (count, indices) at ``-(kmap + 1)``: here from each key's integer differences to every point."""
    build = BUILDS[table]()
    points, nwant = build.args
    built = build()
    grid = ((points.astype(np.int32)[:, None] >> (2 * np.arange(8))) & 3) * 2 + 1
    kmap = np.full(built.kmap.size, -1, dtype=np.int32)
    kmap[points] = np.arange(points.size)
    keys = np.arange(kmap.size)
    off = keys[(kmap < 0) & np.all(((keys[:, None] >> (2 * np.arange(8))) & 3) < 3, axis=1)]
    counts, lists = [], []
    for at in range(0, off.size, 256):
        coordinates = ((off[at:at + 256, None] >> (2 * np.arange(8))) & 3) * 2 + 1
        d2 = ((coordinates[:, None, :] - grid[None, :, :]).astype(np.int16) ** 2).sum(axis=2, dtype=np.int32)
        ranked = np.sort(d2, axis=1)  # each key's distances, and how many distinct ones come before each
        distinct = np.concatenate([np.zeros((len(d2), 1), int), np.cumsum(np.diff(ranked, axis=1) > 0, axis=1)], 1)
        bound = np.where(distinct < nwant, ranked, -1).max(axis=1)
        key, point = np.nonzero(d2 <= bound[:, None])
        counts.append(np.bincount(key, minlength=len(d2)))
        lists.append(point[np.lexsort((point, d2[key, point], key))])
    count, near = np.concatenate(counts), np.concatenate(lists)
    starts = np.cumsum(count + 1) - count - 1
    kmap[off] = -(starts + 1)
    neighbours = np.concatenate([np.concatenate([[c], near[s - i:s - i + c]])
                                 for i, (c, s) in enumerate(zip(count, starts, strict=True))])
    assert np.array_equal(built.grid, grid.astype(np.int8)) and np.array_equal(built.kmap, kmap)
    assert built.neighbours.dtype == np.uint16 and np.array_equal(built.neighbours, neighbours)

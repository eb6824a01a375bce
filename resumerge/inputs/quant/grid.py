"""Scale grids: one scale (and zero point) per block of a 2-D weight, applied, inverted and measured in place.

Every format here stores its scales as a grid over the weight's ``[rows, cols]``: block FP8 one per 128×128 block,
compressed-tensors one per tensor (one block the size of the weight), per row (``1×cols``), per group (``1×g``) or
per block. Edge blocks may be partial: they use their scale over fewer elements. A row chunk ``[a, b)`` of the
weight needs the grid rows :func:`grid_rows` names; every function here takes the grid from that first row on, so
a codec reads only the scale rows its chunk needs.

Every operation is elementwise or a maximum, so the bits do not depend on the chunking or on torch's threads, nor on
the device (a division by a number goes through :func:`divide`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from resumerge.machine.torch_import import torch

__all__ = ["Block", "divide", "grid_extremes", "grid_max", "grid_rows", "grid_shape", "pieces"]

# (rows, cols) of one block of the grid; the last block of a row or column may be partial.
Block = tuple[int, int]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def divide(values: torch.Tensor, by: float) -> torch.Tensor:
    """``values / by`` rounded once, as the CPU computes it, on any device: a CUDA kernel dividing by a host number
    multiplies by its rounded reciprocal instead (``amax / 448`` then differs from the CPU's in the last bit, and so
    would a scale), so the divisor is made a tensor on ``values``' device."""
    return values / values.new_full((), by)


def grid_shape(shape: tuple[int, int], block: Block) -> tuple[int, int]:
    """The grid's shape for a ``[rows, cols]`` weight: ``(ceil(rows / bh), ceil(cols / bw))``."""
    return _ceil(shape[0], block[0]), _ceil(shape[1], block[1])


def grid_rows(start: int, stop: int, block: Block) -> tuple[int, int]:
    """The grid rows ``[first, stop)`` that weight rows ``[start, stop)`` use."""
    return start // block[0], _ceil(stop, block[0])


def _bands(start: int, stop: int, bh: int) -> Iterator[tuple[int, int, int]]:
    """(chunk row a, chunk row b, grid row relative to the chunk's first) for each block row the chunk touches."""
    first = start // bh
    row = start
    while row < stop:
        end = min(stop, (row // bh + 1) * bh)
        yield row - start, end - start, row // bh - first
        row = end


def pieces(values: torch.Tensor, grids: Sequence[torch.Tensor], block: Block, *,
           row_start: int = 0) -> Iterator[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Views of ``values`` (``[n, cols]``, rows ``row_start ...`` of the weight) with, for each grid in ``grids``
    (``[grid rows from grid_rows(row_start, ...)[0], grid cols]``), the view of it that broadcasts over that piece.

    An in-place elementwise operation applied piece by piece applies it to the whole chunk: the pieces are the
    full-width blocks of each block row (as ``[h, blocks, bw]``) and the partial last column block.
    """
    n, cols = values.shape
    bw = block[1]
    full = cols // bw
    if block[0] == 1:
        bands: Iterator[tuple[int, int, slice]] = ((0, n, slice(0, n)) for _ in range(1))
    else:
        bands = ((a, b, slice(k, k + 1)) for a, b, k in _bands(row_start, row_start + n, block[0]))
    for a, b, rows in bands:
        band = values[a:b]
        if full:
            body = band[:, : full * bw].view(b - a, full, bw)
            yield body, [g[rows, :full].unsqueeze(-1) for g in grids]
        if cols % bw:
            yield band[:, full * bw:], [g[rows, full:full + 1] for g in grids]


def _grid_reduce(values: torch.Tensor, block: Block, *reductions: str) -> list[torch.Tensor]:
    """Per block of ``values`` (``[n, cols]``, starting at a block row), each of ``reductions`` (``"amin"``,
    ``"amax"``: exact, so the order of the reduction does not change the bits), each ``grid_shape(values.shape,
    block)`` in ``values``' dtype."""
    n, cols = values.shape
    shape = grid_shape((n, cols), block)
    grids = [values.new_empty(shape) for _ in reductions]
    bw = block[1]
    full = cols // bw
    if block[0] == 1:
        bands: list[tuple[int, int, int]] = [(0, n, -1)]
    else:
        bands = list(_bands(0, n, block[0]))
    for a, b, k in bands:
        band = values[a:b]
        rows = slice(a, b) if k < 0 else slice(k, k + 1)
        # One row per grid row reduces only within the row; a block row reduces its rows too.
        dims: tuple[int, ...] = (2,) if k < 0 else (0, 2)
        tail_dims: tuple[int, ...] = (1,) if k < 0 else (0, 1)
        for grid, reduction in zip(grids, reductions, strict=True):
            if full:
                grid[rows, :full] = getattr(band[:, : full * bw].view(b - a, full, bw), reduction)(dim=dims)
            if cols % bw:
                grid[rows, full] = getattr(band[:, full * bw:], reduction)(dim=tail_dims)
    return grids


def grid_extremes(values: torch.Tensor, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of ``values`` (``[n, cols]``, starting at a block row), its minimum and maximum, each
    ``grid_shape(values.shape, block)`` in ``values``' dtype."""
    low, high = _grid_reduce(values, block, "amin", "amax")
    return low, high


def grid_max(values: torch.Tensor, block: Block) -> torch.Tensor:
    """Per block of ``values`` (``[n, cols]``, starting at a block row), its maximum: one reduction, where
    :func:`grid_extremes` makes two (a block's largest magnitude is the maximum of its ``abs``)."""
    return _grid_reduce(values, block, "amax")[0]

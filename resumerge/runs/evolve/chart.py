"""The objective per generation as a PNG: the best so far, each generation's best and median, and its spread (a
bar from its lowest to its highest objective); drawn on check's canvas (:mod:`resumerge.outputs.canvas`: the
standard library alone, no plotting dependency)."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence

from resumerge.outputs.canvas import Canvas
from resumerge.outputs.glyphs import GLYPH_HEIGHT, text_width

WIDTH, HEIGHT = 720, 360
_LEFT, _RIGHT, _TOP, _BOTTOM = 72, 696, 32, 280
_SPREAD, _MEDIAN, _BEST, _SO_FAR = (200, 200, 200), (255, 127, 14), (31, 119, 180), (44, 160, 44)
_TEXT, _AXIS, _GRID = (40, 40, 40), (90, 90, 90), (225, 225, 225)
_WIDE = 6  # the best so far's line: wider than the generation's best drawn over it


def objective_png(generations: Sequence[Sequence[float]]) -> bytes:
    """The chart of the objectives of each generation's candidates (lower is better), as PNG bytes."""
    canvas = Canvas(WIDTH, HEIGHT)
    canvas.text(_LEFT, 8, "Objective per generation (lower is better)", _TEXT)
    finite = [v for g in generations for v in g if v == v and abs(v) != float("inf")]
    low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if high == low:
        low, high = low - 0.5, high + 0.5
    count = len(generations)

    def x_of(g: int) -> int:
        return _LEFT + (_RIGHT - _LEFT) * g // max(count - 1, 1) if count > 1 else (_LEFT + _RIGHT) // 2

    def y_of(v: float) -> int:
        clipped = min(max(v, low), high) if v == v else high
        return _BOTTOM - round((_BOTTOM - _TOP) * (clipped - low) / (high - low))

    for quarter in range(5):
        y = _BOTTOM - (_BOTTOM - _TOP) * quarter // 4
        if quarter:
            canvas.line(_LEFT, y, _RIGHT, y, _GRID)
        label = f"{low + (high - low) * quarter / 4:.4g}"
        canvas.text(_LEFT - 6 - text_width(label), y - GLYPH_HEIGHT // 2, label, _TEXT)
    canvas.line(_LEFT, _BOTTOM, _RIGHT, _BOTTOM, _AXIS)
    canvas.line(_LEFT, _TOP, _LEFT, _BOTTOM, _AXIS)
    for g in range(count):
        canvas.line(x_of(g), _BOTTOM, x_of(g), _BOTTOM + 4, _AXIS)
        canvas.text(x_of(g) - text_width(str(g + 1)) // 2, _BOTTOM + 7, str(g + 1), _TEXT)
    canvas.text((_LEFT + _RIGHT - text_width("generation")) // 2, _BOTTOM + 18, "generation", _TEXT)
    canvas.text(8, (_TOP + _BOTTOM + text_width("objective")) // 2, "objective", _TEXT, vertical=True)
    for g, values in enumerate(generations):
        if values:
            canvas.line(x_of(g), y_of(max(values)), x_of(g), y_of(min(values)), _SPREAD, thick=5)
    best = [min(v) for v in generations if v]
    so_far = list(itertools.accumulate(best, min))
    medians = [statistics.median(v) for v in generations if v]
    # The best so far is the best of each generation that improved on it, so the two lines lie on each other: it is
    # drawn first and wider, the generation's best over it, so both show where they meet (issue 87: the legend named
    # a line hidden under another).
    for series, colour, thick in ((so_far, _SO_FAR, _WIDE), (medians, _MEDIAN, 2), (best, _BEST, 2)):
        points = [(x_of(g), y_of(v)) for g, v in enumerate(series)]
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            canvas.line(x0, y0, x1, y1, colour, thick=thick)
        for x, y in points:
            canvas.line(x - 3, y, x + 3, y, colour, thick=thick)
    for row, (colour, label, thick) in enumerate(((_SO_FAR, "best so far", _WIDE),
                                                  (_BEST, "best of the generation", 2),
                                                  (_MEDIAN, "median of the generation", 2),
                                                  (_SPREAD, "spread: lowest to highest", 5))):
        y, x = _BOTTOM + 34 + (row % 2) * 12, _LEFT + (row // 2) * 300  # two columns of two
        canvas.line(x, y + 3, x + 24, y + 3, colour, thick=thick)
        canvas.text(x + 32, y, label, _TEXT)
    return canvas.png()

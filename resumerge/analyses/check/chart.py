"""The per-layer drift chart of a check, a PNG beside its report: a title, one line per model the merge is
compared with (x: decoder layer, y: the merge's hidden-state drift from that model, ‖h_M − h_P‖ / ‖h_P‖), both axes
labelled with their values, light grid lines at quarters of the largest value; a second panel of the localising
pass's departures (the values the verdict judges) with their threshold per layer, max(depart_factor × spread,
depart_floor), dashed; the layer a localisation names is a red bar; a legend names each line by its model's role
and short name.

Drawn on :mod:`resumerge.outputs.canvas` (the standard library only, so that a chart costs no plotting dependency).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.analyses.check.names import short_names
from resumerge.machine.durable import write_file_atomic
from resumerge.outputs.canvas import Canvas
from resumerge.outputs.glyphs import GLYPH_HEIGHT, text_width

if TYPE_CHECKING:
    from resumerge.analyses.check.report import CheckReport

WIDTH, HEIGHT, MARGIN = 720, 320, 24  # HEIGHT: the drift panel's figure without a legend (tests read it)
PANEL = 220  # a panel's plot area's height
_LEFT, _LINE = 64, 14  # the plot area's left edge (room for the values and the y label), a legend row's height
# Line colours, in the order of the models after the merge (the report names them in this order).
COLOURS: tuple[tuple[int, int, int], ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (148, 103, 189),
                                             (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34))
COLOUR_NAMES = ("blue", "orange", "green", "purple", "brown", "pink", "grey", "olive")
_GRID, _AXIS, _MARK = (225, 225, 225), (90, 90, 90), (214, 39, 40)
_TEXT, _LIMIT = (40, 40, 40), (120, 120, 120)


@dataclass(frozen=True)
class Panel:
    """One chart of the figure: its ``title``, its y axis's label, a series per model (a value per decoder layer)
    and, where the verdict holds those values to one, the ``threshold`` per layer (a dashed line)."""

    title: str
    y_label: str
    series: Sequence[Sequence[float]]
    threshold: Sequence[float] = ()


def drift_png(series: Sequence[Sequence[float]], broken_layer: int | None = None, *,
              labels: Sequence[str] = (), depart: Sequence[Sequence[float]] = (),
              threshold: Sequence[float] = ()) -> bytes:
    """The chart of ``series`` (one per compared model, a value per decoder layer) as PNG bytes: titled, its axes
    labelled with their values, a legend naming each line (``labels``, in the order of ``series``); with
    ``depart``, a second panel of the localising pass's departures and their ``threshold`` per layer (dashed)."""
    panels = [Panel("Drift of the merge's hidden states from each model", "drift", series)]
    if depart:
        panels.append(Panel("Departure on the same input (the verdict's; dashed: its threshold)", "departure",
                            depart, threshold))
    legend = [(COLOURS[i % len(COLOURS)], labels[i] if i < len(labels) else f"model {i + 2}")
              for i in range(len(series))]
    if threshold and depart:
        legend.append((_LIMIT, "threshold: max(depart_factor x spread, depart_floor)"))
    if broken_layer is not None:
        legend.append((_MARK, f"layer {broken_layer}: named by the localising pass"))
    height = len(panels) * (PANEL + 2 * MARGIN + 24) + 16 + _LINE * len(legend) + MARGIN
    canvas = Canvas(WIDTH, height)
    top = 8
    for panel in panels:
        _draw_panel(canvas, panel, top, broken_layer)
        top += PANEL + 2 * MARGIN + 24
    for number, (colour, label) in enumerate(legend):
        y = top + number * _LINE
        canvas.line(_LEFT, y + 3, _LEFT + 24, y + 3, colour, thick=2)
        canvas.text(_LEFT + 32, y, label, _TEXT)
    return canvas.png()


def _draw_panel(canvas: Canvas, panel: Panel, at: int, broken_layer: int | None) -> None:
    """One panel, its title at ``at`` (pixels from the top)."""
    canvas.text(_LEFT, at, panel.title, _TEXT)
    left, right, top, bottom = _LEFT, WIDTH - MARGIN, at + MARGIN, at + MARGIN + PANEL
    series = panel.series
    layers = max((len(s) for s in series), default=0)
    finite = [v for s in (*series, panel.threshold) for v in s if v == v and v != float("inf")]
    top_value = max(finite, default=0.0) or 1.0

    def x_of(layer: int) -> int:
        return left + (right - left) * layer // max(layers - 1, 1)

    def y_of(value: float) -> int:
        clipped = min(max(value, 0.0), top_value) if value == value else top_value  # NaN at the top
        return bottom - round((bottom - top) * clipped / top_value)

    for quarter in range(5):  # grid lines at quarters of the largest value, each labelled with its value
        y = bottom - (bottom - top) * quarter // 4
        if quarter:
            canvas.line(left, y, right, y, _GRID)
        value = f"{top_value * quarter / 4:.3g}"
        canvas.text(left - 6 - text_width(value), y - GLYPH_HEIGHT // 2, value, _TEXT)
    if broken_layer is not None and 0 <= broken_layer < layers:
        canvas.line(x_of(broken_layer), top, x_of(broken_layer), bottom, _MARK, thick=3)
    canvas.line(left, bottom, right, bottom, _AXIS)
    canvas.line(left, top, left, bottom, _AXIS)
    step = max(1, -(-(text_width(str(layers)) + 8) * max(layers - 1, 1) // max(right - left, 1)))
    for layer in range(layers):  # a tick per layer, a number as often as they fit
        canvas.line(x_of(layer), bottom, x_of(layer), bottom + 4, _AXIS)
        if layer % step == 0 or layer == layers - 1:
            label = str(layer)
            canvas.text(x_of(layer) - text_width(label) // 2, bottom + 7, label, _TEXT)
    x_label = "decoder layer (0-based)"
    canvas.text((left + right - text_width(x_label)) // 2, bottom + 18, x_label, _TEXT)
    canvas.text(8, (top + bottom + text_width(panel.y_label)) // 2, panel.y_label, _TEXT, vertical=True)
    if panel.threshold:
        limit = [(x_of(i), y_of(v)) for i, v in enumerate(panel.threshold)]
        for (x0, y0), (x1, y1) in itertools.pairwise(limit):
            for dash in range(0, max(x1 - x0, 1), 8):  # dashed: 4 pixels drawn, 4 left out
                xa, xb = x0 + dash, min(x0 + dash + 4, x1)
                canvas.line(xa, y0 + (y1 - y0) * (xa - x0) // max(x1 - x0, 1), xb,
                            y0 + (y1 - y0) * (xb - x0) // max(x1 - x0, 1), _LIMIT, thick=2)
    for number, values in enumerate(series):
        colour = COLOURS[number % len(COLOURS)]
        points = [(x_of(i), y_of(v)) for i, v in enumerate(values)]
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            canvas.line(x0, y0, x1, y1, colour, thick=2)
        for x, y in points:
            canvas.line(x - 2, y, x + 2, y, colour, thick=2)


def write_drift_chart(path: Path, report: CheckReport) -> Path:
    """Write the chart of ``report`` to ``path`` (atomically) and return it: each model after the merge by its
    role and short name (:mod:`.names`), the departures and their threshold where there is a reference."""
    others = report.models[1:]
    names = short_names([m.path for m in report.models])[1:]
    t = report.thresholds
    factor, floor = t.get("depart_factor", 0.0), t.get("depart_floor", 0.0)
    depart = [m.depart for m in others] if report.spread and any(any(m.depart) for m in others) else []
    write_file_atomic(path, drift_png([m.drift for m in others], report.broken_layer,
                                      labels=[f"{m.role} {name}" for m, name in zip(others, names)], depart=depart,
                                      threshold=[max(factor * s, floor) for s in report.spread] if depart else []))
    return path

"""evolve's objective.png: every line its legend names is visible (issue 87: the best of each generation, drawn
under the best so far where a generation improved on it, was named and nowhere to be seen)."""

from __future__ import annotations

from resumerge.runs.evolve.chart import _BEST, _BOTTOM, _LEFT, _MEDIAN, _SO_FAR, _SPREAD, _TOP, objective_png
from tests.check.test_chart import _pixels


def _plot(png: bytes) -> list[bytes]:
    """The rows of the plot area (between the title and the axis: not the legend), right of the y axis."""
    return [row[3 * (_LEFT + 1):] for row in _pixels(png)[_TOP:_BOTTOM]]


def test_each_line_the_legend_names_shows_in_the_plot_where_the_best_is_the_best_so_far() -> None:
    # each generation improves on the last: its best is the best so far, every generation
    generations = [[5.0 - g, 6.0 - g, 7.0 - g, 8.0 - g] for g in range(5)]
    rows = _plot(objective_png(generations))
    for colour in (_SO_FAR, _BEST, _MEDIAN, _SPREAD):
        assert any(bytes(colour) in row for row in rows), colour

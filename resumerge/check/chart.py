"""The per-layer drift chart of a check, a PNG beside its report: one line per model the merge is compared with
(x: decoder layer, y: the merge's hidden-state drift from that model, ‖h_M − h_P‖ / ‖h_P‖), on light grid lines at
quarters of the largest drift; the layer a localisation names is a red bar.

Written with the standard library only (zlib and a few chunks: PNG needs nothing more for an 8-bit RGB image),
so that a chart costs no plotting dependency; the report's table says which colour is which model and what the
top grid line is worth.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

from resumerge.store.durable import write_file_atomic

WIDTH, HEIGHT, MARGIN = 640, 320, 24
# Line colours, in the order of the models after the merge (the report names them in this order).
COLOURS: tuple[tuple[int, int, int], ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (148, 103, 189),
                                             (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34))
COLOUR_NAMES = ("blue", "orange", "green", "purple", "brown", "pink", "grey", "olive")
_GRID, _AXIS, _MARK = (225, 225, 225), (90, 90, 90), (214, 39, 40)


class _Canvas:
    """An RGB image held as one bytearray per row."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.rows = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]

    def dot(self, x: int, y: int, colour: tuple[int, int, int]) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            self.rows[y][3 * x:3 * x + 3] = bytes(colour)

    def line(self, x0: int, y0: int, x1: int, y1: int, colour: tuple[int, int, int], thick: int = 1) -> None:
        """Bresenham's line, ``thick`` pixels wide (a square brush)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        error = dx + dy
        while True:
            for ox in range(thick):
                for oy in range(thick):
                    self.dot(x0 + ox - thick // 2, y0 + oy - thick // 2, colour)
            if x0 == x1 and y0 == y1:
                return
            doubled = 2 * error
            if doubled >= dy:
                error, x0 = error + dy, x0 + sx
            if doubled <= dx:
                error, y0 = error + dx, y0 + sy

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(row) for row in self.rows)  # filter type 0 on every row

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))


def drift_png(series: Sequence[Sequence[float]], broken_layer: int | None = None) -> bytes:
    """The chart of ``series`` (one per compared model, a value per decoder layer) as PNG bytes."""
    canvas = _Canvas(WIDTH, HEIGHT)
    left, right, top, bottom = MARGIN, WIDTH - MARGIN, MARGIN, HEIGHT - MARGIN
    layers = max((len(s) for s in series), default=0)
    top_value = max((v for s in series for v in s if v == v and v != float("inf")), default=0.0) or 1.0

    def x_of(layer: int) -> int:
        return left + (right - left) * layer // max(layers - 1, 1)

    def y_of(value: float) -> int:
        clipped = min(max(value, 0.0), top_value) if value == value else top_value  # NaN at the top
        return bottom - round((bottom - top) * clipped / top_value)

    for quarter in range(1, 5):
        y = bottom - (bottom - top) * quarter // 4
        canvas.line(left, y, right, y, _GRID)
    if broken_layer is not None and 0 <= broken_layer < layers:
        canvas.line(x_of(broken_layer), top, x_of(broken_layer), bottom, _MARK, thick=3)
    canvas.line(left, bottom, right, bottom, _AXIS)
    canvas.line(left, top, left, bottom, _AXIS)
    for layer in range(layers):  # a tick per layer
        canvas.line(x_of(layer), bottom, x_of(layer), bottom + 4, _AXIS)
    for number, values in enumerate(series):
        colour = COLOURS[number % len(COLOURS)]
        points = [(x_of(i), y_of(v)) for i, v in enumerate(values)]
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            canvas.line(x0, y0, x1, y1, colour, thick=2)
        for x, y in points:
            canvas.line(x - 2, y, x + 2, y, colour, thick=2)
    return canvas.png()


def write_drift_chart(path: Path, series: Sequence[Sequence[float]], broken_layer: int | None) -> Path:
    """Write the chart to ``path`` (atomically) and return it."""
    write_file_atomic(path, drift_png(series, broken_layer))
    return path

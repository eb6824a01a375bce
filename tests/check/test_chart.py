"""The drift chart is a valid PNG (every chunk's CRC, the image's size) that draws each series in its colour and
the named layer as a red bar, with a title, labelled axes with their values, a legend naming each line, and the
departures' threshold dashed (issue 70, item 7)."""

from __future__ import annotations

import struct
import zlib

from resumerge.analyses.check.chart import _LIMIT, _TEXT, COLOURS, WIDTH, drift_png
from resumerge.outputs.canvas import Canvas
from resumerge.outputs.glyphs import GLYPH_HEIGHT, text_width


def _pixels(png: bytes) -> list[bytes]:
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    at, chunks = 8, {}
    while at < len(png):
        (size,) = struct.unpack(">I", png[at:at + 4])
        kind, data = png[at + 4:at + 8], png[at + 8:at + 8 + size]
        assert struct.unpack(">I", png[at + 8 + size:at + 12 + size])[0] == zlib.crc32(kind + data)
        chunks[kind] = data
        at += 12 + size
    width, height, depth, colour_type = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (width, depth, colour_type) == (WIDTH, 8, 2) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = 1 + 3 * width
    assert len(raw) == stride * height
    return [raw[r * stride + 1:(r + 1) * stride] for r in range(height)]


def _has(rows: list[bytes], colour: tuple[int, int, int]) -> bool:
    return any(bytes(colour) in row for row in rows)


def test_each_series_is_drawn_in_its_colour_and_the_named_layer_in_red() -> None:
    rows = _pixels(drift_png([[0.0, 0.1, 0.2, 0.3], [0.3, 0.2, 0.1, float("nan")]], broken_layer=2))
    assert _has(rows, COLOURS[0]) and _has(rows, COLOURS[1]) and not _has(rows, COLOURS[2])
    assert _has(rows, (214, 39, 40))
    assert not _has(_pixels(drift_png([[0.0, 0.1]], broken_layer=None)), (214, 39, 40))


def _text_rows(text: str) -> list[bytes]:
    canvas = Canvas(text_width(text), GLYPH_HEIGHT)
    canvas.text(0, 0, text, _TEXT)
    return [bytes(row) for row in canvas.rows]


def _holds(rows: list[bytes], part: list[bytes]) -> bool:
    """Whether the image ``rows`` hold the small image ``part`` somewhere (on a white background)."""
    for top in range(len(rows) - len(part) + 1):
        at = rows[top].find(part[0])
        while at >= 0:
            if at % 3 == 0 and all(rows[top + r][at:at + len(line)] == line for r, line in enumerate(part)):
                return True
            at = rows[top].find(part[0], at + 1)
    return False


def test_the_chart_is_titled_its_axes_labelled_and_its_lines_named() -> None:
    rows = _pixels(drift_png([[0.0, 0.1, 0.2, 0.4], [0.3, 0.2, 0.1, 0.0]], broken_layer=2,
                             labels=["parent chat-model", "parent code-model"],
                             depart=[[0.0, 0.1, 0.9, 0.2], [0.0, 0.2, 1.2, 0.1]], threshold=[0.25, 0.25, 0.5, 0.25]))
    for text in ("Drift of the merge's hidden states from each model", "decoder layer (0-based)", "0.4", "0.1",
                 "parent chat-model", "parent code-model", "Departure on the same input", "1.2", "3",
                 "threshold: max(depart_factor x spread, depart_floor)", "layer 2: named by the localising pass"):
        assert _holds(rows, _text_rows(text)), text
    assert _has(rows, _LIMIT)  # the threshold, dashed

"""The drift chart is a valid PNG (every chunk's CRC, the image's size) that draws each series in its colour and
the named layer as a red bar."""

from __future__ import annotations

import struct
import zlib

from resumerge.check.chart import COLOURS, HEIGHT, WIDTH, drift_png


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
    assert (width, height, depth, colour_type) == (WIDTH, HEIGHT, 8, 2) and b"IEND" in chunks
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

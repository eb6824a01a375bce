"""An RGB image drawn with the standard library only and written as a PNG (zlib and a few chunks: PNG needs
nothing more for an 8-bit RGB image; the text in a 5×7 bitmap font, :mod:`.glyphs`), so that a chart costs no
plotting dependency: the check's drift chart and evolve's objective per generation are drawn on it."""

from __future__ import annotations

import struct
import zlib

from resumerge.outputs.glyphs import ADVANCE, GLYPH_HEIGHT, glyph

__all__ = ["Canvas"]


class Canvas:
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

    def text(self, x: int, y: int, text: str, colour: tuple[int, int, int], vertical: bool = False) -> None:
        """``text`` in the 5×7 font (:mod:`.glyphs`), its top left at (x, y); ``vertical``: turned a quarter
        left, read from the bottom up, its bottom left at (x, y)."""
        for number, char in enumerate(text):
            for column, bits in enumerate(glyph(char)):
                for row in range(GLYPH_HEIGHT):
                    if not bits >> row & 1:
                        continue
                    along = number * ADVANCE + column
                    if vertical:
                        self.dot(x + row, y - along, colour)
                    else:
                        self.dot(x + along, y + row, colour)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(row) for row in self.rows)  # filter type 0 on every row

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))

"""Byte spans of an input file: overlapping or touching ones merged, so each byte is read (or kept) once."""

from __future__ import annotations

from collections.abc import Iterable


def merged_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` ([start, end) pairs) sorted, those that overlap or touch merged into one."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out

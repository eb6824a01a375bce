"""The header a plan was made from, held to the verified file: nothing read from the hub is trusted unchecked.

A hub input's header (a safetensors file's 8-byte length and JSON; a GGUF's header, key-values and tensor infos) is
read at plan time by HTTP Range, or from a cached copy that is checked only later, and every tensor's offset, dtype
and shape in the plan comes from it. The sha256 the hub lists covers the whole file, not that early read: a file
streamed whole is checked with the plan's header bytes fed to its digest
(:mod:`resumerge.inputs.hub.integrity`), but a file downloaded (or found in the cache) is checked as it is on disk, so
its header is compared here, once the file is verified, with the bytes the plan parsed. Only the header's own bytes
are read, at the start of the local file.
"""

from __future__ import annotations

from pathlib import Path

from resumerge.errors import RefusedError
from resumerge.inputs.gguf.header import GgufHeader
from resumerge.inputs.safetensors_format import Header


class HubHeaderChanged(RefusedError):
    """A hub input file verified against the hub's checksum does not start with the header bytes its plan was made
    from (exit 4): the hub served the header read by range (or a damaged cached copy held it) otherwise than the
    file. Nothing computed from the file is committed."""


def planned_bytes(header: Header | GgufHeader) -> bytes | None:
    """The bytes a file of ``header`` starts with, as the plan parsed them: a GGUF's header, or a safetensors
    file's 8-byte length and JSON header; None for a header that is not the file's first bytes (a pickle
    checkpoint's index, built from the verified file itself)."""
    if isinstance(header, GgufHeader):
        return header.raw
    if header.data_start != 8 + len(header.raw):
        return None
    return len(header.raw).to_bytes(8, "little") + header.raw


def known_prefix(header: Header | GgufHeader) -> bytes:
    """The file's first bytes as this process already holds them: :func:`planned_bytes`, and for a GGUF read by
    range the bytes its read brought along past the header (``read_ahead``); empty when there are none. A download
    starts from them instead of fetching them again (:func:`~resumerge.inputs.hub.download.download_blob`), and
    hashes them with the rest: the whole file's checksum covers them."""
    planned = planned_bytes(header)
    if planned is None:
        return b""
    return planned + header.read_ahead if isinstance(header, GgufHeader) else planned


def check_header(path: Path, header: Header | GgufHeader, where: str) -> None:
    """Raise :class:`HubHeaderChanged`, naming ``where``, unless the verified file at ``path`` starts with the bytes
    ``header`` was parsed from; reads those bytes only. Raises ``OSError`` for an unreadable file."""
    expected = planned_bytes(header)
    if expected is None:
        return
    with path.open("rb") as f:
        found = f.read(len(expected))
    if found == expected:
        return
    at = next((i for i, (a, b) in enumerate(zip(found, expected)) if a != b), min(len(found), len(expected)))
    raise HubHeaderChanged(
        "the file, verified against the hub's checksum, does not start with the header this run was planned from "
        f"(read by range, or from a cached copy, before the file was verified): they differ at byte {at}; nothing "
        "merged from it was committed",
        path=where, hint="run the same command again: it plans from the verified file, now in the hub cache (add "
                         "--restart if it refuses OUT's earlier plan)")


def known_bytes(header: Header | GgufHeader) -> tuple[list[tuple[int, int]], list[tuple[int, bytes]]] | None:
    """(the tensor spans of a file, merged, and the bytes known without streaming them, each at its offset): the
    file is checked whole against the hub's checksum when a run streams exactly those spans. A safetensors file:
    its 8-byte length and header before one span (None for a file with bytes between the header and the data).
    A GGUF: its header and padding (``data_start`` is aligned), then its tensors, each padded with zeros to the
    alignment (``gguf.md`` §1): the zeros are assumed, and a file whose padding is not zero fails the check."""
    planned = planned_bytes(header)
    if planned is None:
        return None
    if isinstance(header, Header):
        return [(header.data_start, header.file_size)], [(0, planned)]
    spans: list[tuple[int, int]] = []
    for tensor in sorted(header.tensors, key=lambda t: t.start):
        if tensor.end == tensor.start:
            continue
        if spans and tensor.start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], tensor.end))
        else:
            spans.append((tensor.start, tensor.end))
    known: list[tuple[int, bytes]] = [(0, planned)]
    edges = [len(header.raw), *(edge for span in spans for edge in span), header.file_size]
    known += [(start, bytes(end - start)) for start, end in zip(edges[::2], edges[1::2]) if end > start]
    return spans, known

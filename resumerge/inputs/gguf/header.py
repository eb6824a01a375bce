"""A GGUF file's header: its key-value metadata and tensor infos, parsed without gguf-py's reader.

gguf-py's ``GGUFReader`` turns every array element into a Python object (seconds for a 262k-token vocabulary,
``gguf.md`` §5); this parser walks strings by their length and reads numeric arrays as one numpy view. A GGUF is
data from the internet: every count, length and offset is checked against the file before it is used, and a
file that breaks the layout (``gguf.md`` §1: offsets in info order, no gaps, aligned) is refused in one line.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np

from resumerge.errors import HostileFileError, ModelInputError

MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# ggml numbers its tensor types from 0 and has about 40 (gguf.md §1): a type field past this holds no type any ggml
# could have written (a flipped high bit, a shifted header), where a small unknown id may be a type newer than the
# gguf package.
_TYPE_IDS = 1 << 8
MAX_STEP = 1 << 20  # the most bytes one request of a header read by range asks beyond what the parse needs
# value type -> (struct format, numpy dtype) of the fixed-size scalars (gguf.md §1).
_SCALARS: Mapping[int, tuple[str, str]] = MappingProxyType({
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"), 5: ("<i", "<i4"),
    6: ("<f", "<f4"), 7: ("<?", "<u1"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
})


@dataclass(frozen=True)
class GgufTensor:
    """One tensor info: its GGUF name, ``ne`` (innermost first, as stored), ggml type id and absolute byte range."""

    name: str
    ne: tuple[int, ...]
    ggml_type: int
    start: int
    end: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy (torch) shape: ``ne`` reversed."""
        return tuple(reversed(self.ne))


@dataclass(frozen=True)
class GgufHeader:
    """A parsed GGUF file: metadata (strings as ``str``, numeric arrays as numpy arrays, string arrays as lists),
    tensors in info order, the raw header bytes (the file's identity hashes them) and the file size."""

    metadata: dict[str, Any]
    tensors: tuple[GgufTensor, ...]
    raw: bytes
    file_size: int
    # Each key's value type and, for an array, its element type (None otherwise): a key copied to an output GGUF
    # keeps its type.
    kinds: dict[str, tuple[int, int | None]]
    kv_end: int = 0  # where the key-values end (the tensor infos start): see :func:`metadata_only`
    # Bytes past the header that a read by range fetched with it (from ``len(raw)`` on): a streamed run reads them
    # here instead of fetching them again.
    read_ahead: bytes = field(default=b"", repr=False)


def is_gguf(path: Path) -> bool:
    """Whether the file at ``path`` starts with GGUF's magic."""
    with path.open("rb") as file:
        return file.read(len(MAGIC)) == MAGIC


def read_gguf_header(path: Path, sizes: Mapping[int, tuple[int, int]]) -> GgufHeader:
    """Parse the header of the GGUF at ``path``; ``sizes`` maps each ggml type id it may hold to (elements, bytes)
    per block (gguf-py's ``GGML_QUANT_SIZES``). Raises :class:`HostileFileError` for a file that breaks the layout,
    :class:`ModelInputError` for a version or byte order resumerge does not read."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
        return _Parser(view, str(path)).header(sizes)


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """The key-value metadata of the GGUF at ``path``, its tensor infos unread (so a tensor of any type is no
    refusal: what a file is, asked before it is read as one kind). Raises as :func:`read_gguf_header`."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
        return _Parser(view, str(path)).key_values()[1]


def parse_gguf_header(read: Callable[[int, int], bytes], file_size: int, where: str,
                      sizes: Mapping[int, tuple[int, int]], first: int = 64 << 10) -> GgufHeader:
    """Parse the header of a ``file_size``-byte GGUF whose bytes ``[start, end)`` ``read(start, end)`` returns (a
    hub file read by HTTP Range): the header is variable-length, so a first ``first`` bytes are read, then more
    (doubling, at most :data:`MAX_STEP` a request) only while the parse runs past them. What is read past the
    header's end is thus under ``first`` or :data:`MAX_STEP`, and kept (``read_ahead``) for the tensors it holds.
    ``where`` names the file in errors. Raises as :func:`read_gguf_header`."""
    prefix = _Prefix(read, file_size, first)
    header = _Parser(prefix, where).header(sizes)
    return replace(header, read_ahead=prefix.data[len(header.raw):])


def metadata_only(header: GgufHeader, without: tuple[str, ...] = ()) -> bytes:
    """A GGUF holding ``header``'s key-values byte for byte, but those whose key starts with one of ``without``, and
    no tensor: what a reader of the metadata alone (transformers' GGUF tokenizer) is given, whether the file is on
    disk or not (a hub GGUF read by range)."""
    alignment = header.metadata.get("general.alignment", _ALIGNMENT)
    parser, kept = _Parser(header.raw, "a parsed GGUF header"), []
    parser.at = 24  # past the magic, the version and the two counts
    for _ in header.metadata:
        start = parser.at
        key = parser.string()
        parser.value(parser.scalar(4))
        if not key.startswith(without):
            kept.append(header.raw[start:parser.at])
    head = header.raw[:8] + struct.pack("<QQ", 0, len(kept)) + b"".join(kept)  # no tensor
    return head + bytes(-len(head) % alignment)


class _View(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, where: slice) -> bytes: ...


class _Prefix:
    """A file's bytes as the parser sees them (its length is the file's), fetched as a growing prefix."""

    def __init__(self, read: Callable[[int, int], bytes], size: int, first: int) -> None:
        self.read, self.size, self.first, self.data = read, size, first, b""

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, where: slice) -> bytes:
        start, stop = where.start or 0, where.stop
        if stop > len(self.data):
            want = min(self.size, max(stop, len(self.data) + min(MAX_STEP, max(len(self.data), self.first))))
            more = bytes(self.read(len(self.data), want))
            if len(more) != want - len(self.data):
                raise ModelInputError(f"asked bytes {len(self.data)}-{want} of a GGUF, got {len(more)}")
            self.data += more
        return self.data[start:stop]


class _Parser:
    def __init__(self, view: mmap.mmap | _View, where: str) -> None:
        self.view, self.where, self.at = view, where, 0
        self.sub: int | None = None  # the element type of the array value() read last

    def bad(self, what: str) -> HostileFileError:
        return HostileFileError(f"not a readable GGUF file: {what}", path=self.where,
                                hint="download it again; a GGUF must be whole and little-endian")

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.view):
            raise self.bad(f"it ends inside its header (byte {self.at} + {n} of {len(self.view)})")
        data = self.view[self.at:self.at + n]
        self.at += n
        return data

    def scalar(self, kind: int) -> Any:
        fmt = _SCALARS[kind][0]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.scalar(10))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.bad(f"a string that is not UTF-8 at byte {self.at - len(raw)}") from None

    def value(self, kind: int) -> Any:
        self.sub = None
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.scalar(kind)
        if kind != _ARRAY:
            raise self.bad(f"unknown value type {kind}")
        inner, count = self.scalar(4), self.scalar(10)
        self.sub = inner
        if inner == _STRING:
            if count > len(self.view):  # each string takes 8 bytes at least: an absurd count is a lie
                raise self.bad(f"an array of {count} strings")
            return [self.string() for _ in range(count)]
        if inner not in _SCALARS:
            raise self.bad(f"an array of value type {inner}")
        dtype = np.dtype(_SCALARS[inner][1])
        data = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)
        return data.astype(bool) if inner == 7 else data

    def key_values(self) -> tuple[int, dict[str, Any], dict[str, tuple[int, int | None]]]:
        """The tensor count, the metadata and each key's value kind: the header up to its tensor infos."""
        if self.take(4) != MAGIC:
            raise self.bad("it does not start with GGUF's magic")
        version = self.scalar(4)
        if version & 0xFFFF == 0:
            raise ModelInputError("a big-endian GGUF, which resumerge does not read", path=self.where,
                                  hint="convert it to a little-endian GGUF (llama.cpp's gguf tools)")
        if version not in _VERSIONS:
            raise ModelInputError(f"GGUF version {version}, which resumerge does not read (it reads 2 and 3)",
                                  path=self.where, hint="convert it with a current llama.cpp")
        n_tensors, n_kv = self.scalar(10), self.scalar(10)
        if n_tensors > len(self.view) or n_kv > len(self.view):
            raise self.bad(f"{n_tensors} tensors and {n_kv} keys in a file of {len(self.view)} bytes")
        metadata: dict[str, Any] = {}
        kinds: dict[str, tuple[int, int | None]] = {}
        for _ in range(n_kv):
            key = self.string()
            kind = self.scalar(4)
            metadata[key] = self.value(kind)
            kinds[key] = (kind, self.sub)
        return n_tensors, metadata, kinds

    def header(self, sizes: Mapping[int, tuple[int, int]]) -> GgufHeader:
        n_tensors, metadata, kinds = self.key_values()
        kv_end = self.at
        infos = []
        for _ in range(n_tensors):
            name = self.string()
            n_dims = self.scalar(4)
            if not 1 <= n_dims <= 4:
                raise self.bad(f"tensor {name!r} has {n_dims} dimensions")
            ne = tuple(self.scalar(10) for _ in range(n_dims))
            infos.append((name, ne, self.scalar(4), self.scalar(10)))
        alignment = metadata.get("general.alignment", _ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise self.bad(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-self.at // alignment) * alignment
        tensors, expected = [], 0
        for name, ne, kind, offset in infos:
            if kind not in sizes and kind >= _TYPE_IDS:
                raise self.bad(f"tensor {name!r} has the type field {kind}, which is no ggml type (it is damaged)")
            if kind not in sizes:
                raise ModelInputError(f"tensor {name} is stored as ggml type {kind}, which this gguf package "
                                      "cannot decode", path=self.where, tensor=name,
                                      hint="re-quantize it to a common type (Q8_0, Q4_K...) with llama-quantize")
            block, type_size = sizes[kind]
            if ne[0] % block:
                raise self.bad(f"tensor {name!r} has rows of {ne[0]} values, not whole blocks of {block}")
            nbytes = int(np.prod(ne, dtype=object)) // block * type_size
            if offset != expected:
                raise self.bad(f"tensor {name!r} at offset {offset}, expected {expected}")
            start = data_start + offset
            if start + nbytes > len(self.view):
                raise self.bad(f"tensor {name!r} ends past the end of the file")
            tensors.append(GgufTensor(name, ne, kind, start, start + nbytes))
            expected = offset + -(-nbytes // alignment) * alignment
        return GgufHeader(metadata, tuple(tensors), bytes(self.view[:data_start]), len(self.view), kinds, kv_end)

"""The safetensors file format, without torch: strict header parsing and byte-exact layout for writing.

Reading validates everything a hostile file could lie about (header length, JSON, dtypes, shapes, offsets that
overlap, leave gaps or run past the file) before a single tensor byte is touched. Writing reproduces the layout
of ``safetensors.torch.save_file`` exactly — data ordered by safetensors' dtype order (descending) then name,
compact JSON header with ``__metadata__`` first, padded with spaces to a multiple of 8 — so a shard's bytes
depend only on its tensor set and equal what safetensors (and so mergekit) would write.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from operator import itemgetter
from types import MappingProxyType
from typing import NamedTuple

from resumerge.errors import HostileFileError

# Largest header safetensors itself accepts; anything bigger is refused before allocating it.
MAX_HEADER_BYTES = 100_000_000
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

# dtype name -> element size in bytes (sub-byte float formats are not supported as merge inputs).
DTYPE_SIZES: Mapping[str, int] = MappingProxyType({
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
})


# safetensors sorts tensor data by its Rust ``Dtype`` enum, descending, then by name. The enum is declared in
# ascending order of element size, so this also keeps every tensor aligned to its element size.
DTYPE_RANK: Mapping[str, int] = MappingProxyType({
    name: rank
    for rank, name in enumerate(
        ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64",
         "I64", "U64"]
    )
})


class TensorEntry(NamedTuple):
    """One tensor of a safetensors file: dtype name, shape, and absolute byte range in the file. A tuple: a
    checkpoint's headers make 92k of them, at a fifth of a frozen dataclass's cost each."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    """A parsed safetensors header: tensors by name, the metadata map, and the header's own bytes."""

    tensors: Mapping[str, TensorEntry]
    metadata: Mapping[str, str]
    data_start: int
    file_size: int
    raw: bytes


# Data order: by start, then end (an empty tensor before a tensor at its place), then name.
_BY_RANGE = itemgetter(3, 4, 0)
# TensorEntry's own constructor without its Python-level __new__ (92k entries a checkpoint).
_new_entry = partial(tuple.__new__, TensorEntry)


def numel(shape: tuple[int, ...]) -> int:
    """Number of elements of ``shape`` (1 for a scalar)."""
    n = 1
    for d in shape:
        n *= d
    return n


def read_header(path: str | os.PathLike[str], *, parsed: dict[tuple[bytes, int], Header] | None = None) -> Header:
    """Parse and validate the header of the safetensors file at ``path``. ``parsed`` holds the headers parsed
    before, by their bytes and their file's size: a file whose header and size are one of them (a shard of another
    fine-tune of the same base, saved the same way) gets that header, valid for it too, without a second parse.

    Raises :class:`HostileFileError` for a header length that is absurd or past the file, non-JSON or non-object
    headers, unknown dtypes, negative or non-integer shapes, offsets whose size disagrees with dtype × shape,
    and tensors that overlap, leave gaps or do not cover the data region exactly (truncated files).
    """
    where = os.fspath(path)
    with open(where, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise HostileFileError("file is too short to be safetensors (no 8-byte header length)", path=where)
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise HostileFileError(
                f"safetensors header length {length} is larger than the file allows ({size} bytes)",
                path=where,
                hint="the file is truncated or not safetensors; re-download or regenerate it",
            )
        raw = f.read(length)
    if parsed is None:
        return parse_header(raw, file_size=size, path=where)
    found = parsed.get((raw, size))
    if found is None:
        found = parsed[(raw, size)] = parse_header(raw, file_size=size, path=where)
    return found


def parse_header(raw: bytes, *, file_size: int, path: str = "") -> Header:
    """Validate header bytes ``raw`` of a file of ``file_size`` bytes; see :func:`read_header`."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # deep nesting: RecursionError
        raise HostileFileError(f"safetensors header is not valid JSON ({exc})", path=path) from None
    if not isinstance(doc, dict):
        raise HostileFileError("safetensors header is not a JSON object", path=path)
    data_start = 8 + len(raw)
    metadata_doc = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata_doc, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata_doc.items()
    ):
        raise HostileFileError("safetensors __metadata__ must map strings to strings", path=path)
    if "" in doc or _CONTROL.search("".join(doc)):  # every name at once; then the one to blame
        for name in doc:
            _check_name(name, path)
    entries = {name: _plain_entry(name, info, data_start) or _entry(name, info, data_start, path)
               for name, info in doc.items()}
    cursor = data_start
    for name, _, _, start, end in sorted(entries.values(), key=_BY_RANGE):
        if start != cursor:
            kind = "overlaps another tensor" if start < cursor else "leaves a gap before it"
            raise HostileFileError(f"tensor {name!r} {kind} in the data region", path=path, tensor=name)
        cursor = end
    if cursor != file_size:
        raise HostileFileError(
            f"tensor data covers {cursor - data_start} bytes but the file holds {file_size - data_start}",
            path=path,
            hint="the file is truncated or padded; re-download or regenerate it",
        )
    return Header(tensors=entries, metadata=dict(metadata_doc), data_start=data_start, file_size=file_size, raw=raw)


def _check_name(name: str, path: str) -> None:
    if not name or _CONTROL.search(name):
        # A NUL, newline or escape in a name would smuggle extra lines into logs and error messages.
        raise HostileFileError(f"tensor name {name!r} is empty or contains a control character (NUL, newline, ...)",
                               path=path)


def _plain_entry(name: str, info: object, data_start: int) -> TensorEntry | None:
    """The entry of tensor ``name`` when ``info`` is plainly valid (the dict every writer makes, checked with exact
    types in one pass: 92k entries a checkpoint), else None, and :func:`_entry` says what is wrong with it."""
    if type(info) is not dict:
        return None
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if type(dtype) is not str or type(shape) is not list or type(offsets) is not list or len(offsets) != 2:
        return None
    count = DTYPE_SIZES.get(dtype)
    if count is None:
        return None
    for d in shape:
        if type(d) is not int or d < 0:
            return None
        count *= d
    start, end = offsets
    if type(start) is not int or type(end) is not int or not 0 <= start <= end or end - start != count:
        return None
    return _new_entry((name, dtype, tuple(shape), data_start + start, data_start + end))


def _entry(name: str, info: object, data_start: int, path: str) -> TensorEntry:
    """The entry of tensor ``name`` (already checked by :func:`_check_name`) described by ``info``."""
    if not isinstance(info, dict):
        raise HostileFileError(f"tensor {name!r}: entry is not an object", path=path, tensor=name)
    dtype = info.get("dtype")
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise HostileFileError(f"tensor {name!r}: unsupported dtype {dtype!r}", path=path, tensor=name)
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise HostileFileError(f"tensor {name!r}: shape must be a list of non-negative ints", path=path, tensor=name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise HostileFileError(f"tensor {name!r}: data_offsets must be two ordered ints", path=path, tensor=name)
    expected = numel(tuple(shape)) * DTYPE_SIZES[str(dtype)]
    if offsets[1] - offsets[0] != expected:
        raise HostileFileError(
            f"tensor {name!r}: {offsets[1] - offsets[0]} bytes stored but dtype and shape need {expected}",
            path=path,
            tensor=name,
        )
    return TensorEntry(name, str(dtype), tuple(shape), data_start + offsets[0], data_start + offsets[1])


@dataclass(frozen=True)
class PlannedTensor:
    """Where one tensor goes in a shard being written: byte range relative to the data region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ShardLayout:
    """The complete byte layout of a shard: header bytes, then tensors in ``order`` at their offsets."""

    header: bytes
    order: tuple[PlannedTensor, ...]
    # The finished file's size when its tensors are padded (a GGUF: zeros between and after them); 0: they are
    # packed, as safetensors packs them.
    size: int = 0

    @property
    def data_bytes(self) -> int:
        """Total size of the tensor data region."""
        return sum(t.nbytes for t in self.order)

    @property
    def file_size(self) -> int:
        """Size of the finished file."""
        return self.size or len(self.header) + self.data_bytes


def layout_shard(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]], metadata: Mapping[str, str] | None = None
) -> ShardLayout:
    """Lay out ``tensors`` (name -> (dtype, shape)) exactly as ``safetensors.torch.save_file`` would.

    Returns the full header (8-byte length + padded JSON) and the data order with offsets.
    """
    names, header, _ = _laid_out(tensors, metadata)
    order: list[PlannedTensor] = []
    offset = 0
    for name in names:
        dtype, shape = tensors[name]
        nbytes = numel(shape) * DTYPE_SIZES[dtype]
        order.append(PlannedTensor(name, dtype, shape, offset, nbytes))
        offset += nbytes
    return ShardLayout(header=header, order=tuple(order))


def shard_extent(tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> tuple[list[str], int]:
    """The names of ``tensors`` in the data order :func:`layout_shard` gives them and the size of the file it lays
    out, without its per-tensor records (a plan's 92k tensors are laid out once to size their shards)."""
    names, header, data_bytes = _laid_out(tensors, None)
    return names, len(header) + data_bytes


def _laid_out(tensors: Mapping[str, tuple[str, tuple[int, ...]]], metadata: Mapping[str, str] | None
              ) -> tuple[list[str], bytes, int]:
    """:func:`layout_shard`'s data order, header and data bytes. The header is ``json.dumps`` of the metadata and
    each tensor's entry in that order, compact and not ASCII-escaped, written entry by entry as json joins them
    (shapes and offsets are ints: their JSON is their ``str``)."""
    meta = {"format": "pt"} if metadata is None else dict(metadata)
    keyed = sorted([(-DTYPE_RANK[dtype], name) for name, (dtype, _) in tensors.items()])
    entries = [_JSON_STR("__metadata__") + ":" + json.dumps(meta, separators=(",", ":"), ensure_ascii=False)
               ] if meta else []
    offset = 0
    for _, name in keyed:
        dtype, shape = tensors[name]
        end = offset + numel(shape) * DTYPE_SIZES[dtype]
        entries.append(f'{_JSON_STR(name)}:{{"dtype":{_JSON_STR(dtype)},"shape":[{",".join(map(str, shape))}],'
                       f'"data_offsets":[{offset},{end}]}}')
        offset = end
    text = ("{" + ",".join(entries) + "}").encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    return [name for _, name in keyed], struct.pack("<Q", len(text)) + text, offset


_JSON_STR = json.encoder.encode_basestring  # how json.dumps writes a string with ensure_ascii=False

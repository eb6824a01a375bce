"""llama.cpp's importance matrix files (``--imatrix``) read as llama-quantize applies them (``shared/reference/
kquants.md`` §4): each entry becomes the per-column weights the quantizer is given, one slice of ``n_in`` values per
expert.

- GGUF (llama-imatrix's default since 2025): ``general.type = "imatrix"`` with ``imatrix.datasets``,
  ``imatrix.chunk_count`` and ``imatrix.chunk_size`` (a file without them is refused, as llama-quantize refuses it);
  per weight ``<name>.in_sum2`` F32 ``[n_in, n_mat]`` (sums of squared inputs) and ``<name>.counts`` F32 ``[1,
  n_mat]``. Expert j's weights are ``in_sum2[j] / round(count_j)``, all 1 where the count is 0.
- The older ``.dat``: i32 entry count; per entry i32 name length, the name, i32 ``ncall``, i32 value count, f32
  values (already means times ``ncall``); the weights are the values over ``ncall`` (as they are where it is 0).

Values that are not finite are refused, as llama-quantize refuses them. :func:`imatrix_bytes` writes the GGUF form
(``resumerge measure --imatrix``, and the matrix a merge computes on itself), as llama-imatrix writes it;
:func:`imatrix_dat_bytes` the ``.dat`` form (``measure --imatrix OUT.dat``), as ``llama-imatrix --output-format dat``
writes it: an entry with no count at all left out, an expert with none stored as 1 (llama.cpp's "partial data"),
then the chunk count and the dataset's name.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from resumerge.errors import ModelInputError
from resumerge.inputs.gguf.ggmltypes import F32, TYPES

__all__ = ["ImatrixEntry", "computed_counts", "entry", "entry_rows", "imatrix_bytes", "imatrix_dat_bytes",
           "read_imatrix", "with_counts"]

# the one tensor type of an importance matrix's GGUF -> its block (the header parser's sizes)
_F32_ONLY = MappingProxyType({F32: TYPES[F32].block})
_REQUIRED = ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size")


def _refused(path: Path, why: str, hint: str = "give the importance matrix llama-imatrix wrote for this model "
                                                 "(GGUF or .dat)") -> ModelInputError:
    return ModelInputError(f"--imatrix {path}: {why}", hint=hint)


def _from_gguf(path: Path, only: str | None) -> dict[str, np.ndarray]:
    from resumerge.inputs.gguf.header import read_gguf_header, read_gguf_metadata

    # What the file is, judged from its key-values before its tensor infos are read: a model's F16 or quantized
    # tensors would be refused as types an importance matrix (F32) never holds
    metadata = read_gguf_metadata(path)
    arch = metadata.get("general.architecture")
    if metadata.get("general.type") != "imatrix" and (arch is not None or metadata.get("general.type") == "model"):
        raise _refused(path, f"it is a model GGUF{f' ({arch})' if arch else ''}, not an importance matrix",
                       hint="llama-imatrix -m MODEL.gguf -f TEXTS writes one; or give --imatrix-texts TEXTS to "
                            "compute it on the merge itself")
    missing = [key for key in _REQUIRED if key not in metadata]
    if metadata.get("general.type") != "imatrix" or missing:
        lacking = f"; missing {', '.join(missing)}" if missing else ""
        raise _refused(path, f"not an importance matrix GGUF (general.type \"imatrix\" and {', '.join(_REQUIRED)} "
                             f"are needed{lacking})")
    header = read_gguf_header(path, _F32_ONLY)
    tensors = {t.name: t for t in header.tensors}
    entries: dict[str, np.ndarray] = {}
    with path.open("rb") as file:
        def values(name: str) -> np.ndarray:
            t = tensors[name]
            if t.ggml_type != F32:
                raise _refused(path, f"tensor {name} is not F32")
            file.seek(t.start)
            return np.frombuffer(file.read(t.end - t.start), dtype="<f4").reshape(t.shape)

        for name in sorted(tensors):
            if not name.endswith(".in_sum2") or (only is not None and name != f"{only}.in_sum2"):
                continue
            weight = name.removesuffix(".in_sum2")
            if f"{weight}.counts" not in tensors:
                raise _refused(path, f"{name} has no {weight}.counts")
            sums, counts = values(name), values(f"{weight}.counts").reshape(-1)
            if sums.ndim != 2 or sums.shape[0] != counts.size:
                raise _refused(path, f"{name} has {sums.shape} sums for {counts.size} counts")
            rounded = np.array([math.copysign(math.floor(abs(c) + 0.5), c) for c in counts.tolist()],
                               dtype=np.float32)  # lround: half away from zero
            per = np.where(rounded[:, None] == 0, np.float32(1), sums / np.where(rounded == 0, 1, rounded)[:, None])
            entries[weight] = np.ascontiguousarray(per, dtype=np.float32).reshape(-1)
    return entries


def _from_dat(path: Path, only: str | None) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    at = 0

    def take(fmt: str) -> tuple[int, ...]:
        nonlocal at
        size = struct.calcsize(fmt)
        if at + size > len(data):
            raise _refused(path, "the file ends inside an entry (neither a GGUF nor a .dat importance matrix)")
        found = struct.unpack_from(fmt, data, at)
        at += size
        return found

    (count,) = take("<i")
    if count <= 0:
        raise _refused(path, "it holds no entries")
    entries: dict[str, np.ndarray] = {}
    for _ in range(count):
        (length,) = take("<i")
        if length <= 0 or at + length > len(data):
            raise _refused(path, "an entry's name runs past the file (neither a GGUF nor a .dat importance matrix)")
        name = data[at:at + length].decode("utf-8", errors="replace")
        at += length
        ncall, nval = take("<ii")
        if nval <= 0 or at + 4 * nval > len(data):
            raise _refused(path, f"entry {name}'s {nval} values run past the file")
        if only is not None and name != only:
            at += 4 * nval
            continue
        values = np.frombuffer(data, dtype="<f4", count=nval, offset=at).astype(np.float32)
        at += 4 * nval
        entries[name] = values / np.float32(ncall) if ncall > 0 else values
    return entries


def read_imatrix(path: str | Path, only: str | None = None) -> dict[str, np.ndarray]:
    """Every entry of the importance matrix file at ``path`` (``only``: that one, if the file has it), by weight
    name (a GGUF tensor name): float32 ``n_in * n_mat`` weights, expert j's at ``[j*n_in, (j+1)*n_in)``. Raises
    :class:`ModelInputError` (one line, exit 2) for a file that is not one, or holds values that are not finite."""
    path = Path(path)
    with path.open("rb") as file:
        magic = file.read(4)
    entries = _from_gguf(path, only) if magic == b"GGUF" else _from_dat(path, only)
    for name, values in entries.items():
        if not np.isfinite(values).all():
            raise _refused(path, f"entry {name} holds values that are not finite")
    return entries


def matrix_facts(path: str | Path, entries: Mapping[str, np.ndarray]) -> tuple[str | None, int]:
    """The dataset the importance matrix at ``path`` (whose entries :func:`read_imatrix` read as ``entries``) was
    measured on (GGUF: the first of ``imatrix.datasets``; ``.dat``: the name after its entries; None where it
    names none) and its chunk count (0 where it has none), as llama-quantize's ``load_imatrix`` reads them."""
    from resumerge.inputs.gguf.header import read_gguf_header

    path = Path(path)
    with path.open("rb") as file:
        magic = file.read(4)
    if magic == b"GGUF":
        metadata = read_gguf_header(path, _F32_ONLY).metadata
        named = metadata.get("imatrix.datasets")
        datasets = [] if named is None else list(named)
        return (str(datasets[0]) if datasets else None), int(metadata.get("imatrix.chunk_count", 0))
    data = path.read_bytes()
    at = 4 + sum(12 + len(name.encode()) + 4 * values.size for name, values in entries.items())
    if at + 8 > len(data):
        return None, 0
    chunks, length = struct.unpack_from("<ii", data, at)
    dataset = data[at + 8:at + 8 + max(length, 0)].decode("utf-8", errors="replace")
    return dataset, max(chunks, 0)


def computed_counts(path: str) -> tuple[int, int] | None:
    """The texts (``imatrix.chunk_count``) and tokens (the largest count) of the GGUF importance matrix at ``path``
    that resumerge wrote; None where there is none (not computed yet)."""
    from resumerge.inputs.gguf.header import read_gguf_header

    if not Path(path).is_file():
        return None
    header = read_gguf_header(Path(path), _F32_ONLY)
    counts = [name for name in (t.name for t in header.tensors) if name.endswith(".counts")]
    tokens = 0
    with Path(path).open("rb") as file:
        for t in header.tensors:
            if t.name in counts:
                file.seek(t.start)
                tokens = max(tokens, int(np.frombuffer(file.read(t.end - t.start), dtype="<f4").max(initial=0)))
    return int(header.metadata.get("imatrix.chunk_count", 0)), tokens


def with_counts(header: bytes, path: str) -> bytes:
    """A planned GGUF ``header`` with the ``quantize.imatrix.entries_count`` and ``.chunks_count`` llama-quantize
    writes for the GGUF importance matrix at ``path`` that resumerge computed on the merge (its entries, its
    ``imatrix.chunk_count``); ``header`` as planned where the matrix is not there yet (a layout's sizes only: the
    values are U32s, nothing moves) or the header holds no such key (a split file after the first)."""
    from resumerge.inputs.gguf.header import read_gguf_header
    from resumerge.outputs.gguf.layout import with_u32

    if not Path(path).is_file():
        return header
    matrix = read_gguf_header(Path(path), _F32_ONLY)
    entries = sum(1 for t in matrix.tensors if t.name.endswith(".in_sum2"))
    header = with_u32(header, "quantize.imatrix.entries_count", entries)
    return with_u32(header, "quantize.imatrix.chunks_count", int(matrix.metadata.get("imatrix.chunk_count", 0)))


def entry(path: str, name: str, expert: int, columns: int) -> np.ndarray | None:
    """The quantizer's weights for GGUF tensor ``name`` (expert ``expert``'s slice of it, -1: the whole entry) of
    rows of ``columns`` values, from the importance matrix at ``path``; None where the file has no entry for it
    (llama-quantize quantizes such a tensor without one)."""
    found = read_imatrix(path, name).get(name)
    if found is None:
        return None
    first = max(expert, 0) * columns
    return found[first:first + columns]


def entry_rows(path: str, name: str, columns: int) -> np.ndarray | None:
    """Every slice of GGUF tensor ``name``'s entry in the importance matrix at ``path``, as rows of ``columns``
    weights ([n_mat, columns]: expert e's is row e); None where the file has no entry for it."""
    found = read_imatrix(path, name).get(name)
    return None if found is None else found.reshape(-1, columns)


@dataclass(frozen=True)
class ImatrixEntry:
    """One weight's entry as llama-imatrix accumulates it: ``sums`` float32 ``[n_mat, n_in]`` (each expert's, or the
    one matrix's, sums of squared inputs) and ``counts`` float32 ``[n_mat]`` (the rows each slice summed)."""

    sums: np.ndarray
    counts: np.ndarray


def imatrix_bytes(entries: Mapping[str, ImatrixEntry], datasets: Sequence[str], chunk_count: int,
                  chunk_size: int) -> bytes:
    """The GGUF importance matrix llama-imatrix writes (``kquants.md`` §4) of ``entries`` (by GGUF weight name):
    ``general.type = "imatrix"``, ``imatrix.datasets``, ``imatrix.chunk_count``, ``imatrix.chunk_size``, then per
    weight, names sorted, ``<name>.in_sum2`` F32 ``[n_mat, n_in]`` and ``<name>.counts`` F32 ``[n_mat, 1]``; every
    tensor padded to 32 bytes, as gguf-py pads them."""
    from resumerge.outputs.gguf.layout import ARRAY, STRING, U32, TensorInfo, Value, pad, plan_layout

    metadata = [("general.type", Value(STRING, "imatrix")),
                ("imatrix.datasets", Value(ARRAY, list(datasets), STRING)),
                ("imatrix.chunk_count", Value(U32, chunk_count)), ("imatrix.chunk_size", Value(U32, chunk_size))]
    data: list[np.ndarray] = []
    infos = []
    for name in sorted(entries):
        found = entries[name]
        sums = np.ascontiguousarray(found.sums, dtype="<f4")
        counts = np.ascontiguousarray(found.counts, dtype="<f4").reshape(-1, 1)
        if sums.ndim != 2 or sums.shape[0] != counts.shape[0]:
            raise ValueError(f"{name}: {sums.shape} sums for {counts.shape[0]} counts")
        for suffix, values in (("in_sum2", sums), ("counts", counts)):
            infos.append(TensorInfo(f"{name}.{suffix}", values.shape, F32, values.nbytes))
            data.append(values)
    layout = plan_layout(metadata, infos)
    parts = [layout.header]
    for values in data:
        raw = values.tobytes()
        parts.append(raw + bytes(pad(len(raw)) - len(raw)))
    return b"".join(parts)


def imatrix_dat_bytes(entries: Mapping[str, ImatrixEntry], dataset: str, chunk_count: int, chunk_size: int) -> bytes:
    """The older ``.dat`` importance matrix llama-imatrix writes (``kquants.md`` §4) of ``entries``: i32 entry count;
    per weight, names sorted, i32 name length, the name, i32 ``ncall`` (the largest count over ``chunk_size``,
    rounded up), i32 value count, f32 values ``(sum / count) * ncall`` in float32 (an expert with a count of 0: 1 for
    both); then i32 ``chunk_count`` and the ``dataset`` name (i32 length, bytes). A weight whose every count is 0
    is left out, as llama-imatrix leaves it out (the file cannot say it was never seen)."""
    parts: list[bytes] = []
    kept = 0
    for name in sorted(entries):
        found = entries[name]
        sums = np.asarray(found.sums, dtype=np.float32)
        counts = np.asarray(found.counts, dtype=np.float32).reshape(-1)
        if sums.ndim != 2 or sums.shape[0] != counts.size:
            raise ValueError(f"{name}: {sums.shape} sums for {counts.size} counts")
        if not (counts != 0).any():
            continue
        ncall = -(-int(counts.max()) // chunk_size)
        seen = counts != 0
        values = np.where(seen[:, None], sums, np.float32(1)) / np.where(seen, counts, np.float32(1))[:, None]
        values = (values.astype(np.float32) * np.float32(ncall)).astype("<f4")
        raw = name.encode("utf-8")
        parts.append(struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, values.size) + values.tobytes())
        kept += 1
    named = dataset.encode("utf-8")
    return struct.pack("<i", kept) + b"".join(parts) + struct.pack("<ii", chunk_count, len(named)) + named

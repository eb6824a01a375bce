"""A model's logical tensors read in the pass's compute dtype, one at a time, as the merge would read them.

A quantized tensor (block FP8, compressed-tensors, MXFP4) is read through the run's codecs: decoded to float32,
then cast (so a pass sees the values ``--dequantize`` would write); a plain one is cast straight from its stored
bytes. A hub model that is not downloaded is read by HTTP Range at its pinned commit, each tensor's bytes only, as
a merge streams its inputs (:class:`~resumerge.inputs.hub.stream.HubStream`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from resumerge.inputs.codecs import CODECS, StoredFormats
from resumerge.inputs.files import TensorSource
from resumerge.inputs.safetensors_format import DTYPE_SIZES, TensorEntry, numel
from resumerge.inputs.source import InputSource, InputSources
from resumerge.inputs.tensorio import TORCH_DTYPES
from resumerge.inputs.torch_bin import is_pickle_checkpoint
from resumerge.machine.torch_import import torch
from resumerge.merge.plan.inputrefs import format_ref, read_value

if TYPE_CHECKING:  # the hub's range reader (its HTTP stack) is imported only where a model is read from the hub
    from resumerge.inputs.hub.ranges import StreamedFile
    from resumerge.inputs.hub.stream import StreamedReads

# where a tensor lies: (file, start, end, safetensors dtype, shape)
Location = tuple[str, int, int, str, tuple[int, ...]]


@dataclass(frozen=True)
class Weights:
    """A model's folder (config.json and weight files, local or in the hub cache) and its stored tensors
    (quantized ones as their codes and companions); ``remote``: its weight files read by HTTP Range from the hub
    (a hub model whose folder is its cache snapshot of small files), each through a client of its own unless
    ``reads`` gives the ones to read through, and the check of every range read. ``source``: where every byte of
    its weight files comes from instead of its folder (whose config.json and tokenizer it still is): a merge never
    written (:mod:`resumerge.merge.engine.unwritten`), each tensor computed as it is read; the input seam's own
    protocol, so that a pass reads a model it computes exactly as one stored."""

    directory: Path
    tensors: Mapping[str, Location]
    remote: tuple[StreamedFile, ...] = ()
    reads: StreamedReads | None = None
    source: InputSource | None = None

    @classmethod
    def of(cls, directory: Path, stored: Mapping[str, TensorSource], remote: tuple[StreamedFile, ...] = (),
           reads: StreamedReads | None = None, source: InputSource | None = None) -> Weights:
        """The weights of an opened model (:class:`~resumerge.inputs.model.ModelInput`'s ``directory`` and
        ``tensors`` as opened; ``remote`` its files read from the hub by range, through ``reads`` where given;
        ``source`` every file read through, see :class:`Weights`)."""
        return cls(directory, {name: (t.file, t.entry.start, t.entry.end, t.entry.dtype, tuple(t.entry.shape))
                               for name, t in stored.items()}, remote, reads, source)


def base_formats(tensors: Mapping[str, Location], config: Mapping[str, Any], where: Path) -> StoredFormats:
    """The stored ``tensors`` sorted into logical tensors by the formats every run reads (``config`` is the
    model's config.json; headers only)."""
    stored = {name: TensorSource(f, TensorEntry(name, d, tuple(shape), s, e))
              for name, (f, s, e, d, shape) in tensors.items()}
    return CODECS.recognise(config, stored, where=str(where))


class CastReader:
    """A model's tensors, cast to ``dtype``.

    A safetensors tensor is cast straight from a read-only map of its bytes, unmapped once cast (one stored in
    ``dtype`` already is the map itself: see :meth:`_mapped`): a ``pread`` into a fresh buffer first cost twice the
    CPU (the kernel zeroes and faults in the buffer, then copies the page cache into it; 0.85-1.0 s against 0.4 s
    for the 1.47 GB the MoE bench's pass reads), on the pass's critical path. Its mapped pages count in this
    process's RSS only while that one tensor is cast (or, not cast, held), as the read buffer did (see
    :func:`pass_bytes`). Anything else (a pickle checkpoint, a misaligned tensor) is read as the merge reads it, and
    a quantized tensor is decoded as the merge decodes it.
    """

    def __init__(self, weights: Weights, formats: StoredFormats, dtype: torch.dtype | None = None, *,
                 key: str = "model") -> None:
        self._directory = weights.directory
        self._formats = formats
        # bfloat16 unless told: named here, not as the default, so importing this module does not import torch
        self._dtype = torch.bfloat16 if dtype is None else dtype
        self._key = key
        self._remote = frozenset(f.file for f in weights.remote)
        self._computed = weights.source is not None
        if weights.source is not None:  # no file to map: every tensor is what the source reads
            self._remote = frozenset(file for file, *_ in weights.tensors.values())
            self._sources = InputSources({key: weights.source})
        elif self._remote:
            from resumerge.inputs.hub.stream import HubStream

            reads = weights.reads
            ranges = dict(reads.ranges) if reads is not None else {f.file: f.client() for f in weights.remote}
            stream: InputSource = HubStream(weights.directory, ranges, check=reads.check if reads is not None else None)
            self._sources = InputSources({key: stream})
        else:
            self._sources = InputSources.local({key: str(weights.directory)})
        self._files: dict[str, BinaryIO] = {}
        # Shown each tensor :meth:`read` returns, by name, before the caller has it (the check's static figures
        # are taken from its forward pass's reads: resumerge.analyses.check.folded).
        self.watch: Callable[[str, torch.Tensor], None] | None = None

    @property
    def directory(self) -> Path:
        return self._directory

    def has(self, name: str) -> bool:
        """Whether the model holds logical tensor ``name``."""
        return name in self._formats.claims or name in self._formats.stored

    def holds(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether the model holds logical tensor ``name`` as a module of ``shape`` reads it: decoded by a format
        (whose values take the logical shape), or stored plainly in that shape (what :meth:`read` gives)."""
        if name in self._formats.claims:
            return True
        found = self._formats.stored.get(name)
        return found is not None and tuple(found.entry.shape) == shape

    def read(self, name: str) -> torch.Tensor:
        """Logical tensor ``name``, in the reader's dtype (a fresh tensor: the caller owns it), shown to
        :attr:`watch` when set."""
        found = self._read(name)
        if self.watch is not None:
            self.watch(name, found)
        return found

    def _read(self, name: str) -> torch.Tensor:
        if name in self._formats.claims:
            return read_value(format_ref(self._key, self._formats, name), self._sources).to(self._dtype)
        found = self._formats.stored[name]
        file, (start, end, dtype, shape) = found.file, (found.entry.start, found.entry.end, found.entry.dtype,
                                                        found.entry.shape)
        if (file in self._remote or is_pickle_checkpoint(file) or end == start or start % DTYPE_SIZES[dtype]
                or dtype not in TORCH_DTYPES):
            return self._sources.read(self._key, file, start, end, dtype, shape).to(self._dtype, copy=True)
        return self._mapped(file, start, end, dtype).reshape(shape)

    def spannable(self, name: str) -> bool:
        """Whether :meth:`read_span` reads only the span asked for (a plain tensor in a local safetensors file),
        not the whole tensor."""
        found = self._formats.stored.get(name)
        if name in self._formats.claims or found is None:
            return False
        entry = found.entry
        return not (found.file in self._remote or is_pickle_checkpoint(found.file) or entry.end == entry.start
                    or entry.start % DTYPE_SIZES[entry.dtype] or entry.dtype not in TORCH_DTYPES)

    def maps(self, name: str) -> bool:
        """Whether :meth:`read` hands over the stored bytes' own map for ``name`` (a :meth:`spannable` tensor stored
        in the reader's dtype): nothing is read or copied beside the tensor it gives."""
        return self.spannable(name) and TORCH_DTYPES[self._formats.stored[name].entry.dtype] == self._dtype

    def read_span(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Values ``start`` to ``stop`` of logical tensor ``name`` flattened (row-major), in the reader's dtype:
        of a :meth:`spannable` tensor only those values' bytes are mapped and cast (a block of an embedding, not
        the whole); of another, the whole tensor is read and the span copied out."""
        if not self.spannable(name):
            whole = self.read(name).reshape(-1)
            return whole if (start, stop) == (0, whole.numel()) else whole[start:stop].clone()
        found = self._formats.stored[name]
        size = DTYPE_SIZES[found.entry.dtype]
        return self._mapped(found.file, found.entry.start + start * size, found.entry.start + stop * size,
                            found.entry.dtype)

    def read_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor | None:
        """Rows ``rows`` (int64, ascending, distinct) of the plain 2-D tensor ``name``, in the reader's dtype, where
        its source computes them for less than the whole (a merge never written:
        :meth:`~resumerge.inputs.source.InputSource.read_rows`); None elsewhere."""
        found = self._formats.stored.get(name)
        if not self._computed or name in self._formats.claims or found is None or len(found.entry.shape) != 2:
            return None
        entry = found.entry
        got = self._sources.read_rows(self._key, found.file, entry.start, entry.end, entry.dtype, tuple(entry.shape),
                                      rows)
        return None if got is None else got.to(self._dtype, copy=True)

    def _mapped(self, file: str, start: int, end: int, dtype: str) -> torch.Tensor:
        """Bytes ``start`` to ``end`` of ``file`` as a flat tensor of ``dtype`` cast to the reader's dtype, from
        a map of those bytes only, unmapped once cast; stored in the reader's dtype already, the map itself
        (private: a write to it is the tensor's own, never the file's), unmapped when the tensor is freed. A
        copy of a float32 model's layers cost 0.45 s per GB read, of which a check of a merge, its base and two
        parents reads four (bench/RESULTS.md, issue 57); the map's pages are the page cache's, counted in the
        process's RSS while they are mapped, as the copy's were."""
        handle = self._files.get(file)
        if handle is None:
            handle = self._files[file] = open(self._directory / file, "rb")  # noqa: SIM115 (closed in close())
        offset = start - start % mmap.ALLOCATIONGRANULARITY
        same = TORCH_DTYPES[dtype] == self._dtype
        mapped = mmap.mmap(handle.fileno(), end - offset, access=mmap.ACCESS_COPY if same else mmap.ACCESS_READ,
                           offset=offset)
        try:
            with contextlib.suppress(AttributeError, OSError):  # a cold file: ask for it all at once
                mapped.madvise(mmap.MADV_WILLNEED, start - offset)
            with warnings.catch_warnings():  # "not writable": it is only read, by the cast
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(mapped, dtype=torch.uint8)[start - offset:]
            if same:  # the tensor holds the map (torch.frombuffer keeps its buffer alive)
                return raw.view(self._dtype)
            cast = raw.view(TORCH_DTYPES[dtype]).to(self._dtype, copy=True)
            del raw  # the map's last user: it can be closed now
        finally:
            if not same:
                with contextlib.suppress(BufferError):  # should a view outlive this, the collector closes the map
                    mapped.close()
        return cast

    def prefetch(self, prefix: str) -> None:
        """Ask the kernel to read the stored bytes of the tensors under ``prefix`` (a decoder layer's) into the page
        cache now, without waiting (``POSIX_FADV_WILLNEED``): the next layer's reads are under way while this one
        computes, where its files are cold. Nothing is mapped or held by this process (its RSS, which the budget
        governs, is unchanged: the pages are the kernel's, dropped under memory pressure like any cache); local
        safetensors files only, and nowhere the call is missing."""
        advise = getattr(os, "posix_fadvise", None)
        if advise is None or self._computed:
            return
        spans: dict[str, tuple[int, int]] = {}
        for name, found in self._formats.stored.items():
            if name.startswith(prefix) and found.file not in self._remote and not is_pickle_checkpoint(found.file):
                start, end = spans.get(found.file, (found.entry.start, found.entry.end))
                spans[found.file] = (min(start, found.entry.start), max(end, found.entry.end))
        for file, (start, end) in spans.items():
            with contextlib.suppress(OSError):
                handle = self._files.get(file)
                if handle is None:
                    handle = self._files[file] = open(self._directory / file, "rb")  # noqa: SIM115 (closed in close())
                advise(handle.fileno(), start, end - start, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._sources.close()


def pass_bytes(formats: StoredFormats, layers: int, value_bytes: int = 2, *, embeddings: str = "model.embed_tokens.",
               stack: str = "model.layers.", in_place: Callable[[str], bool] | None = None) -> int:
    """The most a pass holds at once beyond its process's baseline: the largest of :func:`step_sizes`."""
    return max(step_sizes(formats, layers, value_bytes, embeddings=embeddings, stack=stack,
                          in_place=in_place).values())


def step_sizes(formats: StoredFormats, layers: int, value_bytes: int = 2, *, embeddings: str = "model.embed_tokens.",
               stack: str = "model.layers.", in_place: Callable[[str], bool] | None = None,
               steps: Sequence[str] | None = None) -> dict[str, int]:
    """What a pass holds beyond its process's baseline (the model's stored tensors sorted by ``formats``) while it
    reads the embeddings and each decoder layer, by prefix (``embeddings`` first, then each layer's): its weights
    at ``value_bytes`` a value (2: bfloat16) plus the largest one as read (a quantized one's parts and its float32
    decode, a copied one's read bytes) — none for a tensor ``in_place`` names (:meth:`CastReader.maps`: the tensor
    is the stored bytes' map itself, nothing is read beside it; None: every tensor is copied). ``embeddings`` and
    ``stack``: the checkpoint's prefixes of the input embeddings and the decoder layers (a multimodal model's
    language model, GPT-2's ``transformer.h.``); ``steps``: each step's own prefix instead, where a step is no
    numbered layer of one list (XLM's steps are its layers' parts, in four lists)."""
    prefixes = list(dict.fromkeys([embeddings, *(steps if steps is not None else
                                                 (f"{stack}{i}." for i in range(layers)))]))
    held, largest = dict.fromkeys(prefixes, 0), dict.fromkeys(prefixes, 0)
    for name, found in formats.logical().items():
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is None:
            continue
        codec = formats.codec(name)
        values = numel(codec.value_shape(tuple(found.entry.shape)))
        held[prefix] += values * value_bytes
        if in_place is not None and in_place(name):
            continue
        read = found.entry.nbytes + sum(c.entry.nbytes for _, c in formats.companions(name))
        largest[prefix] = max(largest[prefix], read if codec.plain else read + values * 4)
    return {p: held[p] + largest[p] for p in prefixes}

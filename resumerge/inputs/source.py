"""The input source seam: the engine asks for "bytes [start, end) of file F of model M" and gets a tensor.

Like httpx's transports, a small abstract class with one required method and small implementations behind it;
the engine holds an :class:`InputSources` and never learns whether a model's bytes come from a local folder, a
Hugging Face cache snapshot (a local folder too, once fetched and verified) or HTTP byte ranges
(:mod:`resumerge.inputs.hub.stream`).
Implementations must return exactly the requested bytes or raise :class:`~resumerge.errors.ResumergeError`;
they are called from several worker threads at once. Sources are context managers: leaving the ``with`` block
closes them.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from resumerge.config.closing import Closing
from resumerge.inputs.tensorio import TORCH_DTYPES, TensorReader
from resumerge.inputs.torch_bin import PickleReader, is_pickle_checkpoint
from resumerge.machine.torch_import import torch

if TYPE_CHECKING:
    from resumerge.inputs.readdigests import ReadDigests

_T = TypeVar("_T")

class InputSource(Closing):
    """Reads byte ranges of the weight files of one input model."""

    @abstractmethod
    def read_range(self, file: str, start: int, end: int) -> torch.Tensor:
        """Bytes ``[start, end)`` of ``file`` (a name relative to the model) as a fresh uint8 CPU tensor."""

    def read_tensor(self, file: str, start: int, end: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor stored at ``[start, end)`` of ``file``: a whole tensor or a row range of one."""
        if end == start:
            return torch.empty(shape, dtype=TORCH_DTYPES[dtype])
        return self.read_range(file, start, end).view(TORCH_DTYPES[dtype]).reshape(shape)

    def read_tensor_into(self, file: str, start: int, end: int, dtype: str, shape: tuple[int, ...],
                         into: torch.Tensor) -> torch.Tensor:
        """:meth:`read_tensor` into ``into`` (uint8, contiguous, at least ``end - start`` bytes) where the source
        can read into memory it is given (local files); others return a fresh tensor as :meth:`read_tensor` does."""
        return self.read_tensor(file, start, end, dtype, shape)

    def read_rows(self, file: str, start: int, end: int, dtype: str, shape: tuple[int, ...],
                  rows: torch.Tensor) -> torch.Tensor | None:
        """Rows ``rows`` (int64, ascending, distinct) of the 2-D tensor stored at ``[start, end)`` of ``file``,
        where the source gives them for less than the whole tensor (a merge never written merges only them); None
        where it does not (the caller reads the tensor, or the spans it needs, instead)."""
        return None

    def rereads_cheaply(self, file: str) -> bool:
        """Whether reading bytes of ``file`` again costs a local read, not another network fetch."""
        return True

    def expect(self, order: Sequence[tuple[str, int, int]]) -> None:
        """Learn the (file, start, end) ranges the engine will read, in order (a remote source coalesces
        adjacent ones); reads outside it remain allowed."""

    def checked(self, file: str, timeout: float) -> bool:
        """Whether every byte read from ``file`` is checked against its source's checksum, waiting up to ``timeout``
        seconds (a file still downloading is checked at its end); raises what stopped the check."""
        return True

    def hash_reads(self, reads: ReadDigests) -> None:
        """Give each range read of a file of ``reads`` to it as read (the local inputs' proof: the digests are
        taken in the reads the merge makes anyway); a source that cannot leaves its files to the proof."""

    def stop(self) -> None:
        """The run is leaving: reads waiting for bytes that have not arrived yet fail now instead."""

    def close(self) -> None:
        """Release what the source holds open (descriptors, connections)."""


class LocalFiles(InputSource):
    """A model folder on a local filesystem, read by ``pread`` (see :mod:`resumerge.inputs.tensorio` for why);
    PyTorch ``.bin`` files by their virtual byte ranges through :class:`~resumerge.inputs.torch_bin.PickleReader`."""

    def __init__(self, directory: str | Path, reader: TensorReader | None = None) -> None:
        self.directory = Path(directory)
        self._reader = reader or TensorReader()
        self._owns_reader = reader is None
        self._pickles = PickleReader(self.directory)
        self._reads: ReadDigests | None = None
        self._paths: dict[str, str] = {}  # file -> its path as the proof names it, joined once

    def hash_reads(self, reads: ReadDigests) -> None:
        self._reads = reads  # a pickled .bin's virtual ranges are no file ranges: never given (the proof's)

    def _read(self, file: str, start: int, end: int, dtype: str, shape: tuple[int, ...],
              into: torch.Tensor | None = None) -> torch.Tensor:
        reads = self._reads
        if reads is None or end <= start:
            return self._reader.read(self.directory / file, start, end, dtype, shape, into)
        path = self._paths.get(file)
        if path is None:
            path = self._paths.setdefault(file, str(self.directory / file))
        hashed = reads.hasher(path, start, end)
        # Each piece hashed as the read fills it: the bytes the tensor is made of, while still in the CPU's cache.
        tensor = self._reader.read(self.directory / file, start, end, dtype, shape, into, hashed)
        if hashed is not None:
            reads.took(path, start, end, hashed)
        return tensor

    def read_range(self, file: str, start: int, end: int) -> torch.Tensor:
        if is_pickle_checkpoint(file):
            return self._pickles.read_range(file, start, end)
        return self._read(file, start, end, "U8", (end - start,))

    def read_tensor(self, file: str, start: int, end: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        if is_pickle_checkpoint(file):
            return super().read_tensor(file, start, end, dtype, shape)
        # Straight to the reader: it views its buffer with the right dtype, one call instead of two (and no third
        # where no read hashes: a model of tiny tensors, 180k reads at 90k tensors).
        if self._reads is None:
            return self._reader.read(self.directory / file, start, end, dtype, shape)
        return self._read(file, start, end, dtype, shape)

    def read_tensor_into(self, file: str, start: int, end: int, dtype: str, shape: tuple[int, ...],
                         into: torch.Tensor) -> torch.Tensor:
        if is_pickle_checkpoint(file):
            return super().read_tensor_into(file, start, end, dtype, shape, into)
        return self._read(file, start, end, dtype, shape, into)

    def close(self) -> None:
        self._pickles.close()
        if self._owns_reader:
            self._reader.close()


class InputSources(Closing):
    """The source of every input model of a plan, by model key: what the engine reads tensors through."""

    def __init__(self, sources: Mapping[str, InputSource], *, shared: TensorReader | None = None,
                 proof: Callable[[float], bool] | None = None) -> None:
        """``proof``: where a run proves its local inputs while it merges, whether that proof is recorded (waiting
        up to the seconds given; raising what failed it): until it is, no input file counts as checked
        (:meth:`checked`)."""
        self._sources = dict(sources)
        self._shared = shared
        self._proof = proof

    @classmethod
    def local(cls, model_dirs: Mapping[str, str]) -> InputSources:
        """Every model read from its folder (``plan.model_dirs``), sharing one descriptor table."""
        reader = TensorReader()
        return cls({key: LocalFiles(directory, reader) for key, directory in model_dirs.items()}, shared=reader)

    def with_proof(self, proof: Callable[[float], bool], reads: ReadDigests | None = None) -> InputSources:
        """These sources, whose input files count as checked only once ``proof`` (as in the constructor) says the
        run's proof is recorded, each giving the ranges it reads of a file of ``reads`` to it
        (:meth:`InputSource.hash_reads`); the sources returned own (and close) what these hold."""
        if reads is not None and reads.in_reads:  # else every read would ask, and be told no range is its
            for source in self._sources.values():
                source.hash_reads(reads)
        return InputSources(self._sources, shared=self._shared, proof=proof)

    def read(self, model: str, file: str, start: int, end: int, dtype: str, shape: tuple[int, ...],
             into: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor at ``[start, end)`` of ``file`` of input ``model``: in ``into`` when given and the source
        reads into memory it is given (:meth:`InputSource.read_tensor_into`)."""
        if into is not None:
            return self._sources[model].read_tensor_into(file, start, end, dtype, shape, into)
        return self._sources[model].read_tensor(file, start, end, dtype, shape)

    def read_rows(self, model: str, file: str, start: int, end: int, dtype: str, shape: tuple[int, ...],
                  rows: torch.Tensor) -> torch.Tensor | None:
        """Rows ``rows`` of a 2-D tensor of input ``model``, or None (see :meth:`InputSource.read_rows`)."""
        return self._sources[model].read_rows(file, start, end, dtype, shape, rows)

    def rereads_cheaply(self, model: str, file: str) -> bool:
        """Whether reading bytes of ``file`` of input ``model`` again costs a local read (see
        :meth:`InputSource.rereads_cheaply`)."""
        return self._sources[model].rereads_cheaply(file)

    def expect(self, order: Sequence[tuple[str, str, int, int]]) -> None:
        """Tell each source the (model, file, start, end) reads the plan will make, in order (see
        :meth:`InputSource.expect`)."""
        by_model: dict[str, list[tuple[str, int, int]]] = {key: [] for key in self._sources}
        for model, file, start, end in order:
            if model in by_model:
                by_model[model].append((file, start, end))
        for key, source in self._sources.items():
            source.expect(by_model[key])

    def checked(self, model: str, file: str, timeout: float) -> bool:
        """Whether every byte read from ``file`` of input ``model`` is checked (see :meth:`InputSource.checked`), and
        the run's proof of its inputs recorded where it is taken while the run merges."""
        if self._proof is not None and not self._proof(timeout):
            return False
        return self._sources[model].checked(file, timeout)

    def stop(self) -> None:
        """The run is leaving: end every source's waits (see :meth:`InputSource.stop`)."""
        for source in self._sources.values():
            source.stop()

    def close(self) -> None:
        """Close every source."""
        for source in self._sources.values():
            source.close()
        if self._shared is not None:
            self._shared.close()

"""The output codec of a GGUF release (``--gguf-type q8_0,q4_k_m,...``): one merged tensor encoded into each file of
the release in turn, as each file's own :class:`~.outcodec.GgufOutCodec` (or stack codec) encodes it in a run of
that type alone, so that every file holds the bytes its single-type run writes.

Each file's stored parts are named ``FILE:NAME`` (:func:`file_part`): the tensor's stored parts of every file are
the parts of one output tensor, computed and encoded once each, and the release's container
(:class:`~resumerge.outputs.containers.GgufRelease`) hands each file only its own (:func:`parts_of_file`).
The merged value is encoded into every file before it is dropped: no float copy of the merge is spilled. Files
whose codecs for a tensor are equal (the same type, transform, rows and importance matrix: a Q6_K tensor of a Q4_K_M
and a Q5_K_M file, the Q8_0 embeddings of every file of a model whose rows the K-quants cannot take) are encoded once
and the others given a copy of those bytes (:func:`same_as`): a codec's output depends on its fields and the value
alone, so each file holds the bytes its own encoding writes. On SmolLM2-135M's 7-type release, 435 of the 941
million values encoded were such repeats.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from math import lcm
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from resumerge.inputs.codecs.protocol import OutPart, TensorEncoder

if TYPE_CHECKING:
    from resumerge.inputs.codecs.protocol import Lend
    from resumerge.machine.torch_import import torch

_SEP = ":"  # a GGUF tensor name holds none (gguf.md §2: dots, digits, letters, underscores)
_P = TypeVar("_P")


def file_part(file: str, name: str) -> str:
    """The release's name of file ``file``'s stored part (or codec part) ``name``."""
    return f"{file}{_SEP}{name}"


def same_as(codecs: Sequence[TensorEncoder]) -> list[int]:
    """For each of ``codecs``, the index of the first one that encodes as it does (itself where none before does):
    equal codecs (a frozen dataclass's equality: the same class and fields) encode a value to the same bytes, and an
    importance matrix is no difference to a type whose encoding reads none (Q8_0: the Q8_0 file's embeddings and a
    K-quant file's, where the matrix weights its other tensors), nor the type a fallback stands in for."""
    keys = [_encodes_as(codec) for codec in codecs]
    return [keys.index(key) for key in keys]


def _encodes_as(codec: TensorEncoder) -> TensorEncoder:
    """``codec`` less what its encoding does not read: a GGUF codec's importance matrix where its type reads none
    (:data:`~.encoders.WEIGHTED`), and the type llama.cpp would have chosen (what the plan's notes name: an IQ4_NL
    tensor stands in for IQ4_XS in one file and for IQ3_S in another, the same bytes)."""
    from resumerge.outputs.gguf.encoders import WEIGHTED
    from resumerge.outputs.gguf.outcodec import GgufOutCodec

    if not isinstance(codec, GgufOutCodec):
        return codec
    return replace(codec, llama_type=-1, imatrix=codec.imatrix if codec.ggml_type in WEIGHTED else "")


def parts_of_file(file: str, parts: Sequence[_P], name_of: Callable[[_P], str]) -> list[_P]:
    """Those of ``parts`` (each named by ``name_of(part)``) stored in file ``file`` of a release."""
    prefix = file + _SEP
    return [p for p in parts if name_of(p).startswith(prefix)]


@dataclass(frozen=True)
class ReleaseCodec(TensorEncoder):
    """One output tensor written to every file of a release: ``codecs[i]`` encodes it for ``files[i]``."""

    name: ClassVar[str] = "gguf-release"

    files: tuple[str, ...]
    codecs: tuple[TensorEncoder, ...]

    def identity(self) -> tuple[Any, ...]:
        return (self.name, self.files, tuple(c.identity() for c in self.codecs))

    @property
    def row_block(self) -> int:
        return lcm(*(c.row_block for c in self.codecs))

    def from_row(self, first: int) -> ReleaseCodec:
        return replace(self, codecs=tuple(c.from_row(first) for c in self.codecs))

    def sampled(self) -> ReleaseCodec:
        return replace(self, codecs=tuple(c.sampled() for c in self.codecs))

    @property
    def mergekit_reads(self) -> bool:
        return False

    @property
    def round_trip(self) -> tuple[str, float] | None:
        # the coarsest file's: what a note on the merge's GGUF precision must not understate
        found = [c.round_trip for c in self.codecs if c.round_trip is not None]
        return max(found, key=lambda r: r[1]) if found else None

    def quantization_config(self, base: Mapping[str, Any]) -> Mapping[str, Any] | None:
        return None

    def out_parts(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[OutPart, ...]:
        return tuple(OutPart(file_part(file, p.part), file_part(file, p.name), p.dtype, p.shape)
                     for file, codec in zip(self.files, self.codecs, strict=True)
                     for p in codec.out_parts(name, dtype, shape))

    def encode(self, value: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
        # an equal codec's encoding once, each of its files given its own copy (the writer owns what it is handed)
        encoded: list[dict[str, torch.Tensor]] = []
        for i, first in enumerate(same_as(self.codecs)):
            encoded.append(self.codecs[i].encode(value, dtype) if first == i
                           else {part: t.clone() for part, t in encoded[first].items()})
        return {file_part(file, part): stored for file, mine in zip(self.files, encoded, strict=True)
                for part, stored in mine.items()}

    @property
    def writes_into(self) -> bool:
        return all(c.writes_into for c in self.codecs)

    def encode_into(self, value: torch.Tensor, dtype: str, into: Mapping[str, torch.Tensor], *,
                    lend: Lend | None = None) -> None:
        # file by file, in the value's one buffer: what each file's encoder borrows (lend) it gives back on return;
        # a file whose codec equals an earlier file's copies that file's bytes
        done: list[dict[str, torch.Tensor]] = []
        for i, (file, codec, first) in enumerate(zip(self.files, self.codecs, same_as(self.codecs), strict=True)):
            prefix = file + _SEP
            mine = {part.removeprefix(prefix): t for part, t in into.items() if part.startswith(prefix)}
            if first == i:
                codec.encode_into(value, dtype, mine, lend=lend)
            else:
                for part, t in mine.items():
                    t.copy_(done[first][part])
            done.append(mine)

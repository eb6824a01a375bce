"""The tensor codec seam: how a stored tensor and its companions become the value a merge method sees, and back.

A *stored format* is a :class:`TensorDecoder` (how it is read), a :class:`TensorEncoder` (how it is written), or a
:class:`TensorCodec`, both in one value (plain dtypes, block FP8, compressed-tensors, MXFP4); GGUF reads with one
value per stored tensor and writes with another. No format implements a direction it does not have. The planner
asks each format of the run's :class:`~resumerge.inputs.codecs.table.CodecTable` which stored tensors
of a model it owns (:meth:`TensorDecoder.recognise`, from ``config.json`` and the headers only); each owned tensor
becomes one logical tensor — a main part plus named companion parts (scales, zero points, packed shapes), which may
sit in other files than the main part. Tensors no format claims are plain. The engine then reads the parts (a row
range of them for a row chunk: :meth:`TensorDecoder.part_rows`) and calls :meth:`TensorDecoder.decode` just before the
method sees the tensor; on output, :meth:`TensorEncoder.encode` turns the result into the parts
:meth:`TensorEncoder.out_parts` announced when the shards were laid out.

A codec instance is an immutable value (a frozen dataclass: its fields are the format's parameters, say a block
size); the plan carries the instance of each input and output tensor, and its fingerprint carries
:meth:`TensorDecoder.identity`. Codecs hold no state: several worker threads decode with one instance at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

if TYPE_CHECKING:
    from resumerge.inputs.files import TensorSource
    from resumerge.machine.torch_import import torch

    # Where the engine lends host buffers it reuses from one tensor to the next, by use: ``lend(use, shape, dtype)``
    # gives an uninitialised contiguous tensor (an encoder's :meth:`TensorEncoder.encode_into`, a method's result).
    Lend = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]

# The part every logical tensor has: the stored tensor that holds its values (or their codes).
MAIN = "main"


class Role(str, Enum):
    """What a stored input tensor is to the merge: the main part of a quantized logical tensor, a companion of
    one (its scales, zero points, packed shape), or a tensor stored plainly (embeddings, norms, unquantized
    linears: the only role a plain checkpoint has)."""

    WEIGHT = "weight"
    COMPANION = "companion"
    OTHER = "other"


class Claim(NamedTuple):
    """A logical tensor a format owns in one model: the name the planner matches against the config and the
    architecture (``name``), its stored parts by part name (:data:`MAIN` first, then the companions), and the
    codec that decodes them. A tuple: a block-FP8 checkpoint makes 45k of them, at a third of a frozen dataclass's
    cost each."""

    name: str
    parts: tuple[tuple[str, str], ...]
    codec: TensorDecoder

    @property
    def main(self) -> str:
        """The stored name of the main part."""
        part, stored = self.parts[0]  # first, as every format lists it: found without a scan
        return stored if part == MAIN else next(stored for part, stored in self.parts if part == MAIN)

    @property
    def companions(self) -> tuple[tuple[str, str], ...]:
        """(part name, stored name) of every part but the main one."""
        return tuple(p for p in self.parts if p[0] != MAIN)


@dataclass(frozen=True)
class OutPart:
    """A stored tensor an output tensor is written as: its stored name, safetensors dtype and shape."""

    part: str
    name: str
    dtype: str
    shape: tuple[int, ...]


class _Format:
    """What a decoder and an encoder both are: a named, immutable format value whose identity the fingerprint
    records (subclasses are frozen dataclasses)."""

    name: ClassVar[str]

    def identity(self) -> tuple[Any, ...]:
        """What the plan's fingerprint records of this codec: its name and parameters."""
        # The fields read directly, not dataclasses.astuple (a deep copy: seconds over a 92k-tensor plan); a
        # codec's parameters are scalars and tuples of them, which astuple returned equal.
        return (self.name, *(getattr(self, f.name) for f in fields(self)))  # type: ignore[arg-type]

    @property
    def plain(self) -> bool:
        """Whether reading is a view of the stored bytes (no decoding, no companions)."""
        return False

    @property
    def mergekit_reads(self) -> bool:
        """Whether mergekit 0.1.5 reads this format's stored tensors at all (it merges a safetensors format's codes
        as numbers; it cannot open a GGUF): what the plan's note about quantized inputs says of it."""
        return True

    def value_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the decoded value of a main part of shape ``stored`` (a packed format's differ)."""
        return stored

    @property
    def round_trip(self) -> tuple[str, float] | None:
        """The GGUF quantization type this format's values went through (its name) and the relative RMS error, in
        %, of one encode-decode round trip of normal values: what the plan's note about GGUF precision quotes
        (:func:`resumerge.merge.plan.quantnotes.gguf_error_notes`); None where it notes nothing."""
        return None


class TensorDecoder(_Format, ABC):
    """The reading direction of one stored tensor format: which stored tensors of a model it owns, and their value.
    Subclasses are frozen dataclasses; ``name`` names the format in plans, fingerprints and reports."""

    # The ``quant_method`` values (lowercase) of ``config.json``'s ``quantization_config`` this format decodes: a
    # table asks a format about a model only when the model has no ``quant_method`` or one the format claims, and
    # refuses a model whose ``quant_method`` no format of the table claims (see
    # :meth:`~resumerge.inputs.codecs.table.CodecTable.recognise`).
    claims: ClassVar[tuple[str, ...]] = ()

    @classmethod
    @abstractmethod
    def recognise(cls, config: Mapping[str, Any], tensors: Mapping[str, TensorSource]) -> tuple[Claim, ...]:
        """The logical tensors this format owns among ``tensors`` (a model's stored tensors by name) of a model
        whose ``config.json`` is ``config``; empty when the model is not in this format. Decided from the config
        and the headers (names, dtypes, shapes) alone. Raises
        :class:`~resumerge.errors.ModelInputError` for a model in this format that cannot be read (a missing
        companion, a scale whose shape does not fit its block), naming the tensor."""

    @classmethod
    def recognise_among(cls, config: Mapping[str, Any], tensors: Mapping[str, TensorSource],
                        shared: dict[object, Any]) -> tuple[Claim, ...]:
        """:meth:`recognise`, as a :class:`~resumerge.inputs.codecs.table.CodecTable` asks each of its formats in
        turn about one model: ``shared`` holds what the formats tried before judged of that whole model (by
        whatever key they chose), so formats that judge a model the same way (every quantized format reads the
        one ``quantization_config`` verdict) judge it once. ``shared`` lives as long as that one question."""
        return cls.recognise(config, tensors)

    @property
    def stored_as(self) -> str:
        """What the main part stores, as the plan's notes name it ("FP8 codes"): what a tool that does not decode
        this format merges as if it were the weights."""
        return "values"

    def value_dtype(self, stored: str) -> str:
        """The safetensors dtype of the decoded value of a main part stored as ``stored``."""
        return "F32"

    @property
    def read_block(self) -> int:
        """Value rows a decode needs together (a GGUF q/k head, whose rows are interleaved): every row chunk of a
        tensor read in this format, but its last, is a multiple of it. 1 by default."""
        return 1

    def part_rows(self, part: str, first: int, stop: int) -> tuple[int, int]:
        """The rows of companion part ``part`` that value rows ``[first, stop)`` need (a block scale's row holds
        many value rows); the engine reads those rows of each companion for a row chunk, and the same rows of
        the main part as of the value (row-major parts; a part without rows, a scalar, is read whole)."""
        return first, stop

    @abstractmethod
    def decode(self, parts: Mapping[str, torch.Tensor], first_row: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The value of rows ``first_row`` onwards from ``parts`` (the rows :meth:`part_rows` named, by part
        name) in :meth:`value_dtype`: as many rows as the main part holds. A fresh tensor the method may
        change, except for a plain codec (then the stored buffer itself, as read). ``out``, when given, is a
        contiguous buffer of the value's shape and dtype the codec may decode into and return instead of allocating
        one (a caller that reuses its buffers spares the kernel's zeroing of fresh pages); the returned tensor is
        the value either way, on the parts' device (``out``'s too)."""


class TensorEncoder(_Format, ABC):
    """The writing direction of one stored tensor format: the stored tensors an output tensor is written as, and
    their bytes. Subclasses are frozen dataclasses; an output keeps its base input's format when that format's
    decoder is an encoder too (a :class:`TensorCodec`), else it is stored plainly."""

    @property
    def row_block(self) -> int:
        """Value rows one stored row of a companion covers (a block scale's block height): every row chunk of a
        tensor written in this format, but its last, is a multiple of it, so no chunk encodes part of a block
        (the block would get two scales, and the second chunk's would overwrite the first's). 1 by default."""
        return 1

    def from_row(self, first: int) -> TensorEncoder:
        """The encoder of a row chunk whose first row is row ``first`` of what this encoder encodes (the engine
        encodes a chunk with it): itself by default; an encoding that depends on the row says so here (a stack of
        experts whose each expert has its own importance weights)."""
        return self

    def sampled(self) -> TensorEncoder:
        """The encoder ``plan``'s speed sample times for this one: itself by default; one that reads what the run
        makes before it encodes (an importance matrix computed on the merge) says what stands in for it."""
        return self

    def carries(self, part: str) -> bool:
        """Whether companion ``part`` is carried beside the value rather than used to decode it or computed by
        :meth:`encode` (a static activation's ``input_scale``, calibrated on activations, not weights): an output
        in this format copies it from the input whose format it keeps. False by default."""
        return False

    def quantization_config(self, base: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The ``quantization_config`` of the output's ``config.json`` when this codec writes its tensors (``base``
        is the config.json of the model whose format the output keeps); None writes none. By default the base's
        own entry, unchanged."""
        found = base.get("quantization_config")
        return found if isinstance(found, Mapping) else None

    @abstractmethod
    def out_parts(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[OutPart, ...]:
        """The stored tensors output tensor ``name`` (value ``dtype``, ``shape``) is written as, main first;
        what the shard layout holds for it."""

    @abstractmethod
    def encode(self, value: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
        """``value`` (a method's result, any float dtype, on the device it was computed on) as the parts
        :meth:`out_parts` announced, by part name, on ``value``'s device, with the bytes the same values give on
        the CPU; ``dtype`` is the planned value dtype. The engine moves the parts to the host and makes them
        contiguous."""

    @property
    def writes_into(self) -> bool:
        """Whether :meth:`encode_into` writes the parts straight into ``into``, with no encoded tensor between (the
        engine then encodes a whole tensor into buffers it reuses, not by :meth:`encode`). False by default: the
        default :meth:`encode_into` copies :meth:`encode`'s parts."""
        return False

    def encode_into(self, value: torch.Tensor, dtype: str, into: Mapping[str, torch.Tensor], *,
                    lend: Lend | None = None) -> None:
        """:meth:`encode`'s parts written into ``into`` (host tensors by part name, each of its part's shape and
        dtype): a row chunk's bytes straight into the range's buffers. ``lend(use, shape, dtype)``, where given,
        lends host buffers the engine reuses from one tensor to the next, valid until this call returns, for what
        the encoding computes between (an uninitialised contiguous tensor per use). This default copies
        :meth:`encode`'s parts there and lends nothing."""
        for part, stored in self.encode(value, dtype).items():
            into[part].copy_(stored)


class TensorCodec(TensorDecoder, TensorEncoder, ABC):
    """A format read and written alike (plain dtypes, block FP8, compressed-tensors, MXFP4): its decoder and its
    encoder in one value, so an output tensor keeps its base input's format."""


class SharedScale(ABC):
    """An encoder whose tensor-wide scale a group of output tensors shares. Inference engines (vLLM, TensorRT-LLM)
    fuse sibling projections (q/k/v, gate/up) into one GEMM with one tensor-wide scale, so the planner names each
    group once, in the plan (:meth:`grouped`, fingerprinted with the codec), and the engine hands each member's
    encoder the largest magnitude over the whole group (:meth:`scaled`) before it encodes that member. The group's
    magnitude is a pure function of the plan (its members' merged values), so a resumed run finds it again."""

    @property
    @abstractmethod
    def group(self) -> tuple[str, ...]:
        """The output tensors sharing this encoder's tensor-wide scale, itself among them; () for none."""

    @abstractmethod
    def grouped(self, group: tuple[str, ...]) -> TensorEncoder:
        """This encoder for a member of ``group`` (output tensor names, in the order the engine measures them)."""

    @abstractmethod
    def amax_of(self, value: torch.Tensor) -> float:
        """What one member's merged ``value`` brings to the group: its largest magnitude, as this encoder measures
        it (a float32 value, exact in a Python float)."""

    @abstractmethod
    def scaled(self, amax: float) -> TensorEncoder:
        """This encoder with its tensor-wide scale computed from ``amax``, the largest of the group's members'
        :meth:`amax_of`, instead of from the value it encodes."""

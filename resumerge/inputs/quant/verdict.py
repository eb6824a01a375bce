"""What a quantized format's codec (:meth:`~resumerge.inputs.codecs.quantized.QuantizedCodec.weights`) says about a
checkpoint: its format, and per stored tensor its role and, for each quantized weight, how it decodes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Literal, NamedTuple

__all__ = ["Checkpoint", "Kind", "QuantizedTensor", "Role", "Scheme", "TensorRole"]

# weight: a quantized weight's stored codes; companion: a tensor that belongs to one (scale, zero point, packed
# shape, static activation scale); other: a plain tensor, read as its dtype.
Role = Literal["weight", "companion", "other"]
# A scheme's kind, named by its format (the built-in ones: "fp8-block", "ct-packed", "ct-naive", "ct-float", "mxfp4").
Kind = str


@dataclass(frozen=True)
class Scheme:
    """How one quantized weight decodes.

    ``kind``: ``fp8-block`` (:mod:`.fp8_block`), ``ct-packed`` / ``ct-naive`` / ``ct-float``
    (:mod:`.compressed_tensors`: pack-, naive/int- and float-quantized) or ``mxfp4`` (:mod:`.mxfp4`).
    ``block``: the scale grid's block over the 2-D ``[rows, cols]`` weight (per expert for a 3-D fused one); None for
    MXFP4 (32 input values per scale). A per-tensor or per-channel block may be wider than the weight (any width
    at or above it gives the same one-column grid), so it is known before ``weight_shape``'s payload is read.
    ``bits``: code width (8 for FP8, 4 for MXFP4). ``strategy``: compressed-tensors' ``tensor``, ``channel``,
    ``group`` or ``block`` (``block`` for block FP8, ``group`` for MXFP4). ``scale_fmt``: ``float`` or ``ue8m0``
    (power-of-two block-FP8 scales).
    ``scale_dtype``: the stored scale's safetensors dtype, which an encoded scale is cast back to.
    """

    kind: Kind
    bits: int
    block: tuple[int, int] | None
    strategy: str
    scale_dtype: str
    symmetric: bool = True
    group_size: int | None = None
    scale_fmt: str = "float"


class QuantizedTensor(NamedTuple):
    """One quantized weight: the logical tensor a merge sees, and the stored tensors that make it up (a tuple: a
    block-FP8 checkpoint has 45k of them, at a third of a frozen dataclass's cost each).

    ``name``: the logical name (``X.weight`` for block FP8 and compressed-tensors, pack-quantized too; the
    ``X`` of ``X_blocks``/``X_scales`` for MXFP4, as transformers names the parameter). ``codes``: the stored
    tensor holding the codes; ``scale``; ``zero_point`` (asymmetric only); ``shape_tensor`` (pack-quantized's
    ``weight_shape``); ``extras``: companions carried with the weight but not used to decode it (a static
    ``input_scale``). ``shape``: the decoded shape (MXFP4: transformers' transposed ``[..., in, out]``), or None
    where only ``weight_shape``'s payload knows the exact width (pack-quantized per-tensor or per-channel).
    """

    name: str
    codes: str
    scale: str
    scheme: Scheme
    shape: tuple[int, ...] | None
    zero_point: str | None = None
    shape_tensor: str | None = None
    extras: tuple[str, ...] = ()

    def stored(self) -> tuple[str, ...]:
        """Every stored tensor of this weight, codes first."""
        names = (self.codes, self.scale, self.zero_point, self.shape_tensor, *self.extras)
        return tuple(n for n in names if n is not None)


@dataclass(frozen=True)
class TensorRole:
    """A stored tensor's role; ``weight`` is the logical weight it makes up (None for ``other``)."""

    role: Role
    weight: str | None = None


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's verdict: ``format`` (``fp8``, ``compressed-tensors``, ``mxfp4``, or None when nothing is
    quantized), its quantized weights by logical name, and the names of all its stored tensors (``names``)."""

    format: str | None
    quantized: Mapping[str, QuantizedTensor]
    names: Collection[str]

    @cached_property
    def roles(self) -> Mapping[str, TensorRole]:
        """Every stored tensor's role, by stored name: made at the first use, as the planner never asks (a
        92k-tensor checkpoint's roles are 92k entries)."""
        roles: dict[str, TensorRole] = dict.fromkeys(self.names, _OTHER)
        for weight in self.quantized.values():
            roles[weight.codes] = TensorRole("weight", weight.name)
            companion = TensorRole("companion", weight.name)  # frozen: one serves the weight's companions
            roles.update((name, companion) for name in weight.stored()[1:])
        return roles

    def role_counts(self) -> dict[str, int]:
        """How many stored tensors have each role (the accounting ``plan`` and ``status`` report)."""
        counts = Counter(r.role for r in self.roles.values())
        return {role: counts.get(role, 0) for role in ("weight", "companion", "other")}


_OTHER = TensorRole("other")  # frozen: one instance serves every plain tensor of a 92k-tensor checkpoint

"""The GGUF input codec: each tensor of a GGUF model decoded to float32, in Hugging Face's values.

It claims every tensor of a model :mod:`.model` opened (``quant_method: gguf`` in its synthesized config), decodes a row
chunk (F16, BF16, Q8_0, the legacy types, the K-quants, the i-quants, TQ1_0, TQ2_0 and MXFP4 with torch,
:mod:`.blocks`; the other types with ``gguf.quants.dequantize``; blocks never cross rows) and applies the family's
transform: llama's q/k rows un-permuted per head (a chunk is whole heads: :attr:`GgufCodec.read_block`), gemma's
norms −1. A decoder only: an output tensor of a GGUF base is stored plainly, or written to a GGUF by
:mod:`resumerge.outputs.gguf` (one encoder per tensor).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from resumerge.errors import ModelInputError
from resumerge.inputs.codecs.protocol import MAIN, Claim, TensorDecoder
from resumerge.inputs.gguf import blocks
from resumerge.inputs.gguf.ggmltypes import BY_NAME
from resumerge.inputs.gguf.model import METHOD, NVFP4_COMPANIONS, gguf_module
from resumerge.inputs.gguf.names import NORM_MINUS_ONE, UNPERMUTE_Q, hf_rows, transform

if TYPE_CHECKING:
    from resumerge.inputs.files import TensorSource
    from resumerge.machine.torch_import import torch



@dataclass(frozen=True)
class GgufCodec(TensorDecoder):
    """One GGUF tensor's decoding: its ggml type (by name), block (values, bytes), the transform into HF values,
    and the rows of one head for an un-permuted q/k (1 otherwise)."""

    name: ClassVar[str] = "gguf"
    claims: ClassVar[tuple[str, ...]] = (METHOD,)

    ggml_type: str
    block: tuple[int, int]
    transform: str = ""
    head_rows: int = 1

    @property
    def round_trip(self) -> tuple[str, float] | None:
        row = BY_NAME.get(self.ggml_type)  # its error: resumerge.inputs.gguf.ggmltypes
        return None if row is None or row.round_trip is None else (self.ggml_type, row.round_trip)

    @classmethod
    def recognise(cls, config: Mapping[str, Any], tensors: Mapping[str, TensorSource]) -> tuple[Claim, ...]:
        quantization = config.get("quantization_config") or {}
        if quantization.get("quant_method") != METHOD:
            return ()
        gguf = gguf_module()
        arch, types = quantization["architecture"], quantization["tensor_types"]
        interned: dict[GgufCodec, GgufCodec] = {}
        claims = []
        companions = _nvfp4_companions(tensors, types)
        taken = {stored for parts in companions.values() for _, stored in parts}
        for name, found in tensors.items():
            if name not in types:
                raise ModelInputError(f"{name} is not a tensor of the GGUF", tensor=name)
            if name in taken:
                continue
            type_name, gguf_name = types[name].split(":", 1)
            kind = gguf.GGMLQuantizationType[type_name]
            how = transform(arch, gguf_name)
            heads = int(config["num_attention_heads"] if how == UNPERMUTE_Q else config["num_key_value_heads"])
            rows = found.entry.shape[0]
            head_rows = rows // heads if how and how != NORM_MINUS_ONE else 1
            if how and how != NORM_MINUS_ONE and (head_rows * heads != rows or head_rows % 2):
                raise ModelInputError(f"{name} has {rows} rows, which {heads} heads cannot un-permute", tensor=name)
            codec = cls(type_name, tuple(gguf.GGML_QUANT_SIZES[kind]), how, head_rows)  # type: ignore[arg-type]
            claims.append(Claim(name, ((MAIN, name), *companions.get(name, ())), interned.setdefault(codec, codec)))
        return tuple(claims)

    def part_rows(self, part: str, first: int, stop: int) -> tuple[int, int]:
        return (first, stop) if part == MAIN else (0, 1)  # an NVFP4 tensor's scale 2: one value

    @property
    def stored_as(self) -> str:
        return f"GGUF {self.ggml_type} tensors"

    @property
    def mergekit_reads(self) -> bool:
        return False

    @property
    def read_block(self) -> int:
        return self.head_rows

    def value_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        row = BY_NAME.get(self.ggml_type)
        if row is not None and not row.is_block:
            return stored
        values, size = self.block
        return (*stored[:-1], stored[-1] // size * values)

    def decode(self, parts: Mapping[str, torch.Tensor], first_row: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        from resumerge.machine.torch_import import torch

        stored = parts[MAIN]
        row = BY_NAME.get(self.ggml_type)
        # torch over the compute threads, into ``out`` and transformed there
        if row is not None and blocks.decodes(row.code):
            direct = out if out is not None and out.is_contiguous() and stored.device == out.device else None
            value = blocks.decode(stored, row.code, direct)
            if direct is not None:
                if self.transform == NORM_MINUS_ONE:
                    direct -= 1
                elif self.transform:
                    _hf_rows_in_place(direct, self.head_rows)
                return direct
        else:
            gguf = gguf_module()
            rows = stored.cpu().contiguous().numpy()
            decoded = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[self.ggml_type])
            value = torch.from_numpy(decoded.reshape(self.value_shape(tuple(stored.shape)))).to(stored.device)
            scale = parts.get(_SCALE_2)
            if scale is not None:  # NVFP4's blocks hold E2M1 × E4M3; its tensor-wide scale multiplies them
                value *= scale.to(torch.float32).reshape(())
        if self.transform == NORM_MINUS_ONE:
            value -= 1
        elif self.transform:
            value = hf_rows(value, self.head_rows)
        if out is not None:
            out.copy_(value)
            return out
        return value.contiguous()


_SCALE_2 = NVFP4_COMPANIONS["scale"]


def _nvfp4_companions(tensors: Mapping[str, TensorSource],
                      types: Mapping[str, str]) -> dict[str, tuple[tuple[str, str], ...]]:
    """The companions of each NVFP4 weight (by its name), as (part, stored name): its scale 2, which decodes it,
    and its input scale, carried by nothing (an output of a GGUF base is plain, or a GGUF of another type)."""
    found: dict[str, tuple[tuple[str, str], ...]] = {}
    for name in tensors:
        if types.get(name, "").startswith("NVFP4:"):
            module = name.removesuffix("weight")
            found[name] = tuple((part, f"{module}{part}") for part in NVFP4_COMPANIONS.values()
                                if f"{module}{part}" in tensors)
    return found


def _hf_rows_in_place(value: torch.Tensor, head_rows: int) -> None:
    """:func:`~resumerge.inputs.gguf.names.hf_rows` of ``value`` (contiguous) in place, a head at a time through
    one head's buffer: a decoded q/k is not copied whole into fresh memory (twice: decoded, then re-ordered), which
    the kernel faults in and zeroes page by page."""
    from resumerge.machine.torch_import import torch

    rest = value.shape[1:]
    held = torch.empty((head_rows, *rest), dtype=value.dtype, device=value.device)
    for start in range(0, value.shape[0], head_rows):
        head = value[start:start + head_rows]
        held.copy_(head)
        head.view(2, head_rows // 2, *rest).copy_(held.view(head_rows // 2, 2, *rest).transpose(0, 1))

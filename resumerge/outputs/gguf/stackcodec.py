"""The GGUF output codec of a mixture of experts' routed projections, which llama.cpp stores stacked: one GGUF tensor
``blk.N.ffn_{gate,up,down}_exps.weight`` of shape [E, rows, cols] per projection and layer (``gguf.md`` §3).

Quant blocks never cross rows, so expert e of a stack is the contiguous bytes ``[e·size, (e+1)·size)`` of it,
encoded alone. An output tensor stored one per expert (Qwen-MoE's ``mlp.experts.e.gate_proj.weight``, Mixtral's
``w1``) is written as that slice of its stack: its stored part is named ``STACK#e``
(:func:`~resumerge.outputs.gguf.layout.slice_name`), and the shard layout puts the slices of one stack end to end,
padded after the last only. Each expert is merged, sized in memory and journaled with its file as any tensor is. A
fused stack (transformers 5's ``experts.gate_up_proj`` [E, 2I, H]) is written as two GGUF tensors, each expert's
gate rows to one and its up rows to the other; ``experts.down_proj`` is its stack as it is (:class:`.GgufOutCodec`).
With an importance matrix each expert of a fused stack is encoded with its own slice of the entry (a row chunk of
experts knows its first: :meth:`~.GgufOutCodec.from_row`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from resumerge.inputs.codecs.protocol import MAIN, OutPart, TensorEncoder
from resumerge.inputs.gguf.ggmltypes import BF16
from resumerge.outputs.gguf.layout import slice_name
from resumerge.outputs.gguf.outcodec import GgufOutCodec

if TYPE_CHECKING:
    from resumerge.inputs.codecs.protocol import Lend
    from resumerge.machine.torch_import import torch

# The part of a fused gate_up stack holding its up rows (MAIN holds the gate rows).
UP = "up"


@dataclass(frozen=True)
class GgufStackCodec(GgufOutCodec):
    """An output tensor written into stacked GGUF experts tensors: expert ``expert``'s slice of ``gguf_name`` (a
    tensor stored per expert), or with ``up_name`` a fused gate_up stack whose gate rows go to ``gguf_name`` and up
    rows to ``up_name``."""

    name: ClassVar[str] = "gguf-out"

    expert: int = -1
    up_name: str = ""

    def out_parts(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[OutPart, ...]:
        if self.up_name:
            half = (shape[0], shape[1] // 2, *shape[2:])
            (gate,) = super().out_parts(name, dtype, half)
            return gate, OutPart(UP, self.up_name, gate.dtype, gate.shape)
        (whole,) = super().out_parts(name, dtype, shape)
        return (OutPart(MAIN, slice_name(self.gguf_name, self.expert), whole.dtype, whole.shape),)

    def encode(self, value: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
        if not self.up_name:
            return super().encode(value, dtype)
        from resumerge.machine.torch_import import torch

        half = value.shape[1] // 2
        # each half expert by expert with its own tensor's entry (GgufOutCodec._encoded; a chunk's first expert:
        # from_row)
        gate, up = (self._encoded(self._gguf_values(v), n) for v, n in ((value[:, :half], self.gguf_name),
                                                                          (value[:, half:], self.up_name)))
        if self.ggml_type == BF16:
            gate, up = gate.view(torch.bfloat16), up.view(torch.bfloat16)
        return {MAIN: gate, UP: up}

    @property
    def writes_into(self) -> bool:
        return not self.up_name  # two tensors' halves are encoded, then copied (encode_into)

    def encode_into(self, value: torch.Tensor, dtype: str, into: Mapping[str, torch.Tensor], *,
                    lend: Lend | None = None) -> None:
        if not self.up_name:
            return super().encode_into(value, dtype, into, lend=lend)
        # two tensors' halves: encoded, then copied to each part (the protocol's own encode_into)
        return TensorEncoder.encode_into(self, value, dtype, into)

    @property
    def slice_index(self) -> int:
        return self.expert

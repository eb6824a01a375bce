"""The plain codec: a tensor stored in its own dtype (float64 to float8, integers), read as a view of its bytes
and written by a cast — resumerge's whole tensor handling before quantized formats, unchanged."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from resumerge.inputs.codecs.protocol import MAIN, Claim, OutPart, TensorCodec
from resumerge.inputs.tensorio import TORCH_DTYPES

if TYPE_CHECKING:
    from resumerge.inputs.files import TensorSource
    from resumerge.machine.torch_import import torch


@dataclass(frozen=True)
class PlainCodec(TensorCodec):
    """A tensor that is its stored bytes: no companions, decoded by viewing, encoded by a cast. An F8 tensor
    without a quantized format's companions is plain too (its codes are its values)."""

    name: ClassVar[str] = "plain"

    @classmethod
    def recognise(cls, config: Mapping[str, Any], tensors: Mapping[str, TensorSource]) -> tuple[Claim, ...]:
        """Nothing: a tensor no other format claims is plain."""
        return ()

    @property
    def plain(self) -> bool:
        return True

    def value_dtype(self, stored: str) -> str:
        return stored

    def quantization_config(self, base: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """None: a plainly stored output is not quantized."""
        return None

    def decode(self, parts: Mapping[str, torch.Tensor], first_row: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return parts[MAIN]

    def out_parts(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[OutPart, ...]:
        return (OutPart(MAIN, name, dtype, shape),)

    def encode(self, value: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
        # A cast to the tensor's own dtype returns it: an input passed through unchanged is written as read.
        return {MAIN: value.to(TORCH_DTYPES[dtype])}


# The codec of every tensor no format claims (an immutable value: codecs hold no state).
PLAIN = PlainCodec()

"""The rotary embedding's inverse frequencies per RoPE type, computed in float32 in the order transformers computes
them (the frequencies are the same numbers to the bit: tests/check/test_native.py)."""

from __future__ import annotations

import math

from resumerge.forward.engine.native.config import Rope
from resumerge.machine.torch_import import torch


def inverse_frequencies(rope: Rope, head_dim: int) -> torch.Tensor:
    """The (head_dim / 2,) float32 inverse frequencies of ``rope`` for heads of ``head_dim``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    plain = 1.0 / (rope.theta ** exponents)
    if rope.kind == "default":
        return plain
    if rope.kind == "linear":
        return plain / rope.factor
    return _llama3(plain, rope)


def _llama3(plain: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by the factor, short ones kept, the band between blended."""
    low_wavelen = rope.original_max / rope.low_freq_factor
    high_wavelen = rope.original_max / rope.high_freq_factor
    wavelen = 2 * math.pi / plain
    scaled = torch.where(wavelen > low_wavelen, plain / rope.factor, plain)
    smooth = (rope.original_max / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)

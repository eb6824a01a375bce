"""MXFP4 against transformers 5.24's own conversion (``integrations.mxfp4.convert_moe_packed_tensors``, the layout
gpt-oss loads with, transpose included) and the encoder against OCP MX v1.0 as microsoft/microxcaling's
``_quantize_mx`` computes it (written out here: shared exponent floor(log2 amax) − 2, elements rounded to E2M1
with ties away from zero, saturating at ±6); round trips byte for byte."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resumerge.inputs.quant import mxfp4

transformers_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")


def _stored(experts: int, rows: int, groups: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (experts, rows, groups), dtype=torch.uint8, generator=g)
    return blocks, scales


@pytest.mark.parametrize(("experts", "rows", "groups"), [(3, 70, 5), (1, 1, 1), (2, 33, 90)])
def test_decode_is_transformers_conversion(experts: int, rows: int, groups: int) -> None:
    blocks, scales = _stored(experts, rows, groups, seed=rows)
    ours = mxfp4.decode(blocks, scales)
    assert ours.shape == (experts, groups * 32, rows) == mxfp4.decoded_shape(tuple(blocks.shape))
    reference = transformers_mxfp4.convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32)
    assert torch.equal(ours, reference)
    as_loaded = transformers_mxfp4.convert_moe_packed_tensors(blocks.clone(), scales.clone())
    assert torch.equal(ours.to(torch.bfloat16), as_loaded)


def test_decoded_scales_reach_the_ends_of_e8m0() -> None:
    blocks = torch.full((1, 1, 3, 16), 0x71, dtype=torch.uint8)  # +0.5 (low nibble 1), +6 (high nibble 7)
    scales = torch.tensor([[[0, 127, 254]]], dtype=torch.uint8)
    out = mxfp4.decode(blocks, scales)[0, :, 0]
    assert out[0].item() == 0.5 * 2.0 ** -127 and out[1].item() == 6.0 * 2.0 ** -127
    assert out[32].item() == 0.5 and out[33].item() == 6.0 and out[64].item() == 0.5 * 2.0 ** 127


def microxcaling(values: torch.Tensor) -> torch.Tensor:
    """OCP MX v1.0 fake quantization of ``[..., in, out]`` float32 values, grouped along ``in``: the float values
    microxcaling's ``_quantize_mx(A, 8, "fp4_e2m1", axes=[-1], block_size=32, round="nearest")`` returns."""
    x = values.transpose(-1, -2).reshape(*values.shape[:-2], values.shape[-1], -1, 32).to(torch.float64)
    amax = x.abs().amax(-1, keepdim=True)
    shared = torch.floor(torch.log2(torch.where(amax == 0, torch.full_like(amax, 2.0 ** -126), amax))) - 2
    shared = shared.clamp(-127, 127)
    scaled = x / 2.0 ** shared
    private = torch.floor(torch.log2(scaled.abs() + (scaled == 0))).clamp(min=0)  # E2M1: one mantissa bit
    step = 2.0 ** (private - 1)
    rounded = torch.sign(scaled) * torch.floor(scaled.abs() / step + 0.5) * step
    quantized = rounded.clamp(-6, 6) * 2.0 ** shared
    return quantized.reshape(*values.shape[:-2], values.shape[-1], -1).transpose(-1, -2).to(torch.float32)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_encode_is_ocp_mx_as_microxcaling_rounds(scale: float) -> None:
    values = torch.randn(2, 64, 40, generator=torch.Generator().manual_seed(9)) * scale
    values[0, :32, 0] = 0.0  # an all-zero group
    values[1, :32, 1] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 4)  # ties and saturation
    blocks, scales = mxfp4.encode(values)
    assert blocks.shape == (2, 40, 2, 16) and scales.shape == (2, 40, 2)
    assert scales[0, 0, 0].item() == 0
    assert torch.equal(mxfp4.decode(blocks, scales), microxcaling(values))


def test_the_sign_of_zero_is_kept() -> None:
    values = torch.zeros(1, 32, 1)
    values[0, 0, 0], values[0, 1, 0], values[0, 2, 0] = -0.0, -1e-9, 4.0
    blocks, _ = mxfp4.encode(values)
    assert blocks[0, 0, 0, 0].item() == 0x88  # codes 8 (−0) and 8 (−1e-9 rounds to −0)
    assert blocks[0, 0, 0, 1].item() & 0x0F == 6  # 4.0 / 2^0 is code 6


def test_a_width_that_is_not_a_multiple_of_32_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.encode(torch.zeros(1, 40, 3))


@settings(deadline=None, max_examples=30)
@given(experts=st.integers(1, 3), groups=st.integers(1, 3), rows=st.integers(1, 20), seed=st.integers(0, 2**16),
       magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 1e20]))
def test_stored_tensors_survive_decode_then_encode(experts: int, groups: int, rows: int, seed: int,
                                                   magnitude: float) -> None:
    values = torch.randn(experts, groups * 32, rows, generator=torch.Generator().manual_seed(seed)) * magnitude
    blocks, scales = mxfp4.encode(values)
    again_blocks, again_scales = mxfp4.encode(mxfp4.decode(blocks, scales))
    assert torch.equal(again_blocks, blocks)
    assert torch.equal(again_scales, scales)
    assert math.isfinite(mxfp4.decode(blocks, scales).abs().max().item())

"""NVFP4's kernels against its producers: compressed-tensors' own compress and dequantize (the library, a
test-only oracle) byte for byte and bit for bit, and NVIDIA ModelOpt's formula as reference/kquants.md §7 gives it
(written out in ``quantmodels`` by distance to each E2M1 value, not by thresholds); ties, zero blocks and −0."""

from __future__ import annotations

import pytest
import torch
from quantmodels import compressed_tensors_nvfp4, modelopt_nvfp4

from resumerge.inputs.quant import nvfp4

pytest.importorskip("compressed_tensors")


def _weights(scale: float, seed: int) -> torch.Tensor:
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(seed)) * scale
    w[0, :16] = 0.0  # an all-zero block
    w[1, 16:32] = -1e-30 * scale  # a block of negatives that round to zero
    # Ties of the E2M1 grid once scaled by the block's amax (6 maps to 6): 0.25, 0.75, ..., 5 and saturation.
    w[2, :16] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
                              -6]) * scale
    return w


@pytest.mark.parametrize("scale", [1e-4, 0.02, 1.0, 300.0])
def test_encode_is_compressed_tensors_compress_byte_for_byte(scale: float) -> None:
    w = _weights(scale, seed=int(scale * 1000) % 97)
    library = compressed_tensors_nvfp4(w)
    packed, block, tensor = nvfp4.encode(w, "compressed-tensors")
    assert torch.equal(packed, library["weight_packed"])
    assert torch.equal(block.view(torch.uint8), library["weight_scale"].view(torch.uint8))
    assert torch.equal(tensor, library["weight_global_scale"])
    assert block[0, 0].to(torch.float32).item() == 0.125  # its zero block's scale
    assert torch.equal(nvfp4.decode(packed, block, tensor, "compressed-tensors"), library["value"])


@pytest.mark.parametrize("scale", [1e-4, 0.02, 1.0, 300.0])
def test_encode_and_decode_are_modelopt_s_formula(scale: float) -> None:
    w = _weights(scale, seed=3)
    reference = modelopt_nvfp4(w)
    packed, block, tensor = nvfp4.encode(w, "modelopt")
    assert torch.equal(packed, reference["weight"])
    assert torch.equal(block.view(torch.uint8), reference["weight_scale"].view(torch.uint8))
    assert torch.equal(tensor.reshape(()), reference["weight_scale_2"])
    assert block[0, 0].to(torch.float32).item() == 1.0  # ModelOpt's zero block
    assert torch.equal(nvfp4.decode(packed, block, tensor, "modelopt"), reference["value"])


def test_decode_of_any_stored_bytes_is_the_librarys() -> None:
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    g = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (7, 40), dtype=torch.uint8, generator=g)
    block = (torch.rand(7, 5, generator=g) * 400).to(torch.float8_e4m3fn)
    tensor = torch.tensor([1234.5])
    codes = unpack_fp4_from_uint8(packed, 7, 80, dtype=torch.float32)
    want = codes * (block.to(torch.float32) / tensor).repeat_interleave(16, dim=1)
    assert torch.equal(nvfp4.decode(packed, block, tensor, "compressed-tensors"), want)
    out = torch.full((7, 80), 9.0)
    assert nvfp4.decode(packed, block, tensor, "compressed-tensors", out=out) is out and torch.equal(out, want)


def test_the_sign_of_a_value_rounded_to_zero_is_each_producers() -> None:
    scaled = torch.tensor([-0.1, -0.0, 0.1, -0.25, 0.25, -0.26])
    assert nvfp4.e2m1_codes(scaled, negative_zero=True).tolist() == [8, 8, 0, 8, 0, 9]
    assert nvfp4.e2m1_codes(scaled, negative_zero=False).tolist() == [0, 0, 0, 0, 0, 9]


def test_a_width_that_is_not_whole_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="whole 16-value blocks"):
        nvfp4.encode(torch.ones(2, 24), "modelopt")

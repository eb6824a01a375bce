"""Block FP8 against DeepSeek-V3's published dequantization (README_WEIGHTS.md: "(128x128 weight block) *
weight_scale_inv", the tail masked as ``inference/kernel.py weight_dequant_kernel`` does), written out block by
block here; encode against the rule of DeepSeek's ``act_quant_kernel`` (s = amax / 448, codes w / s clamped to
±448); round trips byte for byte. Shapes are not multiples of the block."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resumerge.inputs.quant import fp8_block
from resumerge.inputs.quant.grid import grid_rows

BLOCK = (128, 128)


def deepseek_dequant(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The published formula, one block at a time: every element of block (i, j) times scale_inv[i, j]."""
    rows, cols = codes.shape
    out = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(math.ceil(rows / block[0])):
        for j in range(math.ceil(cols / block[1])):
            r = slice(i * block[0], min(rows, (i + 1) * block[0]))
            c = slice(j * block[1], min(cols, (j + 1) * block[1]))
            out[r, c] = codes[r, c].to(torch.float32) * scale_inv[i, j].to(torch.float32)
    return out


def deepseek_quant(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's rule per block (scale 1 for an all-zero block, the convention resumerge takes)."""
    rows, cols = w.shape
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            r = slice(i * block[0], min(rows, (i + 1) * block[0]))
            c = slice(j * block[1], min(cols, (j + 1) * block[1]))
            amax = w[r, c].abs().max()
            s = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            scales[i, j] = s
            codes[r, c] = torch.clamp(w[r, c] / s, -448.0, 448.0).to(torch.float8_e4m3fn)
    return codes, scales


def _bytes(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.uint8)


def _random_codes(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Every finite E4M3 byte (0x7F and 0xFF are NaN), uniformly."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
    raw[(raw & 0x7F) == 0x7F] = 0x7E
    return raw.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("shape", [(300, 270), (576, 7168 // 16), (1, 1), (129, 127), (128, 256)])
def test_decode_matches_deepseek_formula_on_partial_blocks(shape: tuple[int, int]) -> None:
    rows, cols = shape
    codes = _random_codes(rows, cols, seed=rows * 7 + cols)
    scales = torch.rand(math.ceil(rows / 128), math.ceil(cols / 128)) * 1e-3 + 1e-6
    assert torch.equal(fp8_block.decode(codes, scales, BLOCK), deepseek_dequant(codes, scales, BLOCK))


def test_decode_takes_any_block_size_and_scale_dtype() -> None:
    codes = _random_codes(100, 90, seed=3)
    scales = (torch.rand(7, 4) + 0.5).to(torch.bfloat16)
    assert torch.equal(fp8_block.decode(codes, scales, (16, 24)), deepseek_dequant(codes, scales, (16, 24)))


@pytest.mark.parametrize(("start", "stop"), [(0, 300), (0, 1), (100, 260), (127, 129), (256, 300), (128, 256)])
def test_a_row_chunk_decodes_to_the_same_rows(start: int, stop: int) -> None:
    codes = _random_codes(300, 270, seed=11)
    scales = torch.rand(3, 3) + 0.1
    whole = fp8_block.decode(codes, scales, BLOCK)
    first, last = grid_rows(start, stop, BLOCK)
    out = torch.full((stop - start, 270), float("nan"))
    part = fp8_block.decode(codes[start:stop], scales[first:last], BLOCK, row_start=start, out=out)
    assert part is out
    assert torch.equal(part, whole[start:stop])


@pytest.mark.parametrize("shape", [(300, 270), (129, 1), (1, 300), (256, 128)])
def test_encode_follows_deepseeks_rule(shape: tuple[int, int]) -> None:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(5)) * 0.02
    w[:128, :128] = 0.0  # one all-zero block
    codes, scales = fp8_block.encode(w.clone(), BLOCK)
    ref_codes, ref_scales = deepseek_quant(w, BLOCK)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(_bytes(codes), _bytes(ref_codes))
    assert scales[0, 0] == 1.0


def test_decode_then_encode_gives_the_stored_codes_and_scales_back() -> None:
    w = torch.randn(300, 270, generator=torch.Generator().manual_seed(1)) * 0.05
    w[128:256, 128:256] = 0.0
    codes, scales = fp8_block.encode(w.clone(), BLOCK)
    again_codes, again_scales = fp8_block.encode(fp8_block.decode(codes, scales, BLOCK), BLOCK)
    assert torch.equal(_bytes(again_codes), _bytes(codes))
    assert torch.equal(again_scales, scales)


@settings(deadline=None, max_examples=40)
@given(rows=st.integers(1, 70), cols=st.integers(1, 70), bh=st.integers(1, 33), bw=st.integers(1, 33),
       magnitude=st.sampled_from([1e-30, 1e-6, 0.02, 3.0, 1e6]), seed=st.integers(0, 2**16),
       ue8m0=st.booleans())
def test_round_trip_is_byte_exact_for_any_shape_and_block(rows: int, cols: int, bh: int, bw: int, magnitude: float,
                                                           seed: int, ue8m0: bool) -> None:
    fmt = "ue8m0" if ue8m0 else "float"
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * magnitude
    codes, scales = fp8_block.encode(w.clone(), (bh, bw), scale_fmt=fmt)
    decoded = fp8_block.decode(codes, scales, (bh, bw))
    assert torch.isfinite(decoded).all()
    again_codes, again_scales = fp8_block.encode(decoded.clone(), (bh, bw), scale_fmt=fmt)
    assert torch.equal(_bytes(again_codes), _bytes(codes))
    assert torch.equal(again_scales, scales)


def test_ue8m0_scales_are_powers_of_two_that_keep_the_largest_code_above_224() -> None:
    w = torch.tensor([[448.0, 448.0 * 1.0001, 3.0, 0.0, 500.0]])
    codes, scales = fp8_block.encode(w.clone(), (1, 1), scale_fmt="ue8m0")
    # 448.0448 / 2 rounds to the code 224: the same number is 448 · 1, which decodes and encodes back to itself.
    assert scales.tolist() == [[1.0, 1.0, 2.0 ** math.ceil(math.log2(3.0 / 448.0)), 1.0, 2.0]]
    assert codes.float().tolist() == [[448.0, 448.0, 384.0, 0.0, 256.0]]


def test_values_beyond_the_range_clamp_to_448_instead_of_becoming_nan() -> None:
    codes, scales = fp8_block.encode(torch.tensor([[3.0e38, 1.0, -3.0e38]]), (1, 3))
    assert codes.float().tolist() == [[448.0, 0.0, -448.0]]
    assert torch.isfinite(scales).all()


@pytest.mark.parametrize(("dtype", "fmt"), [(torch.bfloat16, "float"), (torch.float8_e8m0fnu, "ue8m0")])
def test_codes_are_computed_with_the_scale_as_it_is_stored(dtype: torch.dtype, fmt: str) -> None:
    w = torch.randn(130, 140, generator=torch.Generator().manual_seed(2)) * 0.02
    codes, scales = fp8_block.encode(w.clone(), BLOCK, scale_fmt=fmt, scale_dtype=dtype)
    assert scales.dtype == dtype
    stored = scales.to(torch.float32).repeat_interleave(128, 0).repeat_interleave(128, 1)[:130, :140]
    expected = torch.clamp(w / stored, -448.0, 448.0).to(torch.float8_e4m3fn)
    assert torch.equal(_bytes(codes), _bytes(expected))
    assert torch.equal(fp8_block.decode(codes, scales, BLOCK), deepseek_dequant(codes, scales, BLOCK))


def test_fused_experts_decode_expert_by_expert() -> None:
    codes = _random_codes(3 * 130, 140, seed=8).view(3, 130, 140)
    scales = torch.rand(3, 2, 2) + 0.1
    fused = fp8_block.decode(codes, scales, BLOCK)
    for expert in range(3):
        assert torch.equal(fused[expert], deepseek_dequant(codes[expert], scales[expert], BLOCK))


def test_encoding_chunks_that_start_at_block_rows_gives_the_whole_tensors_bytes() -> None:
    w = torch.randn(300, 270, generator=torch.Generator().manual_seed(4)) * 0.02
    codes, scales = fp8_block.encode(w.clone(), BLOCK)
    parts = [fp8_block.encode(w[a:b].clone(), BLOCK) for a, b in ((0, 128), (128, 256), (256, 300))]
    assert torch.equal(torch.cat([_bytes(c) for c, _ in parts]), _bytes(codes))
    assert torch.equal(torch.cat([s for _, s in parts]), scales)


def test_encoding_reads_its_values_only_and_spans_several_slabs() -> None:
    # 1100 rows of 270: more than one slab of whole block rows (at least 2^18 values each), the last partial.
    w = torch.randn(1100, 270, generator=torch.Generator().manual_seed(5)) * 0.02
    kept = w.clone()
    codes, scales = fp8_block.encode(w, BLOCK)
    assert torch.equal(w, kept)
    expected_codes, expected_scales = deepseek_quant(w, BLOCK)
    assert torch.equal(_bytes(codes), _bytes(expected_codes))
    assert torch.equal(scales, expected_scales)

"""resumerge's own GGUF encoders and decoders (torch, :mod:`resumerge.outputs.gguf.encoders` and
:mod:`resumerge.inputs.gguf.blocks`) give the bytes and values
gguf-py's ``quants`` give: Q8_0 (llama.cpp's reference rounding, halves away from zero), Q4_0, Q4_1, Q5_0, Q5_1
(truncation of a shifted code), F16, BF16 — on normal values, exact ties, zeros and -0, all-zero and all-equal blocks,
negative maxima, huge and tiny values, random float bit patterns, and every row count a row chunk can have; and
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q6_K bytes (every bit pattern) decode to gguf-py's values."""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch

from resumerge.inputs.gguf import blocks, ggmltypes
from resumerge.outputs.gguf import encoders

KINDS = {name: gguf.GGMLQuantizationType[name.upper()] for name in
         ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "f16", "bf16")}
LEGACY = ("q4_0", "q4_1", "q5_0", "q5_1")


def _reference(values: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    with warnings.catch_warnings():  # gguf-py's numpy warns on overflow to inf, as it should
        warnings.simplefilter("ignore")
        encoded = gguf.quants.quantize(values, kind)
    return np.ascontiguousarray(encoded).view(np.uint8).reshape(values.shape[0], -1)


def _ours(values: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    encoded = encoders.encode(torch.from_numpy(values.copy()), int(kind)).contiguous()
    return encoded.view(torch.uint8).numpy().reshape(values.shape[0], -1)


def _cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(58)
    ties = rng.integers(-254, 255, (48, 128)).astype(np.float32) / 2  # x * (1/d) lands on k + 0.5 ...
    ties[:, ::32] = 127  # ... with d = 1
    near_ties = ties + np.float32(2**-20) * rng.choice([-1, 1], ties.shape).astype(np.float32)
    zeros = np.zeros((6, 96), np.float32)
    zeros[1, 3] = 1e-30  # one tiny value in an otherwise zero block
    zeros[2, 32:64] = -0.0
    zeros[3] = 3e38  # d overflows float16
    zeros[4, :32] = -1e-38  # subnormal-scale blocks
    zeros[5, 64:] = rng.standard_normal(32).astype(np.float32)
    scales = (rng.standard_normal((32, 64)) * 10.0 ** rng.integers(-35, 35, (32, 64))).astype(np.float32)
    bits = rng.integers(0, 2**32, (64, 256), dtype=np.uint64).astype(np.uint32).view(np.float32)
    bits = np.where(np.isfinite(bits), bits, np.float32(0)).astype(np.float32)
    equal = np.repeat(rng.standard_normal((8, 1), dtype=np.float32), 96, axis=1)  # d = 0 for the affine types
    equal[0] = 0.0
    negative = -np.abs(rng.standard_normal((9, 64), dtype=np.float32))  # the largest magnitude is negative ...
    negative[1, 5] = -negative[1, 5].min() + 1  # ... or positive in one block
    negative[2, :32] = -1.0  # ties of the largest magnitude: the first is the scale's sign ...
    negative[2, 7] = 1.0
    negative[3, 32:] = 1.0  # ... whichever sign comes first
    negative[3, 40] = -1.0
    signed = rng.standard_normal((12, 64), dtype=np.float32)  # -0 among non-zero values, never a block's extreme
    signed[rng.random(signed.shape) < 0.2] = -0.0
    signed[0, 32:] = np.where(rng.random(32) < 0.5, np.float32(-0.0), np.float32(1.0))  # -0 as the min
    signed[1, :32] = np.where(rng.random(32) < 0.5, np.float32(-0.0), np.float32(-2.0))  # -0 as the max
    return {"normal": rng.standard_normal((37, 160), dtype=np.float32) * np.float32(0.02), "ties": ties,
            "near_ties": near_ties, "zeros": zeros, "scales": scales, "bits": bits,
            "one_block": rng.standard_normal((1, 32), dtype=np.float32), "equal": equal, "negative": negative,
            "signed_zeros": signed}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("case", sorted(_cases()))
def test_our_encoding_is_byte_equal_to_gguf_py_s_quantizer(case: str, kind: str) -> None:
    values = _cases()[case]
    assert np.array_equal(_ours(values, KINDS[kind]), _reference(values, KINDS[kind]))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_row_chunks_encode_as_the_whole_does(kind: str) -> None:
    values = np.random.default_rng(1).standard_normal((29, 96), dtype=np.float32)
    whole = _reference(values, KINDS[kind])
    for rows in (1, 2, 5, 7, 29):
        chunks = [_ours(values[at:at + rows], KINDS[kind]) for at in range(0, values.shape[0], rows)]
        assert np.array_equal(np.concatenate(chunks), whole)


def test_ties_round_half_away_from_zero() -> None:
    values = np.array([[127, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997] + [0] * 24], np.float32)
    q = _ours(values, KINDS["q8_0"])[0, 2:10].view(np.int8)
    assert q.tolist() == [127, 1, -1, 2, -2, 3, -3, 0]


def test_a_nan_encodes_to_bf16_as_gguf_py_keeps_it() -> None:
    values = np.array([[np.nan, -np.nan, 1.0, np.inf]], np.float32)
    values[0, 0] = np.uint32(0x7FA00001).view(np.float32)  # a signalling NaN with payload
    assert np.array_equal(_ours(values, KINDS["bf16"]), _reference(values, KINDS["bf16"]))


@pytest.mark.parametrize("rows", [9, 1])
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"])
def test_random_blocks_decode_as_gguf_py_dequantizes(kind: str, rows: int) -> None:
    qtype = gguf.GGMLQuantizationType[kind]
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    width = 3 if rows > 1 else 20_000 * 32 // values  # one row of more blocks than a decoded chunk holds
    stored = np.random.default_rng(int(qtype)).integers(0, 256, (rows, width * size), dtype=np.uint8)  # all bits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = gguf.quants.dequantize(stored, qtype)
    ours = blocks.decode(torch.from_numpy(stored), int(qtype)).numpy()
    assert ours.shape == expected.shape == (rows, width * values)
    assert np.array_equal(ours, expected, equal_nan=True)
    into = torch.full(expected.shape, 7.0)
    assert blocks.decode(torch.from_numpy(stored), int(qtype), into) is into
    assert np.array_equal(into.numpy(), expected, equal_nan=True)


@pytest.mark.parametrize("case", ["normal", "zeros", "scales", "bits"])
def test_q8_0_decodes_as_gguf_py_dequantizes(case: str) -> None:
    stored = _reference(_cases()[case], KINDS["q8_0"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = gguf.quants.dequantize(stored, KINDS["q8_0"])
    ours = blocks.decode(torch.from_numpy(stored), ggmltypes.Q8_0).numpy()
    assert np.array_equal(ours, expected, equal_nan=True)
    into = torch.full(expected.shape, 7.0)
    assert blocks.decode(torch.from_numpy(stored), ggmltypes.Q8_0, into) is into
    assert np.array_equal(into.numpy(), expected, equal_nan=True)


def test_the_legacy_codes_are_llama_cpp_s() -> None:
    # Q4_0: d = -1/8 from the max 1 (negated), q = trunc(x * -8 + 8.5): 1 -> 0, -1 -> 16 clipped to 15, 0 -> 8
    values = np.array([[1.0, -1.0, 0.0, 0.5, -0.5, 0.0625, 0.0624] + [0.0] * 25], np.float32)
    encoded = _ours(values, KINDS["q4_0"])[0]
    assert encoded[:2].view(np.float16)[0] == np.float16(-0.125)
    codes = np.concatenate([encoded[2:] & 0x0F, encoded[2:] >> 4])
    assert codes[:7].tolist() == [0, 15, 8, 4, 12, 8, 8]
    # Q5_1: d = (max - min) / 31, m = min, q = trunc((x - min) / d + 0.5); code 16 and above set a high bit
    values = np.linspace(-1.0, 2.1, 32, dtype=np.float32)[None]
    encoded = _ours(values, KINDS["q5_1"])[0]
    high = encoded[4:8].view(np.uint32)[0]
    codes = np.concatenate([encoded[8:] & 0x0F, encoded[8:] >> 4]) | (((high >> np.arange(32)) & 1) << 4)
    assert codes.tolist() == list(range(32))
    assert encoded[2:4].view(np.float16)[0] == np.float16(-1.0)


@pytest.mark.parametrize("kind", ["q4_1", "q5_1"])
def test_a_zero_extreme_of_both_signs_takes_the_first_as_llama_cpp_does(kind: str) -> None:
    # gguf-py's numpy returns whichever zero its SIMD lanes meet last (it varies by machine); llama.cpp the first
    values = np.abs(np.random.default_rng(2).standard_normal((2, 32), dtype=np.float32)) + 1
    values[0, 3], values[0, 9] = -0.0, 0.0
    values[1, 3], values[1, 9] = 0.0, -0.0
    encoded = _ours(values, KINDS[kind])
    assert encoded[0, 2:4].tolist() == [0x00, 0x80] and encoded[1, 2:4].tolist() == [0x00, 0x00]  # m = -0, +0
    reference = _reference(values, KINDS[kind])
    assert np.array_equal(encoded[:, :2], reference[:, :2]) and np.array_equal(encoded[:, 4:], reference[:, 4:])


@pytest.mark.parametrize("kind", LEGACY)
def test_legacy_blocks_decode_as_gguf_py_dequantizes_bit_for_bit(kind: str) -> None:
    qtype = KINDS[kind]
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    stored = np.random.default_rng(int(qtype)).integers(0, 256, (64, 5 * size), dtype=np.uint8)  # NaN scales too
    for row in range(8):  # scales (and an offset) that are float16 NaNs of both signs, with payloads
        stored[row, :2] = stored[row, size + 2:size + 4] = [0x01 + row, 0x7D if row % 2 else 0xFD]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = gguf.quants.dequantize(stored, qtype)
    into = torch.full(expected.shape, 7.0)
    assert blocks.decode(torch.from_numpy(stored), int(qtype), into) is into
    assert np.isnan(expected).any() and np.array_equal(into.numpy().view(np.uint32), expected.view(np.uint32))
    for case in ("normal", "zeros", "scales", "equal"):
        stored = _reference(_cases()[case], qtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = gguf.quants.dequantize(stored, qtype)
        ours = blocks.decode(torch.from_numpy(stored), int(qtype)).numpy()
        assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))

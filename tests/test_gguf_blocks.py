"""resumerge's own GGUF encoders and decoders (torch, :mod:`resumerge.inputs.gguf.blocks`) give the bytes and values
gguf-py's ``quants`` give: Q8_0 (llama.cpp's reference rounding, halves away from zero), F16, BF16 — on normal values,
exact ties, zeros, all-zero blocks, huge and tiny values, random float bit patterns, and every row count a row chunk
can have; and Q8_0, Q4_K and Q6_K bytes (every bit pattern) decode to gguf-py's values."""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch

from resumerge.inputs.gguf import blocks

KINDS = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "f16": gguf.GGMLQuantizationType.F16,
         "bf16": gguf.GGMLQuantizationType.BF16}


def _reference(values: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    with warnings.catch_warnings():  # gguf-py's numpy warns on overflow to inf, as it should
        warnings.simplefilter("ignore")
        encoded = gguf.quants.quantize(values, kind)
    return np.ascontiguousarray(encoded).view(np.uint8).reshape(values.shape[0], -1)


def _ours(values: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    encoded = blocks.encode(torch.from_numpy(values.copy()), int(kind)).contiguous()
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
    return {"normal": rng.standard_normal((37, 160), dtype=np.float32) * np.float32(0.02), "ties": ties,
            "near_ties": near_ties, "zeros": zeros, "scales": scales, "bits": bits,
            "one_block": rng.standard_normal((1, 32), dtype=np.float32)}


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
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K"])
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
    ours = blocks.decode(torch.from_numpy(stored), blocks.Q8_0).numpy()
    assert np.array_equal(ours, expected, equal_nan=True)
    into = torch.full(expected.shape, 7.0)
    assert blocks.decode(torch.from_numpy(stored), blocks.Q8_0, into) is into
    assert np.array_equal(into.numpy(), expected, equal_nan=True)

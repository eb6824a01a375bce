"""compressed-tensors against the library itself (0.20, a test-only dependency): its ``pack_to_int32`` /
``unpack_from_int32``, ``calculate_qparams`` and its compressors' ``compress`` / ``decompress``, for every strategy,
symmetric and asymmetric, with widths that are not multiples of the group, block or packing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from quantmodels import library_extremes

from resumerge.inputs.quant import compressed_tensors as ct
from resumerge.inputs.quant import int_pack
from resumerge.inputs.quant.grid import grid_rows

ctl = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402


def _block(args: QuantizationArgs, shape: tuple[int, int]) -> tuple[int, int]:
    return ct.strategy_block(str(args.strategy), shape, group_size=args.group_size,
                             block_structure=tuple(args.block_structure) if args.block_structure else None)


def _library(w: torch.Tensor, args: QuantizationArgs, compressor: Any) -> tuple[dict[str, torch.Tensor], Any]:
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    scale, zero_point = calculate_qparams(*library_extremes(w, str(args.strategy), args.group_size,
                                                           args.block_structure), args)
    if args.scale_dtype is not None:
        scale = scale.to(args.scale_dtype)
    state = {"weight": w.clone(), "weight_scale": scale}
    if not args.symmetric:
        state["weight_zero_point"] = zero_point
    return compressor.compress(state, scheme), scheme


INT_CASES = [
    dict(num_bits=4, strategy="group", group_size=32, symmetric=True),
    dict(num_bits=4, strategy="group", group_size=32, symmetric=False),
    dict(num_bits=4, strategy="channel", symmetric=True),
    dict(num_bits=4, strategy="channel", symmetric=False),
    dict(num_bits=4, strategy="tensor", symmetric=True),
    dict(num_bits=2, strategy="group", group_size=16, symmetric=True),
    dict(num_bits=8, strategy="channel", symmetric=True),
    dict(num_bits=8, strategy="group", group_size=16, symmetric=False),
    dict(num_bits=4, strategy="group", group_size=32, symmetric=True, scale_dtype=torch.bfloat16),
]


@pytest.mark.parametrize("case", INT_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("shape", [(37, 96), (9, 100)])
def test_pack_quantized_matches_the_library(case: dict[str, Any], shape: tuple[int, int]) -> None:
    rows, cols = shape
    if case["strategy"] == "group" and cols % case["group_size"]:
        cols = 3 * case["group_size"]  # compressed-tensors refuses a group that does not divide the width
        shape = (rows, cols)
    args = QuantizationArgs(type="int", **case)
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols)) * 0.05
    stored, scheme = _library(w, args, PackedQuantizationCompressor)
    block = _block(args, shape)
    bits = args.num_bits
    scale_dtype = args.scale_dtype or torch.float32

    codes, scale, zero_point = ct.quantize(w.clone(), block, bits=bits, symmetric=args.symmetric,
                                           scale_dtype=scale_dtype)
    assert torch.equal(int_pack.pack(codes, bits), stored["weight_packed"])
    words, _, _ = ct.quantize(w.clone(), block, bits=bits, symmetric=args.symmetric, scale_dtype=scale_dtype,
                              packed=True)
    assert torch.equal(words, stored["weight_packed"])
    assert torch.equal(scale.reshape(stored["weight_scale"].shape), stored["weight_scale"])
    unpacked_zp = None
    if not args.symmetric:
        assert zero_point is not None
        assert torch.equal(ct.pack_zero_point(zero_point, bits), stored["weight_zero_point"])
        unpacked_zp = ct.unpack_zero_point(stored["weight_zero_point"], bits, rows)

    expected = PackedQuantizationCompressor.decompress(dict(stored), scheme)["weight"]
    decoded = ct.decode_packed(stored["weight_packed"], stored["weight_scale"], block, bits=bits, cols=cols,
                               zero_point=unpacked_zp)
    assert decoded.dtype == torch.float32
    # The library multiplies in the scale's dtype: float32 is exact, one rounding to bfloat16 is what it gets.
    assert torch.equal(decoded.to(expected.dtype), expected)

    if args.strategy in ("channel", "tensor"):
        # Before weight_shape's payload is read, the grid's block is as wide as the packed words could hold.
        wide = (block[0], stored["weight_packed"].shape[1] * (32 // bits))
        assert torch.equal(ct.decode_packed(stored["weight_packed"], stored["weight_scale"], wide, bits=bits,
                                            cols=cols, zero_point=unpacked_zp), decoded)

    # An unchanged tensor, encoded with its stored parameters, gives its stored codes back.
    again, _, _ = ct.quantize(decoded.clone(), block, bits=bits, scale=stored["weight_scale"], zero_point=unpacked_zp)
    assert torch.equal(int_pack.pack(again, bits), stored["weight_packed"])

    start, stop = rows // 3, rows - 1
    first, last = grid_rows(start, stop, block)
    part = ct.decode_packed(stored["weight_packed"][start:stop], stored["weight_scale"].reshape(-1, 1)[first:last]
                            if args.strategy == "tensor" else stored["weight_scale"][first:last], block, bits=bits,
                            cols=cols, zero_point=None if unpacked_zp is None else unpacked_zp[first:last],
                            row_start=start)
    assert torch.equal(part, decoded[start:stop])


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("cols", [1, 7, 8, 33, 100])
def test_packing_is_the_librarys(bits: int, cols: int) -> None:
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    values = torch.randint(low, high + 1, (6, cols), dtype=torch.int8, generator=torch.Generator().manual_seed(cols))
    words = pack_to_int32(values, bits)
    assert torch.equal(int_pack.pack(values, bits), words)
    assert torch.equal(int_pack.unpack(words, bits, cols), unpack_from_int32(words, bits, torch.Size([6, cols])))
    assert torch.equal(int_pack.unpack(words, bits, cols), values)


def test_int4_nibbles_are_offset_binary_as_the_reference_worked_example() -> None:
    values = torch.tensor([[-8, -1, 0, 7, 1, 2, 3, -3]], dtype=torch.int8)
    assert int_pack.pack(values, 4).item() & 0xFFFFFFFF == 0x5BA9F870


@pytest.mark.parametrize("bits", [1, 3, 5, 6, 7])
def test_odd_widths_are_refused_by_the_packer(bits: int) -> None:
    with pytest.raises(ValueError, match="pack-quantized widths"):
        int_pack.pack(torch.zeros(1, 8, dtype=torch.int8), bits)


def test_words_of_another_width_are_refused_not_half_decoded() -> None:
    # int8 "words" would fill a quarter of the output and leave the rest uninitialised: a result that differed
    # run to run (seen on a GPU, where fresh memory is zeros, against the CPU's leftovers).
    with pytest.raises(ValueError, match="int32"):
        int_pack.unpack(torch.zeros(3, 3, dtype=torch.int8), 2, 48)


NAIVE_CASES = [
    dict(type="int", num_bits=8, strategy="channel", symmetric=True),
    dict(type="int", num_bits=8, strategy="tensor", symmetric=False),
    dict(type="float", num_bits=8, strategy="channel", symmetric=True),
    dict(type="float", num_bits=8, strategy="tensor", symmetric=True),
    dict(type="float", num_bits=8, strategy="block", block_structure=[16, 32], symmetric=True),
    dict(type="int", num_bits=8, strategy="block", block_structure=[16, 32], symmetric=True),
]


@pytest.mark.parametrize("case", NAIVE_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_naive_and_float_quantized_match_the_library(case: dict[str, Any]) -> None:
    rows, cols = 37, 70
    args = QuantizationArgs(**case)
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(3)) * 0.05
    stored, scheme = _library(w, args, NaiveQuantizationCompressor)
    block = _block(args, (rows, cols))
    kind = str(args.type)
    codes, scale, zero_point = ct.quantize(w.clone(), block, bits=8, kind=kind, symmetric=args.symmetric)
    assert torch.equal(codes.view(torch.uint8), stored["weight"].view(torch.uint8))
    assert torch.equal(scale.reshape(stored["weight_scale"].shape), stored["weight_scale"])
    if not args.symmetric:
        assert zero_point is not None
        assert torch.equal(zero_point.reshape(stored["weight_zero_point"].shape), stored["weight_zero_point"])
    expected = NaiveQuantizationCompressor.decompress(dict(stored), scheme)["weight"]
    decoded = ct.decode_naive(stored["weight"], stored["weight_scale"], block,
                              zero_point=stored.get("weight_zero_point"))
    assert torch.equal(decoded, expected)


def test_an_all_zero_group_gets_the_scale_dtypes_eps() -> None:
    w = torch.zeros(2, 32)
    w[1, 0] = 1.0
    _, scale, _ = ct.quantize(w.clone(), (1, 32), bits=4, scale_dtype=torch.bfloat16)
    assert scale[0, 0].item() == torch.finfo(torch.bfloat16).eps
    assert scale[1, 0].item() == pytest.approx(1 / 7.5, rel=1e-2)


@pytest.mark.parametrize("rows", [1, 5, 8, 9])
def test_zero_points_pack_along_rows_and_back(rows: int) -> None:
    # compressed-tensors 0.20's own decompress fails when the packed zero points have one row (rows <= 8 at
    # INT4): its unpack views a transposed [groups, 1] tensor as bytes. The kernels here take it through 1-D.
    zero_point = torch.randint(-8, 8, (rows, 3), dtype=torch.int8, generator=torch.Generator().manual_seed(rows))
    packed = ct.pack_zero_point(zero_point, 4)
    assert torch.equal(packed, pack_to_int32(zero_point, 4, packed_dim=0))
    assert torch.equal(ct.unpack_zero_point(packed, 4, rows), zero_point)

"""DeepSeek-V4's FP4 experts (``X.weight`` I8, two E2M1 codes a byte, ``X.scale`` F8_E8M0 per 32 inputs) against
transformers 5.24's own dequantization (``Fp8Dequantize``, what ``from_pretrained`` runs on a CPU), any row chunk;
encoded back byte for byte; recognised beside block FP8 whose scale is ``X.scale``, and written under those names."""

from __future__ import annotations

import pytest
import torch

from resumerge.errors import ModelInputError
from resumerge.inputs.codecs.fp4 import Fp4Codec
from resumerge.inputs.codecs.fp8_block import BlockFp8Codec, DottedFp8Codec
from resumerge.inputs.codecs.protocol import MAIN
from resumerge.inputs.codecs.quantized import SCALE, recognise

finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")


def _stored(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g).view(torch.int8)
    scales = torch.randint(110, 135, (rows, cols // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    return codes, scales


@pytest.mark.parametrize(("rows", "cols"), [(7, 64), (1, 32), (40, 96)])
def test_decode_is_transformers_dequantization(rows: int, cols: int) -> None:
    codes, scales = _stored(rows, cols, seed=rows)
    codec = Fp4Codec()
    ours = codec.decode({MAIN: codes, SCALE: scales}, 0)
    assert ours.shape == (rows, cols) == codec.value_shape(tuple(codes.shape))
    reference = finegrained.Fp8Dequantize(None)._dequantize_one(codes, scales, output_dtype=torch.float32)
    assert torch.equal(ours, reference)
    first = rows // 2  # rows are independent: a chunk decodes alone
    assert torch.equal(codec.decode({MAIN: codes[first:], SCALE: scales[first:]}, first), reference[first:])


def test_an_encoded_value_decodes_and_encodes_back_byte_for_byte() -> None:
    codec = Fp4Codec()
    value = torch.randn(12, 64, generator=torch.Generator().manual_seed(0))
    parts = codec.encode(value, "F32")
    assert (parts[MAIN].dtype, parts[SCALE].dtype) == (torch.int8, torch.float8_e8m0fnu)
    assert [(p.name, p.dtype, p.shape) for p in codec.out_parts("e.w1.weight", "F32", (12, 64))] == [
        ("e.w1.weight", "I8", (12, 32)), ("e.w1.scale", "F8_E8M0", (12, 2))]
    decoded = codec.decode(parts, 0)
    assert float((decoded - value).abs().max()) <= float(value.abs().max()) / 4
    again = codec.encode(decoded, "F32")
    assert torch.equal(again[MAIN], parts[MAIN]) and torch.equal(again[SCALE].view(torch.uint8),
                                                                  parts[SCALE].view(torch.uint8))


def test_fp4_experts_and_dotted_fp8_scales_are_recognised_from_the_headers() -> None:
    headers = {
        "layers.0.ffn.experts.0.w1.weight": ("I8", (64, 16)), "layers.0.ffn.experts.0.w1.scale": ("F8_E8M0", (64, 1)),
        "layers.0.attn.wq_a.weight": ("F8_E4M3", (24, 32)), "layers.0.attn.wq_a.scale": ("F8_E8M0", (1, 1)),
        "layers.0.attn.q_norm.weight": ("F32", (24,)), "layers.0.ffn.gate.tid2eid": ("I64", (128, 2)),
    }
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
                    "expert_dtype": "fp4"}
    found = recognise(BlockFp8Codec, quantization, headers).quantized
    assert sorted(found) == ["layers.0.attn.wq_a.weight", "layers.0.ffn.experts.0.w1.weight"]
    codec = BlockFp8Codec.codec_of({})
    expert, linear = codec(found["layers.0.ffn.experts.0.w1.weight"]), codec(found["layers.0.attn.wq_a.weight"])
    assert expert == Fp4Codec("F8_E8M0") and expert.value_shape((64, 16)) == (64, 32)
    assert isinstance(linear, DottedFp8Codec)
    assert [p.name for p in linear.out_parts("layers.0.attn.wq_a.weight", "F32", (24, 32))] == [
        "layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale"]
    bad = {**headers, "layers.0.ffn.experts.0.w1.scale": ("F8_E8M0", (64, 2))}
    with pytest.raises(ModelInputError, match=r"needs \[64, 1\]"):
        recognise(BlockFp8Codec, quantization, bad)

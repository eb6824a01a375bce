"""Every codec decodes and encodes on its input's device (``--device cuda`` encodes the merged values where they
were computed): no scratch, byte table or constant of one or more dimensions that it makes is left on the
CPU.

No GPU is needed: as in ``tests/methods/test_devices.py``, tensors on PyTorch's ``meta`` device make any kernel
that mixes in a CPU tensor fail with "... is on the wrong device" / "found at least two devices", exactly as CUDA
values do ("Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!").
What meta cannot show: like CUDA, it takes a 0-dim CPU tensor as a scalar, so a 0-dim CPU constant passes here
(and on the GPU), and meta has no values, so only the GPU test in ``tests/test_device.py`` checks the bits such a
constant (or anything else) gives there.
"""

from __future__ import annotations

import pytest
import torch

from resumerge.inputs.codecs.compressed import CompressedTensorsCodec
from resumerge.inputs.codecs.fp8_block import BlockFp8Codec
from resumerge.inputs.codecs.mxfp4 import Mxfp4Codec
from resumerge.inputs.codecs.protocol import TensorCodec
from resumerge.inputs.codecs.quantized import SHAPE
from resumerge.inputs.quant.byte_tables import per_device

META = torch.device("meta")
# Each codec with the value shape it encodes: edges partial where the format allows it; INT2/4/8 packed, naive and
# float compressed-tensors, symmetric and not; block FP8 2-D and fused, both scale formats.
CODECS: list[tuple[TensorCodec, tuple[int, ...]]] = [
    (BlockFp8Codec((16, 16)), (40, 36)),
    (BlockFp8Codec((16, 16), "ue8m0", "F8_E8M0"), (40, 36)),
    (BlockFp8Codec((16, 16), fused=True), (2, 40, 36)),
    (CompressedTensorsCodec("ct-packed", 4, (1, 16), 36, "BF16", (40, 3)), (40, 36)),
    # A packed group's zero points are packed into I32 words like the codes (recognition refuses any other dtype).
    (CompressedTensorsCodec("ct-packed", 2, (1, 16), 36, "F32", (40, 3), "I32"), (40, 36)),
    (CompressedTensorsCodec("ct-packed", 8, (40, 36), 36, "F32", (1,)), (40, 36)),
    (CompressedTensorsCodec("ct-naive", 8, (1, 36), 36, "F32", (40, 1), "I8"), (40, 36)),
    (CompressedTensorsCodec("ct-float", 8, (16, 16), 36, "F32", (3, 3)), (40, 36)),
    (Mxfp4Codec(), (2, 64, 24)),
]


def _on_meta(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # weight_shape is read as numbers (tolist) to check it: a host value there is no mix-up, and meta has no values.
    return {part: t if part == SHAPE else t.to(META) for part, t in parts.items()}


@pytest.mark.parametrize(("codec", "shape"), CODECS, ids=lambda c: getattr(c, "name", ""))
def test_codecs_decode_and_encode_on_the_inputs_device(codec: TensorCodec, shape: tuple[int, ...]) -> None:
    value = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    stored = codec.encode(value, "F32")
    assert all(t.device.type == "cpu" for t in stored.values())
    encoded = codec.encode(value.to(META), "F32")
    assert encoded.keys() == stored.keys()
    for part, t in encoded.items():
        assert (t.device, t.dtype, t.shape) == (META, stored[part].dtype, stored[part].shape), part

    parts = _on_meta(stored)
    decoded = codec.decode(parts, 0)
    assert decoded.device == META and decoded.dtype == torch.float32 and decoded.shape == value.shape
    out = torch.empty(value.shape, dtype=torch.float32, device=META)
    assert codec.decode(parts, 0, out=out) is out


def test_a_per_device_table_is_built_once_on_the_cpu_and_copied_once_per_device() -> None:
    built: list[int] = []

    @per_device
    def table(width: int) -> torch.Tensor:
        built.append(width)
        return torch.arange(width, dtype=torch.float32)

    cpu = table(torch.device("cpu"), 3)
    on_meta = table(META, 3)
    assert built == [3] and torch.equal(cpu, torch.arange(3, dtype=torch.float32))
    assert (on_meta.device, on_meta.shape) == (META, cpu.shape)
    assert table(META, 3) is on_meta and table(torch.device("cpu"), 3) is cpu
    table(META, 4)
    assert built == [3, 4]

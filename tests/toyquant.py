"""A quantized format defined outside the package, in both directions ("toy-q8": ``X`` I8 codes with ``X_qscale``, one
F32 absmax scale per row), in the house's quantized style: it recognises its own ``quant_method`` from the config
and the headers (:meth:`ToyQ8.weights`), decodes, and encodes an output kept in its format. This file and the one
line that lists it in a table (:data:`WITH_TOY_Q8`) are all a new format takes."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file, save_file

from resumerge.inputs.codecs import CODECS, MAIN, CodecTable, OutPart, QuantizedCodec, TensorDecoder
from resumerge.inputs.codecs.quantized import SCALE
from resumerge.inputs.files import TensorSource
from resumerge.inputs.quant.refusals import HeaderMap, refuse
from resumerge.inputs.quant.verdict import QuantizedTensor, Scheme

_SCHEME = Scheme("toy-q8", 8, (1, 1 << 30), "channel", "F32")


@dataclass(frozen=True)
class ToyQ8(QuantizedCodec):
    """``quant_method: toy-q8``: value = code · scale of its row, in float32."""

    name: ClassVar[str] = "toy-q8"
    claims: ClassVar[tuple[str, ...]] = ("toy-q8",)

    @classmethod
    def weights(cls, quantization: Mapping[str, Any], headers: HeaderMap, source: str) -> dict[str, QuantizedTensor]:
        found = {}
        for name, (dtype, shape) in sorted(headers.items()):
            if dtype != "I8":
                continue
            scale = headers.get(f"{name}_qscale")
            if scale is None or scale != ("F32", (shape[0],)):
                raise refuse(source, f"a toy-q8 weight without its row scales (looked for {name}_qscale)", name)
            found[name] = QuantizedTensor(name, name, f"{name}_qscale", _SCHEME, tuple(shape))
        return found

    @classmethod
    def codec_of(cls, tensors: Mapping[str, TensorSource]) -> Callable[[QuantizedTensor], TensorDecoder]:
        return lambda weight: cls()

    def decode(self, parts: Mapping[str, torch.Tensor], first_row: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        value = parts[MAIN].to(torch.float32) * parts[SCALE].unsqueeze(-1)
        return value if out is None else out.copy_(value)

    def out_parts(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[OutPart, ...]:
        return OutPart(MAIN, name, "I8", shape), OutPart(SCALE, f"{name}_qscale", "F32", shape[:1])

    def encode(self, value: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
        scale = value.abs().amax(dim=-1).to(torch.float32) / 127
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        codes = (value / scale.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
        return {MAIN: codes, SCALE: scale}


# The registration: every format a run decodes by default, and this one.
WITH_TOY_Q8 = CodecTable((*CODECS.formats, ToyQ8))


def quantize(directory: Path) -> dict[str, torch.Tensor]:
    """Store every matrix of the model at ``directory`` as toy-q8 codes with their scales beside them (same file);
    returns each quantized tensor's value as decoded."""
    values = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors = load_file(file)
        for name, t in list(tensors.items()):
            if t.dim() == 2:
                parts = ToyQ8().encode(t, "F32")
                tensors[name], tensors[f"{name}_qscale"] = parts[MAIN], parts[SCALE]
                values[name] = ToyQ8().decode(parts, 0)
        save_file(tensors, file, metadata={"format": "pt"})
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
        weight_map.update({f"{n}_qscale": weight_map[n] for n in values})
        index_path.write_text(json.dumps(index))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": ToyQ8.name}
    (directory / "config.json").write_text(json.dumps(config))
    return values

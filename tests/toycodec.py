"""A toy stored format for the codec seam's tests ("int8 with a per-row scale"), defined outside the package: a new
format is one :class:`~resumerge.inputs.codecs.TensorCodec` class and a :class:`~resumerge.inputs.codecs.CodecTable`
that lists it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file, save_file

from resumerge.inputs.codecs import MAIN, Claim, CodecTable, OutPart, TensorCodec
from resumerge.inputs.files import TensorSource

SCALES_FILE = "scales.safetensors"


@dataclass(frozen=True)
class RowScaledInt8(TensorCodec):
    """``quant_method: toy-int8``: every I8 tensor ``X`` has ``X_scale`` (F32, one per row); value = code * scale."""

    name: ClassVar[str] = "toy-int8"

    @classmethod
    def recognise(cls, config: Mapping[str, Any], tensors: Mapping[str, TensorSource]) -> tuple[Claim, ...]:
        if (config.get("quantization_config") or {}).get("quant_method") != cls.name:
            return ()
        return tuple(Claim(name, ((MAIN, name), ("scale", f"{name}_scale")), cls())
                     for name, found in sorted(tensors.items()) if found.entry.dtype == "I8")

    def decode(self, parts: Mapping[str, torch.Tensor], first_row: int) -> torch.Tensor:
        return parts[MAIN].to(torch.float32) * parts["scale"].unsqueeze(-1)

    def out_parts(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[OutPart, ...]:
        return OutPart(MAIN, name, "I8", shape), OutPart("scale", f"{name}_scale", "F32", shape[:1])

    def encode(self, value: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
        scale = value.abs().amax(dim=-1).to(torch.float32) / 127
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        codes = (value / scale.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
        return {MAIN: codes, "scale": scale}


TOY = CodecTable((RowScaledInt8,))


def quantize(directory: Path) -> dict[str, torch.Tensor]:
    """Store every matrix of the model at ``directory`` as toy int8 codes, their scales in a file of their own;
    returns each quantized tensor's value as decoded."""
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    scales, values = {}, {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(directory / file)
        for name, t in list(tensors.items()):
            if t.dim() == 2:
                parts = RowScaledInt8().encode(t, "F32")
                tensors[name], scales[f"{name}_scale"] = parts[MAIN], parts["scale"]
                values[name] = RowScaledInt8().decode(parts, 0)
        save_file(tensors, directory / file, metadata={"format": "pt"})
    save_file(scales, directory / SCALES_FILE, metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(scales, SCALES_FILE))
    index_path.write_text(json.dumps(index))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": RowScaledInt8.name}
    (directory / "config.json").write_text(json.dumps(config))
    return values

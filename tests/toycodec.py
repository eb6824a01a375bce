"""A toy stored format for the codec seam's tests ("int8 with a per-row scale"), defined outside the package: a new
format is one :class:`~resumerge.inputs.codecs.TensorCodec` class and a :class:`~resumerge.inputs.codecs.CodecTable`
that lists it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file, save_file

from resumerge.inputs.codecs import CODECS, MAIN, Claim, CodecTable, OutPart, TensorCodec
from resumerge.inputs.files import TensorSource
from resumerge.inputs.source import InputSources
from resumerge.merge.engine.compute import compute_tensor
from resumerge.merge.methods.resources import NO_RESOURCES
from resumerge.merge.plan.merge_plan import Plan

SCALES_FILE = "scales.safetensors"


@dataclass(frozen=True)
class RowScaledInt8(TensorCodec):
    """``quant_method: toy-int8``: every I8 tensor ``X`` has ``X_scale`` (F32, one per row); value = code * scale."""

    name: ClassVar[str] = "toy-int8"
    claims: ClassVar[tuple[str, ...]] = ("toy-int8",)

    @classmethod
    def recognise(cls, config: Mapping[str, Any], tensors: Mapping[str, TensorSource]) -> tuple[Claim, ...]:
        if (config.get("quantization_config") or {}).get("quant_method") != cls.name:
            return ()
        return tuple(Claim(name, ((MAIN, name), ("scale", f"{name}_scale")), cls())
                     for name, found in sorted(tensors.items()) if found.entry.dtype == "I8")

    def decode(self, parts: Mapping[str, torch.Tensor], first_row: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return parts[MAIN].to(torch.float32) * parts["scale"].unsqueeze(-1)

    def out_parts(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[OutPart, ...]:
        return OutPart(MAIN, name, "I8", shape), OutPart("scale", f"{name}_scale", "F32", shape[:1])

    def encode(self, value: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
        scale = value.abs().amax(dim=-1).to(torch.float32) / 127
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        codes = (value / scale.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
        return {MAIN: codes, "scale": scale}


TOY = CodecTable((RowScaledInt8,))
# Every format a run decodes by default, and the toy one beside them: what a notebook hands a run to add a format.
WITH_TOY = CodecTable((*CODECS.formats, RowScaledInt8))


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


def twins(source: Path, quantized: Path, decoded: Path) -> None:
    """Copy the model at ``source`` to ``quantized``, toy-quantized, and to ``decoded``, each quantized matrix stored
    plainly as its decoded value: the same model read through the toy codec or without it."""
    shutil.copytree(source, quantized)
    shutil.copytree(source, decoded)
    values = quantize(quantized)
    for file in decoded.glob("*.safetensors"):
        tensors = load_file(file)
        tensors.update({n: v for n, v in values.items() if n in tensors})
        save_file(tensors, file, metadata={"format": "pt"})


def assert_same_results(codes: Plan, values: Plan) -> None:
    """Every output tensor of plan ``codes`` (over toy-quantized models) computes to the bits of its namesake in plan
    ``values`` (over their :func:`twins` stored plainly)."""
    assert codes.tensors.keys() == values.tensors.keys()
    with InputSources.local(codes.model_dirs) as read_codes, InputSources.local(values.model_dirs) as read_values:
        for name, tp in codes.tensors.items():
            twin = values.tensors[name]
            assert (tp.shape, tp.out_dtype) == (twin.shape, twin.out_dtype), name
            got = compute_tensor(codes, tp, read_codes, NO_RESOURCES)[name]
            assert torch.equal(got, compute_tensor(values, twin, read_values, NO_RESOURCES)[name]), name

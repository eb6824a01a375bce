"""Quantized formats resumerge cannot decode are refused by ``plan`` and ``run`` with one line and exit 2, from
config.json and the headers alone, before any weight is read and with nothing written: bitsandbytes, GPTQ, AWQ
(configured or told by their tensor names alone), an unknown ``quant_method``, a GGUF file."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import ModelFactory
from safetensors.torch import save_file
from support import cli, linear_config, write_config

from resumerge.cli.commands import main

SPEC = {"layers": 1, "hidden": 16, "intermediate": 24, "vocab": 32}


def _configured(method: str, tensors: dict[str, torch.Tensor]) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        if method:
            config["quantization_config"] = {"quant_method": method}
        (directory / "config.json").write_text(json.dumps(config))
        for file in directory.glob("*.safetensors*"):
            file.unlink()
        save_file(tensors, directory / "model.safetensors")

    return damage


def _gguf(directory: Path) -> None:
    for file in directory.glob("*.safetensors*"):
        file.unlink()
    (directory / "model-Q4_K_M.gguf").write_bytes(b"GGUF" + bytes(60))


_EMBED = {"model.embed_tokens.weight": torch.zeros(32, 16)}
_GPTQ = {"model.layers.0.mlp.down_proj.qweight": torch.zeros(3, 16, dtype=torch.int32),
         "model.layers.0.mlp.down_proj.qzeros": torch.zeros(1, 2, dtype=torch.int32),
         "model.layers.0.mlp.down_proj.scales": torch.zeros(1, 16, dtype=torch.float16), **_EMBED}
_BNB = {"model.layers.0.mlp.down_proj.weight": torch.zeros(192, 1, dtype=torch.uint8),
        "model.layers.0.mlp.down_proj.weight.absmax": torch.zeros(6),
        "model.layers.0.mlp.down_proj.weight.quant_map": torch.zeros(16), **_EMBED}
CASES = {
    "bitsandbytes": (_configured("bitsandbytes", _BNB), "quantized with bitsandbytes"),
    "gptq": (_configured("gptq", _GPTQ), "quantized with GPTQ"),
    "awq": (_configured("awq", _GPTQ), "quantized with AWQ"),
    "gptq-unconfigured": (_configured("", _GPTQ), "looks quantized with GPTQ or AWQ or AutoRound"),
    "unknown": (_configured("int3-magic", _EMBED), "unknown quantization method 'int3-magic'"),
    "gguf": (_gguf, "a GGUF file, not safetensors, in a model folder"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_and_run_refuse_an_undecodable_format_in_one_line(tmp_path: Path, make: ModelFactory,
                                                               case: str, capsys: pytest.CaptureFixture[str]) -> None:
    damage, line = CASES[case]
    a, b = make("a", seed=1, **SPEC), make("b", seed=2, **SPEC)
    damage(b)
    config = write_config(tmp_path / "c.yml", linear_config(a, b))
    out, state = tmp_path / "out", tmp_path / "state"
    # plan in this process (the same entry point, an interpreter start saved); run as the user runs it
    code = main(["plan", str(config)])
    said = capsys.readouterr()
    run = cli("run", config, out, "--state-dir", state)
    for name, result in (("plan", subprocess.CompletedProcess([], code, said.out, said.err)), ("run", run)):
        assert result.returncode == 2, (name, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and line in lines[0] and str(b) in lines[0], lines
        # A GGUF is read when the config names the file: a folder holding one says so.
        assert ("name the file itself as the model" if case == "gguf" else "dequantize") in lines[0]
    assert not out.exists()
    assert not state.exists() or not any(state.rglob("*.safetensors"))

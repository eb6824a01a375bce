"""Tiny models and configs for the MoE tests, and mergekit-moe 0.1.5 (the test-only oracle) run on many configs
in one process (its start-up, transformers' import, costs more than the merges)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml

from resumerge.cli.modelgen import ModelSpec, make_model, write_tokenizer

SEED = 3


def llamas(root: Path, count: int = 3, *, dtype: torch.dtype = torch.float32, layers: int = 2) -> list[Path]:
    """``count`` tiny Llamas (hidden 32, vocab 64) of different weights."""
    return [make_model(root / f"m{i}", ModelSpec(layers=layers, dtype=dtype), seed=30 + i) for i in range(count)]


def qwen2s(root: Path, count: int = 2) -> list[Path]:
    """``count`` tiny Qwen2 models (q/k/v biases; hidden 32, 2 layers, vocab 64)."""
    return [make_model(root / f"q{i}", ModelSpec(layers=2, arch="qwen2"), seed=50 + i) for i in range(count)]


def qwen3s(root: Path, count: int = 2) -> list[Path]:
    """``count`` tiny tied Qwen3 models (hidden 32, 2 layers, vocab 64), saved by transformers."""
    import transformers

    paths = []
    for i in range(count):
        torch.manual_seed(40 + i)
        config = transformers.Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                                          max_position_embeddings=128, tie_word_embeddings=True,
                                          bos_token_id=1, eos_token_id=2)
        model = transformers.Qwen3ForCausalLM(config)
        with torch.no_grad():
            for p in model.parameters():  # visible weights: the default init leaves norms at exactly 1
                p.add_(0.02 * torch.randn_like(p))
        path = root / f"qwen3_{i}"
        model.save_pretrained(path)
        write_tokenizer(path, 64)
        paths.append(path)
    return paths


def write(path: Path, doc: dict[str, object]) -> Path:
    """Write a YAML config and return its path."""
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def hidden_gates(path: Path, models: list[Path]) -> Path:
    """A ``gate_mode: hidden`` MoE config at ``path``: ``models[0]`` the base, ``models[1]`` and ``models[2]`` the
    experts, each with its prompts (the first with a negative one too)."""
    return write(path, {
        "base_model": str(models[0]), "gate_mode": "hidden",
        "experts": [{"source_model": str(models[1]), "positive_prompts": ["ab cd"], "negative_prompts": ["xy"]},
                    {"source_model": str(models[2]), "positive_prompts": ["Zq rs tu"]}]})


_ORACLE = """
import sys, json
from mergekit.scripts.moe import main
for config, out, *flags in json.loads(sys.argv[1]):
    try:
        main([config, out, *flags], standalone_mode=False)
    except SystemExit as exc:
        if exc.code:
            raise
"""


@contextmanager
def oracle(runs: list[tuple[Path, Path, list[str]]]) -> Iterator[None]:
    """Run ``mergekit-moe CONFIG OUT FLAGS`` for every run, in one process working beside the ``with`` block (its
    start-up and passes overlap the block's merges); every run has succeeded when the block ends."""
    doc = json.dumps([[str(c), str(o), *f] for c, o, f in runs])
    proc = subprocess.Popen([sys.executable, "-c", _ORACLE, doc], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        yield
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors shards in ``directory``."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))

"""Fine-tune/base pairs for the extraction tests: FT = BASE + a low-rank delta (rank varying by module) + small
noise on every matrix, norms and embeddings changed too, generated once per session."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from resumerge.cli.modelgen import ModelSpec, make_model

# name -> model spec of the pair
PAIRS: dict[str, ModelSpec] = {
    "llama": ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64),
    # Wide enough for the randomized truncation to run at rank 8 (not the exact fallback of tiny matrices).
    "llama-wide": ModelSpec(layers=2, hidden=128, intermediate=352, vocab=64, shard_bytes=1_000_000),
    "qwen2-tied-bf16": ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64, arch="qwen2", tied=True,
                                 dtype=torch.bfloat16),
}


def delta_rank(name: str) -> int:
    """The rank of the delta planted in tensor ``name`` (2 to 6, by name)."""
    return 2 + hashlib.sha256(name.encode()).digest()[0] % 5


def make_finetune(base: Path, ft: Path, *, seed: int = 7, noise: float = 1e-3) -> None:
    """Copy ``base`` to ``ft`` with every tensor changed: matrices by a planted low-rank delta plus noise, vectors
    (norms, biases) by noise."""
    shutil.copytree(base, ft)
    g = torch.Generator().manual_seed(seed)
    for path in sorted(ft.glob("*.safetensors")):
        tensors = load_file(path)
        for name in sorted(tensors):
            t = tensors[name]
            x = t.float()
            if x.dim() == 2:
                r = delta_rank(name)
                u = torch.randn(x.shape[0], r, generator=g) * 0.2
                v = torch.randn(r, x.shape[1], generator=g) * 0.2
                x = x + u @ v + noise * torch.randn(x.shape, generator=g)
            else:
                x = x + 0.05 * torch.randn(x.shape, generator=g)
            tensors[name] = x.to(t.dtype).contiguous()
        save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="session")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path]]:
    """``pair(name)`` -> (BASE, FT) folders of ``PAIRS[name]``, built once per session."""
    root = tmp_path_factory.mktemp("extract-pairs")
    built: dict[str, tuple[Path, Path]] = {}

    def build(name: str) -> tuple[Path, Path]:
        if name not in built:
            base = make_model(root / f"{name}-base", PAIRS[name], seed=0)
            config = json.loads((base / "config.json").read_text())
            assert config["model_type"]  # a transformers model: peft and mergekit load it
            make_finetune(base, root / f"{name}-ft")
            built[name] = (base, root / f"{name}-ft")
        return built[name]

    return build

"""Base models and real PEFT adapters for the LoRA tests, each generated once per session on first use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from lora.gen import make_adapter, make_gpt2, peft_merged
from resumerge.cli.modelgen import ModelSpec, make_model

LLAMA_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Case:
    """A base model, an adapter for it, and PEFT's ``merge_and_unload`` result (the oracle)."""

    base: Path
    adapter: Path
    oracle: dict[str, torch.Tensor]


# name -> (base kind, base dtype, make_adapter keyword arguments)
CASES: dict[str, tuple[str, torch.dtype, dict[str, Any]]] = {
    # Every llama linear layer plus an embedding LoRA, per-module rank and alpha, lm_head in modules_to_save.
    "llama-f32": ("llama", torch.float32, dict(
        r=4, alpha=8, targets=[*LLAMA_LINEAR, "embed_tokens"], modules_to_save=["lm_head"],
        rank_pattern={"layers.1.self_attn.q_proj": 2, r"layers\.[23]\.mlp\.down_proj": 6},
        alpha_pattern={"v_proj": 3, "model.layers.0.mlp.up_proj": 20})),
    # rsLoRA on a bf16 base with factors saved in bf16 (PEFT up-casts them to float32 when loading).
    "llama-bf16-rslora": ("llama", torch.bfloat16, dict(
        r=8, alpha=16, rslora=True, targets=["q_proj", "v_proj", "down_proj", "embed_tokens"],
        factor_dtype=torch.bfloat16, seed=1)),
    "llama-f16": ("llama", torch.float16, dict(
        r=2, alpha=4, targets=["k_proj", "o_proj", "gate_proj", "up_proj"], seed=2)),
    # GPT-2 Conv1D layers: fan_in_fan_out, plus every bias trained (bias: all).
    "gpt2-f32-bias": ("gpt2", torch.float32, dict(
        r=4, alpha=16, targets=["c_attn", "c_proj", "c_fc"], bias="all", seed=3)),
    "gpt2-bf16": ("gpt2", torch.bfloat16, dict(r=4, alpha=16, targets=["c_attn", "c_proj", "c_fc"], seed=4)),
}


@pytest.fixture(scope="session")
def lora_case(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Case]:
    """``lora_case(name)`` builds (once per session) the base, adapter and PEFT oracle of ``CASES[name]``."""
    built: dict[str, Case] = {}
    root = tmp_path_factory.mktemp("lora")

    def build(name: str) -> Case:
        if name not in built:
            kind, dtype, kwargs = CASES[name]
            base = root / f"{name}-base"
            if kind == "gpt2":
                make_gpt2(base, dtype=dtype)
            else:
                make_model(base, ModelSpec(dtype=dtype), seed=len(built))
            adapter = root / f"{name}-adapter"
            make_adapter(base, adapter, **kwargs)
            built[name] = Case(base, adapter, peft_merged(base, adapter))
        return built[name]

    return build


@pytest.fixture(scope="session")
def llama_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small fp32 llama with tokenizer files, for adapter-opening and refusal tests."""
    return make_model(tmp_path_factory.mktemp("llama") / "base", ModelSpec(), seed=7)

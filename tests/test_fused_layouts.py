"""Each family's fused expert layout comes from its architecture, never from the stack's shapes.

The ambiguous shape for every family that stores fused stacks: hidden size twice the expert width, so each expert's
``gate_up_proj`` slice is square ([2I, 2I]) and either axis could hold gate and up. Each tiny input holds its fused
stacks beside the same values cut by index arithmetic into per-expert tensors (the test's own knowledge of each
family, from transformers 5.24's experts classes: gpt-oss interleaves gate and up on the last axis, Llama-4 and
Qwen3-VL-MoE put gate's columns then up's on the last axis, transformers' own [E, 2I, H] gate's rows then up's);
one merge makes both, and every projection of every expert of the fused output has the bytes of its per-expert
twin. On the code before the layout table, Llama-4's and Qwen3-VL-MoE's stacks were split on the hidden axis. A
fused stack of a family resumerge does not know is refused (exit 2) before anything is written, for a method that
would split it; an elementwise method merges it whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from support import cli

from resumerge import api
from resumerge.errors import ModelInputError
from resumerge.merge.plan.experts import FUSED_LAYOUTS

EXPERTS, WIDTH = 3, 8
HIDDEN = 2 * WIDTH  # the ambiguous shape: an expert's gate_up slice is [2I, 2I]
Cut = Callable[[torch.Tensor, int], torch.Tensor]  # projection p (0: gate, 1: up) of one expert's gate_up slice


def _first(t: torch.Tensor, p: int) -> torch.Tensor:
    return t[p * WIDTH:(p + 1) * WIDTH]


def _last(t: torch.Tensor, p: int) -> torch.Tensor:
    return t[:, p * WIDTH:(p + 1) * WIDTH]


def _alternate(t: torch.Tensor, p: int) -> torch.Tensor:
    return t[..., p::2]


# model_type: (the config beside it, the module holding the experts, how gate and up lie, biases).
FAMILIES: dict[str, tuple[dict[str, Any], str, Cut, bool]] = {
    "gpt_oss": ({"num_local_experts": EXPERTS, "intermediate_size": WIDTH}, "mlp", _alternate, True),
    "llama4_text": ({"num_local_experts": EXPERTS, "intermediate_size": WIDTH, "intermediate_size_mlp": 48},
                    "feed_forward", _last, False),
    "llama4": ({"text_config": {"model_type": "llama4_text", "num_local_experts": EXPERTS,
                                "intermediate_size": WIDTH, "hidden_size": HIDDEN}}, "feed_forward", _last, False),
    "qwen3_vl_moe": ({"text_config": {"model_type": "qwen3_vl_moe_text", "num_experts": EXPERTS,
                                      "moe_intermediate_size": WIDTH, "intermediate_size": 40,
                                      "hidden_size": HIDDEN}}, "mlp", _last, False),
    "qwen3_5_moe": ({"text_config": {"model_type": "qwen3_5_moe_text", "num_experts": EXPERTS,
                                     "moe_intermediate_size": WIDTH, "hidden_size": HIDDEN}}, "mlp", _first, False),
    "mixtral": ({"num_local_experts": EXPERTS, "intermediate_size": WIDTH}, "mlp", _first, False),
    "deepseek_v3": ({"n_routed_experts": EXPERTS, "moe_intermediate_size": WIDTH, "intermediate_size": 40},
                    "mlp", _first, False),
}
LAYER = "model.layers.0"


def _shape(cut: Cut) -> tuple[int, int]:
    return (2 * WIDTH, HIDDEN) if cut is _first else (HIDDEN, 2 * WIDTH)


def _model(directory: Path, family: str, seed: int) -> Path:
    """A one-layer ``family`` input: its fused stacks and each expert's projections stored alone beside them."""
    extra, module, cut, biased = FAMILIES[family]
    g = torch.Generator().manual_seed(seed)
    stem = f"{LAYER}.{module}.experts"
    fused = {f"{stem}.gate_up_proj": torch.randn(EXPERTS, *_shape(cut), generator=g),
             f"{stem}.down_proj": torch.randn(EXPERTS, WIDTH, HIDDEN, generator=g)}
    if biased:
        fused |= {f"{stem}.gate_up_proj_bias": torch.randn(EXPERTS, 2 * WIDTH, generator=g),
                  f"{stem}.down_proj_bias": torch.randn(EXPERTS, HIDDEN, generator=g)}
    tensors = {**fused, "model.norm.weight": torch.randn(HIDDEN, generator=g)}
    for e in range(EXPERTS):
        tensors |= {name: t.clone() for name, t in _unfused(fused, family, e).items()}
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    config = {"model_type": family, "num_hidden_layers": 1, "hidden_size": HIDDEN, **extra}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _unfused(fused: dict[str, torch.Tensor], family: str, e: int) -> dict[str, torch.Tensor]:
    """Expert ``e`` of ``fused`` as per-expert tensors, keyed by their names (``…experts.E.gate_proj`` …)."""
    _, module, cut, _ = FAMILIES[family]
    stem = f"{LAYER}.{module}.experts"
    out: dict[str, torch.Tensor] = {}
    for name, t in fused.items():
        part = name.removeprefix(f"{stem}.")
        if part.startswith("gate_up_proj"):
            suffix = "bias" if part.endswith("_bias") else "weight"
            one = (lambda x, p: x[p::2]) if cut is _alternate and suffix == "bias" else \
                (lambda x, p: x[p * WIDTH:(p + 1) * WIDTH]) if suffix == "bias" else cut
            out |= {f"{stem}.{e}.{proj}.{suffix}": one(t[e], p) for p, proj in enumerate(("gate_proj", "up_proj"))}
        else:
            out[f"{stem}.{e}.down_proj.{'bias' if part.endswith('_bias') else 'weight'}"] = t[e]
    return out


def _merge(tmp_path: Path, family: str, method: str) -> dict[str, torch.Tensor]:
    models = [_model(tmp_path / f"m{i}", family, i) for i in range(3 if method == "ties" else 2)]
    per_model = {"weight": 0.5, "density": 0.5} if method == "ties" else {}
    doc = {"merge_method": method, "base_model": str(models[0]), "dtype": "float32",
           "parameters": {"t": 0.3} if method == "slerp" else {},
           "models": [{"model": str(m), "parameters": per_model} for m in models]}
    api.run(yaml.safe_dump(doc, sort_keys=False), tmp_path / "out", settings=api.Settings(state_dir=tmp_path / "state"))
    return load_file(str(tmp_path / "out" / "model.safetensors"))


def _stacks(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in out.items() if n.endswith(("experts.gate_up_proj", "experts.down_proj", "proj_bias"))}


def _same_as_alone(out: dict[str, torch.Tensor], family: str) -> None:
    """Every projection of every expert of ``out``'s stacks has the bytes of its per-expert twin's result."""
    for e in range(EXPERTS):
        for name, fused_part in _unfused(_stacks(out), family, e).items():
            assert torch.equal(fused_part, out[name]), f"{family}: {name}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_ambiguous_shape_merges_as_the_experts_stored_one_by_one(tmp_path: Path, family: str) -> None:
    out = _merge(tmp_path, family, "ties")
    assert len(_stacks(out)) == (4 if FAMILIES[family][3] else 2)
    _same_as_alone(out, family)


def test_llama4_slerp_takes_each_projection_alone(tmp_path: Path) -> None:
    """slerp's angle too: each expert's gate and up, never a half of each."""
    _same_as_alone(_merge(tmp_path, "llama4_text", "slerp"), "llama4_text")


def test_every_declared_family_is_checked_here() -> None:
    """A family added to the table comes with its oracle above, or its layout's twin does."""
    layouts = {FUSED_LAYOUTS[f] for f in FAMILIES}
    assert set(FUSED_LAYOUTS.values()) <= layouts
    assert all(f in FUSED_LAYOUTS for f in FAMILIES)


def test_a_stack_of_an_unknown_family_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    models = [_model(tmp_path / f"m{i}", "mixtral", i) for i in range(3)]
    for m in models:  # the same stacks under a model_type resumerge has no layout for
        config = json.loads((m / "config.json").read_text())
        (m / "config.json").write_text(json.dumps({**config, "model_type": "mystery_moe"}))
    doc = {"merge_method": "ties", "base_model": str(models[0]), "dtype": "float32",
           "models": [{"model": str(m), "parameters": {"weight": 0.5, "density": 0.5}} for m in models]}
    config_path = tmp_path / "ties.yml"
    config_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = tmp_path / "out"
    done = cli("run", config_path, out, "--state-dir", tmp_path / "state")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'mystery_moe'" in lines[0] and "layout resumerge does not know" in lines[0], lines
    assert not out.exists()
    with pytest.raises(ModelInputError, match="fused expert stack"):
        api.plan_merge(config_path)
    linear = {"merge_method": "linear", "dtype": "float32",
              "models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in models]}
    api.run(yaml.safe_dump(linear), out,
            settings=api.Settings(state_dir=tmp_path / "state-linear"))  # elementwise: merged whole
    merged = load_file(str(out / "model.safetensors"))
    inputs = [load_file(str(m / "model.safetensors")) for m in models]
    name = f"{LAYER}.mlp.experts.gate_up_proj"
    torch.testing.assert_close(merged[name], sum(0.5 * t[name] for t in inputs) / 1.5)

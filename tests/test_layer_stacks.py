"""The 2025–2026 layer stacks: DeepSeek-V3's MTP layer, Qwen3-Next's ``mtp.*``, Llama-4's ``moe_layers``.

Tiny models from transformers 5.24 configs with the MTP tensors real checkpoints carry (tests/stack_families.py).
Same-stack merges (linear, ties, slerp with a ``t`` gradient) must write every input tensor, the MTP module merged as
the last layer is (``t`` = the last layer's; its vocabulary copies as the embedding and head); slices carry it
from the last slice's model renumbered after the new last layer, or drop it and say so; config.json must describe
the new stack (``num_hidden_layers``, ``num_nextn_predict_layers``, ``first_k_dense_replace``, ``layer_types``,
``moe_layers``); a stack DeepSeek-V3's config cannot express is refused in one line naming the slice. Each output
must load in transformers with no missing or unexpected keys (DeepSeek-V3's MTP layer excepted: transformers
ignores only index 61, so a tiny model's MTP layer is reported unexpected, and is checked in the file instead) and
give the logits of a reference model assembled here from the expected tensors.

mergekit 0.1.5 on the same configs (``test_what_mergekit_does``): DeepSeek-V3 linear writes 43 of the 67 decoder
tensors (every routed expert and the whole MTP layer silently dropped); a Llama-4 passthrough stack of 5 layers
keeps ``num_hidden_layers: 4`` and ``moe_layers: [1, 3]``. (Run by hand, not kept here for time: the DeepSeek-V3
slices above write 4 layers under ``num_hidden_layers: 3`` with no MTP layer; Qwen3-Next linear and slices write
the experts under the fused in-memory names, drop ``mtp.*``, and a 5-layer stack says 4.)
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import save_file
from stack_families import config_of, make_stack_model, make_variant, mtp_names, without_mtp
from support import api_merge as _merge
from support import output_tensors as _tensors
from support import write_config

from resumerge import api
from resumerge.cli.commands import main
from resumerge.config.merge_config import load_config_text
from resumerge.config.modelref import ModelRef
from resumerge.errors import ModelInputError
from resumerge.inputs.model import ModelInput
from resumerge.merge.plan.accounting import UNEXPLAINED
from resumerge.merge.plan.architecture import infer_layout
from resumerge.merge.plan.mtp import MtpOutcome
from resumerge.merge.plan.outconfig import build_out_config
from resumerge.merge.plan.planner import MTP_DROPPED, MTP_FROM_LAST

pytest.importorskip("transformers", reason="transformers (a dependency of the mergekit test extra) is needed")
TOKENS = torch.tensor([[1, 5, 9, 2, 77, 127]])
MTP_FAMILIES = ("deepseek_v3", "qwen3_next")
LAYERS = {"deepseek_v3": 3, "qwen3_next": 4, "llama4": 4}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Two models of each MTP family (``-a`` built, ``-b`` a noisy copy; MTP decoder layers copies of each one's
    last layer) and ``-a`` without its MTP module (``-plain``); one Llama-4 model."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("stacks")
    built = {}
    for family in MTP_FAMILIES:
        built[f"{family}-a"] = make_stack_model(root / f"{family}-a", family, 0, mtp_like_last=True)
        built[f"{family}-b"] = make_variant(built[f"{family}-a"], root / f"{family}-b", family, 1)
        built[f"{family}-plain"] = without_mtp(built[f"{family}-a"], root / f"{family}-plain", family)
    built["llama4-a"] = make_stack_model(root / "llama4-a", "llama4", 0)
    yield built


def _check_logits(out: Path, family: str, expected: dict[str, torch.Tensor]) -> None:
    """``out`` loads with no missing, mismatched or unexpected keys (but DeepSeek-V3's MTP layer, which
    transformers does not know at a tiny model's index) and gives the logits of a model holding ``expected``."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    unexpected = set(info.pop("unexpected_keys"))  # in transformers' names (experts fused)
    layers = config_of(out)["num_hidden_layers"]
    mtp = mtp_names(expected, family, layers) if family == "deepseek_v3" else set()
    assert bool(unexpected) == bool(mtp)
    assert all(k.startswith(f"model.layers.{layers}.") for k in unexpected)
    assert {k: v for k, v in info.items() if v} == {}
    # The reference: the expected tensors written here, read by transformers (which fuses the experts itself).
    ref_dir = out.parent / "reference"
    ref_dir.mkdir()
    shutil.copy(out / "config.json", ref_dir / "config.json")
    save_file({n: t.contiguous() for n, t in expected.items() if n not in mtp}, ref_dir / "model.safetensors",
              metadata={"format": "pt"})
    reference, ref_info = AutoModelForCausalLM.from_pretrained(ref_dir, output_loading_info=True)
    assert {k: v for k, v in ref_info.items() if v} == {}
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS).logits, reference(TOKENS).logits, rtol=1e-5, atol=1e-5)


# ---- independent references of the three methods on two models (base a) ------------------------------------------
def _slerp(t: float, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # mergekit's slerp: the angle between the flattened, normalised tensors; linear when nearly parallel.
    na, nb = a / max(a.norm().item(), 1e-8), b / max(b.norm().item(), 1e-8)
    dot = float((na * nb).sum())
    if abs(dot) > 0.9995:
        return (1 - t) * a + t * b
    theta = torch.arccos(torch.tensor(dot, dtype=torch.float64))
    s0 = torch.sin(theta * (1 - t)) / torch.sin(theta)
    s1 = torch.sin(theta * t) / torch.sin(theta)
    return (s0.item() * a + s1.item() * b).to(a.dtype)


def _ties(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # One task vector at density 0.5, weight 1: its larger half kept (sign election and the normalised mean leave it).
    tau = b - a
    k = int(0.5 * tau.numel())
    mask = torch.zeros(tau.numel(), dtype=torch.bool)
    if k:
        mask[tau.abs().flatten().topk(k).indices] = True
    return a + tau * mask.view(tau.shape)


def _gradient_t(name: str, family: str) -> float:
    """The slerp ``t`` of output tensor ``name`` under ``t: [0.2, 0.8]``: mergekit's per-layer interpolation for
    decoder layers, 0.2 for the embedding, head and final norm; the MTP module takes the last layer's (0.8) but its
    vocabulary copies the embedding's."""
    n = LAYERS[family]
    if name in mtp_names([name], family):
        return 0.2 if name.endswith(("embed_tokens.weight", "shared_head.head.weight")) else 0.8
    if name.startswith("model.layers."):
        return 0.2 + 0.6 * int(name.split(".")[2]) / (n - 1)
    return 0.2


METHODS: dict[str, tuple[dict[str, Any], Callable[[str, str, torch.Tensor, torch.Tensor], torch.Tensor]]] = {
    "linear": ({"merge_method": "linear", "parameters": {"weight": 0.5}}, lambda n, f, a, b: (a + b) / 2),
    "ties": ({"merge_method": "ties", "parameters": {"weight": 1.0, "density": 0.5}},
             lambda n, f, a, b: _ties(a, b)),
    "slerp": ({"merge_method": "slerp", "parameters": {"t": [0.2, 0.8]}},
              lambda n, f, a, b: _slerp(_gradient_t(n, f), a, b)),
}


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_same_stack_merges_the_mtp_module_like_the_last_layer(
    family: str, method: str, models: dict[str, Path], tmp_path: Path
) -> None:
    a, b = models[f"{family}-a"], models[f"{family}-b"]
    doc, reference = METHODS[method]
    base = {} if method == "linear" else {"base_model": str(a)}
    out = _merge(tmp_path, {**doc, **base, "models": [{"model": str(a)}, {"model": str(b)}]})
    got, ta, tb = _tensors(out), _tensors(a), _tensors(b)
    assert got.keys() == ta.keys() and mtp_names(got, family)
    for name in sorted(got):
        torch.testing.assert_close(got[name], reference(name, family, ta[name], tb[name]), rtol=1e-5, atol=1e-6)
    # The inputs' MTP decoder layers are copies of their last layers: merged alike, they come out alike.
    n = LAYERS[family]
    mtp_layer = f"model.layers.{n}." if family == "deepseek_v3" else "mtp.layers.0."
    copies = {m: m.replace(mtp_layer, f"model.layers.{n - 1}.") for m in got if m.startswith(mtp_layer)}
    assert all(torch.equal(got[m], got[last]) for m, last in copies.items() if last in got)
    assert config_of(out)["num_hidden_layers"] == n
    assert config_of(out).get("num_nextn_predict_layers") == config_of(a).get("num_nextn_predict_layers")
    if method == "linear":  # the tensors are checked for every method; transformers' reading of them once
        _check_logits(out, family, got)


def _slices(*parts: tuple[Path, int, int], method: str = "passthrough") -> dict[str, Any]:
    return {"merge_method": method, "slices": [{"sources": [{"model": str(m), "layer_range": [s, e]}]}
                                               for m, s, e in parts]}


def _expected_stack(family: str, parts: list[tuple[dict[str, torch.Tensor], int]],
                    first: dict[str, torch.Tensor], last: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of a passthrough stack: output layer i is ``parts[i]``'s layer, loose tensors before the layers
    from ``first``, after them (and the MTP module, renumbered) from ``last``."""
    n, out = LAYERS[family], {}
    for i, (src, layer) in enumerate(parts):
        out.update({n_.replace(f"model.layers.{layer}.", f"model.layers.{i}.", 1): t for n_, t in src.items()
                    if n_.startswith(f"model.layers.{layer}.") and n_ not in mtp_names([n_], family)})
    for name, t in last.items():
        if name in mtp_names([name], family):
            out[name.replace(f"model.layers.{n}.", f"model.layers.{len(parts)}.")] = t
        elif not name.startswith("model.layers."):
            out[name] = t
    out["model.embed_tokens.weight"] = first["model.embed_tokens.weight"]
    return out


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_slices_carry_the_mtp_module_from_the_last_slice_renumbered(
    family: str, models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, n = models[f"{family}-a"], models[f"{family}-b"], LAYERS[family]
    cfg = write_config(tmp_path / "c.yml", _slices((a, 0, 2), (b, 1, n)))
    assert main(["plan", str(cfg)]) == 0
    shown = capsys.readouterr().out
    assert f"of {b} carried with the output's last layer" in " ".join(shown.split())
    out = _merge(tmp_path, yaml.safe_load(cfg.read_text()))
    ta, tb = _tensors(a), _tensors(b)
    stack = [(ta, 0), (ta, 1), *((tb, i) for i in range(1, n))]
    expected = _expected_stack(family, stack, ta, tb)
    got = _tensors(out)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in got)
    cfg_out = config_of(out)
    assert cfg_out["num_hidden_layers"] == len(stack)
    if family == "deepseek_v3":
        assert cfg_out["num_nextn_predict_layers"] == 1 and cfg_out["first_k_dense_replace"] == 1
        assert f"model.layers.{len(stack)}.eh_proj.weight" in got and f"model.layers.{n}.eh_proj.weight" not in {
            k for k in got if k.endswith("eh_proj.weight") and k != f"model.layers.{len(stack)}.eh_proj.weight"}
        note = f"renumbered to model.layers.{len(stack)}"
    else:
        source = json.loads((a / "config.json").read_text())["layer_types"]
        assert cfg_out["layer_types"] == [source[0], source[1], *source[1:]]
        note = "mtp.* (1 layer)"
    assert note in (out / "README.md").read_text()
    _check_logits(out, family, got)


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_slices_drop_the_mtp_module_when_the_last_model_has_none(
    family: str, models: dict[str, Path], tmp_path: Path
) -> None:
    a, plain, n = models[f"{family}-a"], models[f"{family}-plain"], LAYERS[family]
    out = _merge(tmp_path, _slices((a, 0, 2), (plain, 1, n)))
    got = _tensors(out)
    assert not mtp_names(got, family, 2 + n - 1)
    if family == "deepseek_v3":
        assert config_of(out)["num_nextn_predict_layers"] == 0
    assert f"MTP module of {a} dropped" in (out / "README.md").read_text()
    if family == "deepseek_v3":  # transformers reads no MTP tensor of Qwen3-Next (^mtp.*): its load shows nothing new
        _check_logits(out, family, got)


def test_slerp_slices_merge_the_mtp_layers_of_the_last_slice(models: dict[str, Path], tmp_path: Path) -> None:
    a, b = models["deepseek_v3-a"], models["deepseek_v3-b"]
    out = _merge(tmp_path, {"merge_method": "slerp", "base_model": str(a), "parameters": {"t": 0.5}, "slices": [
        {"sources": [{"model": str(a), "layer_range": [0, 2]}, {"model": str(b), "layer_range": [0, 2]}]},
        {"sources": [{"model": str(a), "layer_range": [1, 3]}, {"model": str(b), "layer_range": [1, 3]}]}]})
    got, ta, tb = _tensors(out), _tensors(a), _tensors(b)
    for suffix in ("eh_proj.weight", "mlp.experts.3.down_proj.weight", "embed_tokens.weight"):
        want = _slerp(0.5, ta[f"model.layers.3.{suffix}"], tb[f"model.layers.3.{suffix}"])
        torch.testing.assert_close(got[f"model.layers.4.{suffix}"], want, rtol=1e-5, atol=1e-6)
    assert "MTP module model.layers.3 (1 layer)" in (out / "README.md").read_text()


def test_a_same_stack_merge_with_a_model_without_mtp_drops_it_and_says_so(models: dict[str, Path]) -> None:
    a, plain = models["deepseek_v3-a"], models["deepseek_v3-plain"]
    plan = api.plan_merge(yaml.safe_dump({"merge_method": "linear", "parameters": {"weight": 0.5},
                                          "models": [{"model": str(a)}, {"model": str(plain)}]}))
    assert not mtp_names(plan.tensors, "deepseek_v3") and plan.out_config["num_nextn_predict_layers"] == 0
    assert plan.notes == (f"MTP module of {a} dropped (its layer count set to 0 in config.json): {plain}, which "
                          "supplies the output's last layer, has none",)


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_the_accounting_says_what_became_of_each_mtp_module(family: str, models: dict[str, Path],
                                                           tmp_path: Path) -> None:
    a, b, plain = (models[f"{family}-{k}"] for k in ("a", "b", "plain"))
    n = LAYERS[family]
    carried = api.plan_merge(write_config(tmp_path / "c.yml", _slices((a, 0, 2), (b, 1, n)))).accounting
    dropped = api.plan_merge(write_config(tmp_path / "d.yml", _slices((a, 0, 2), (plain, 1, n)))).accounting
    assert carried is not None and dropped is not None
    module = len(mtp_names(_tensors(a), family))
    assert carried.models[str(a)].dropped[MTP_FROM_LAST] == module  # b's module is read: none of b's is dropped
    assert all("MTP" not in reason for reason in carried.models[str(b)].dropped)
    assert dropped.models[str(a)].dropped[MTP_DROPPED] == module
    for accounting in (carried, dropped):
        total = accounting.total()
        assert UNEXPLAINED not in total.dropped
        assert total.merged + total.copied + total.renumbered + sum(total.dropped.values()) == total.tensors


def test_kimi_k2_layout_is_deepseeks(models: dict[str, Path], tmp_path: Path) -> None:
    # Kimi-K2 ships DeepSeek-V3's layout under model_type kimi_k2 (unknown to transformers 5.24): planned alike.
    kimi = tmp_path / "kimi"
    shutil.copytree(models["deepseek_v3-a"], kimi)
    doc = config_of(kimi) | {"model_type": "kimi_k2"}
    (kimi / "config.json").write_text(json.dumps(doc))
    plan = api.plan_merge(yaml.safe_dump(_slices((kimi, 0, 3), (kimi, 1, 3))))
    assert plan.num_layers == 5 and plan.out_config["num_nextn_predict_layers"] == 1
    assert plan.out_config["first_k_dense_replace"] == 1 and plan.out_config["model_type"] == "kimi_k2"
    assert "model.layers.5.eh_proj.weight" in plan.tensors and "model.layers.3.eh_proj.weight" not in plan.tensors


def test_a_dense_layer_after_a_moe_layer_is_refused_in_one_line_naming_the_slice(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = models["deepseek_v3-a"]
    cfg = write_config(tmp_path / "c.yml", _slices((a, 1, 3), (a, 0, 2)))
    for command in (["plan", str(cfg)], ["run", str(cfg), str(tmp_path / "out"), "--quiet"]):
        assert main(command) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1, lines
        for part in ("slices[1]", "output layer 2 (layer 0 of", "first_k_dense_replace"):
            assert part in lines[0]
    assert not (tmp_path / "out").exists()


def test_llama4_stack_rewrites_moe_layers(models: dict[str, Path], tmp_path: Path) -> None:
    a = b = models["llama4-a"]  # layers 0, 1, 1, 2, 3: MoE layers 1 and 3 become 1, 2 and 4
    out = _merge(tmp_path, _slices((a, 0, 2), (b, 1, 4)))
    cfg = config_of(out)
    assert cfg["num_hidden_layers"] == 5 and cfg["moe_layers"] == [1, 2, 4]
    assert cfg["no_rope_layers"] == [1, 1, 1, 1, 0]
    ta, tb = _tensors(a), _tensors(b)
    expected = _expected_stack("llama4", [(ta, 0), (ta, 1), (tb, 1), (tb, 2), (tb, 3)], ta, tb)
    got = _tensors(out)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    _check_logits(out, "llama4", got)


@pytest.mark.oracle
def test_what_mergekit_does(models: dict[str, Path], tmp_path: Path, mergekit: Any) -> None:
    """mergekit 0.1.5 on the configs above, recorded for the closing note (see the module docstring)."""
    ds_a, ds_b = models["deepseek_v3-a"], models["deepseek_v3-b"]
    inputs = _tensors(ds_a)
    runs = {
        "deepseek_linear": {"merge_method": "linear", "parameters": {"weight": 0.5},
                            "models": [{"model": str(ds_a)}, {"model": str(ds_b)}]},
        "llama4_slices": _slices((models["llama4-a"], 0, 2), (models["llama4-a"], 1, 4)),
    }
    outs = {}
    for name, doc in runs.items():
        outs[name] = tmp_path / name
        done = mergekit.run(write_config(tmp_path / f"{name}.yml", doc), outs[name])
        assert done.returncode == 0, done.stderr
    linear = _tensors(outs["deepseek_linear"])
    dropped = set(inputs) - set(linear)
    assert len(linear) == 43 and linear.keys() <= inputs.keys()
    assert all(".mlp.experts." in n or n in mtp_names([n], "deepseek_v3") for n in dropped)
    assert mtp_names(inputs, "deepseek_v3") <= dropped
    llama = config_of(outs["llama4_slices"])
    assert llama["num_hidden_layers"] == 4 and llama["moe_layers"] == [1, 3]  # 5 layers written


# ---- rules that need no weights -----------------------------------------------------------------------------------
def _out_config(configs: dict[str, dict[str, Any]], *stack: tuple[str, int, int]) -> dict[str, Any]:
    models = {key: ModelInput(ModelRef(key), Path(key), cfg, {}, ()) for key, cfg in configs.items()}
    doc = load_config_text(yaml.safe_dump(_slices(*((Path(m), s, e) for m, s, e in stack))))
    origins = tuple((str(Path(m)), layer) for m, s, e in stack for layer in range(s, e))
    return build_out_config(doc, models, str(Path(stack[0][0])), origins, {})


def test_derived_moe_layers_and_linear_attention_types_are_written_for_the_new_stack() -> None:
    # Configs without the lists: transformers derives them from the index, which a moved layer breaks.
    llama4 = {"model_type": "llama4_text", "num_hidden_layers": 4, "interleave_moe_layer_step": 2}
    assert _out_config({"a": llama4}, ("a", 0, 2), ("a", 1, 4))["moe_layers"] == [1, 2, 4]
    qwen = {"model_type": "qwen3_next", "num_hidden_layers": 4, "full_attention_interval": 2, "num_experts": 4,
            "decoder_sparse_step": 1, "mlp_only_layers": []}
    out = _out_config({"a": qwen}, ("a", 1, 4))
    assert out["layer_types"] == ["full_attention", "linear_attention", "full_attention"]


def test_a_stray_layer_without_mtp_tensors_is_still_refused() -> None:
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(4)]
    with pytest.raises(ModelInputError, match=r"config.json says 3 layers but the weights hold layers 0\.\.3"):
        infer_layout(names, {"num_hidden_layers": 3, "num_nextn_predict_layers": 1}, where="m")
    layout = infer_layout([*names, "model.layers.3.eh_proj.weight"], {"num_hidden_layers": 3}, where="m")
    assert layout.num_layers == 3 and layout.mtp is not None and layout.mtp.names() == [
        "model.layers.3.eh_proj.weight", "model.layers.3.mlp.up_proj.weight"]


def test_skip_lists_of_quantized_configs_name_the_output_layers() -> None:
    # An FP8 MoE config leaves every router unquantized by name; the MTP layer (3) goes to output index 2.
    ignore = ["lm_head", *(f"model.layers.{i}.mlp.gate" for i in range(4)), "re:.*layers\\.1\\..*norm"]
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 3, "quantization_config": {"ignore": ignore}}
    models = {"a": ModelInput(ModelRef("a"), Path("a"), config, {}, ())}
    doc = load_config_text(yaml.safe_dump(_slices((Path("a"), 0, 1), (Path("a"), 2, 3))))
    out = build_out_config(doc, models, "a", (("a", 0), ("a", 2)), {}, mtp=MtpOutcome(1, "", (("a", 3),)))
    assert out["quantization_config"]["ignore"] == ["lm_head", "re:.*layers\\.1\\..*norm", "model.layers.0.mlp.gate",
                                                    "model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]
    same = build_out_config(doc, models, "a", (("a", 0), ("a", 1), ("a", 2)), {}, mtp=MtpOutcome(1, "", (("a", 3),)))
    assert same["quantization_config"]["ignore"] == ignore and config["quantization_config"]["ignore"] == ignore

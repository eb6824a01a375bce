"""Parity of check's layer-streamed pass in the formats and families test_parity.py does not build: a ``.bin``
checkpoint, compressed-tensors (pack-quantized INT4, naive INT8, float FP8) read as their decoded values, DeepSeek-V3
and Qwen3-Next with their MTP modules stored (run as transformers runs them: without), and the text part of
multimodal models (their language model on text-only tokens, against transformers' text-only logits)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from resumerge.analyses.check.static import static_pass
from resumerge.errors import ModelInputError
from resumerge.forward.compared.passes import forward_pass, streams_of
from resumerge.machine.torch_import import torch

pytest.importorskip("transformers")

from tests.check.test_parity import as_checked, assert_streamed_logits

TOKENS = [[1, 5, 9, 33, 40, 2, 11, 60, 4, 6, 7], [1, 44, 3, 50]]


def assert_parity(directory: Path, reference: Callable[[torch.Tensor], torch.Tensor], tmp_path: Path) -> None:
    """The streamed logits of the model at ``directory`` are ``reference``'s (ids to float32 logits) to 1e-4, and
    the pass's NLL is the mean next-token loss of those logits."""
    model = as_checked(directory)
    assert_streamed_logits(model, reference, TOKENS)
    streams = streams_of([model])
    try:
        figures = forward_pass([model], streams, TOKENS, tmp_path / "journal")
    finally:
        for stream in streams:
            stream.close()
    with torch.no_grad():
        losses = [float(torch.nn.functional.cross_entropy(reference(torch.tensor([ids]))[0, :-1],
                                                          torch.tensor(ids[1:]), reduction="sum"))
                  for ids in TOKENS]
    assert figures.nll[0] == pytest.approx(sum(losses) / sum(len(t) - 1 for t in TOKENS), abs=1e-4)


def _causal(directory: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return lambda ids: model(input_ids=ids).logits


def _llama(directory: Path) -> Path:
    from families import FAMILIES, make_family_model

    return make_family_model(directory, next(f for f in FAMILIES if f.name == "llama"), 3)


@pytest.mark.parametrize("shards", [1, 2])
def test_a_bin_checkpoint_streams_as_its_safetensors_twin(tmp_path: Path, shards: int) -> None:
    """``pytorch_model.bin`` (one file, or shards named by its index): read as the merge reads it."""
    from safetensors.torch import load_file

    source = _llama(tmp_path / "st")
    target = tmp_path / "bin"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    state: dict[str, Any] = {}
    for file in sorted(source.glob("*.safetensors")):
        state.update(load_file(file))
    names = sorted(state)
    weight_map = {}
    for k in range(shards):
        file = "pytorch_model.bin" if shards == 1 else f"pytorch_model-{k + 1:05d}-of-{shards:05d}.bin"
        part = {n: state[n] for n in names[k::shards]}
        torch.save(part, target / file)
        weight_map.update(dict.fromkeys(part, file))
    if shards > 1:
        (target / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert not list(target.glob("*.safetensors"))
    assert_parity(target, _causal(source), tmp_path)


_CT_GROUPS: list[tuple[str, dict[str, Any], str]] = [
    (r".*mlp\.(gate|up)_proj", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 8,
                                "symmetric": False}, "pack-quantized"),
    (r".*mlp\.down_proj", {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
     "naive-quantized"),
    (r".*(q|k|v|o)_proj", {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
     "float-quantized"),
]


@pytest.mark.parametrize("scheme", ["int4", "mixed"])
def test_a_compressed_tensors_checkpoint_streams_as_its_decoded_values(tmp_path: Path, scheme: str) -> None:
    """compressed-tensors as stored (pack-quantized INT4 with its shapes; or INT4 packed with zero points, naive
    INT8 and FP8 by the library's own compressors): the pass sees what the codecs decode, so its logits are
    transformers' of the same model stored plainly with the decoded values."""
    pytest.importorskip("compressed_tensors")
    from quantmodels import ct_config, ct_library, int4, int4_config, quantize_model

    directory = _llama(tmp_path / "ct")  # sharded, with an index
    if scheme == "int4":
        quantize_model(directory, tmp_path / "decoded", int4(16), int4_config(16))
    else:
        quantize_model(directory, tmp_path / "decoded", ct_library(_CT_GROUPS), ct_config(_CT_GROUPS))
    assert any(n.endswith("weight_packed") for n in json.loads(
        (directory / "model.safetensors.index.json").read_text())["weight_map"])
    assert_parity(directory, _causal(tmp_path / "decoded"), tmp_path)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])
def test_a_model_with_its_mtp_module_streams_the_layers_transformers_runs(tmp_path: Path, family: str) -> None:
    """DeepSeek-V3's MTP layer (``model.layers.N``, N = num_hidden_layers) and Qwen3-Next's ``mtp.*`` are stored
    but not run: transformers builds neither, and the pass runs the decoder layers it builds."""
    from stack_families import make_stack_model, mtp_names

    directory = make_stack_model(tmp_path / family, family, 3)
    if family == "deepseek_v3":
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    assert mtp_names(as_checked(directory).opened.tensors, family)
    assert_parity(directory, _causal(directory), tmp_path)


@pytest.mark.parametrize(("family", "layout"), [("llava", "saved"), ("llava", "memory"), ("gemma3", "saved"),
                                                ("qwen2_vl", "saved"), ("qwen2_5_vl", "saved"),
                                                ("qwen3_vl_moe", "saved"), ("qwen3_vl_moe", "hub"),
                                                ("mistral3", "saved"), ("idefics3", "saved"), ("llama4", "saved")])
def test_the_text_part_of_a_multimodal_model_streams_as_transformers_runs_it_on_text(tmp_path: Path, family: str,
                                                                                      layout: str) -> None:
    """A VLM as transformers saves it (``language_model.model.layers.N``, Qwen2-VL's ``model.layers.N``,
    Idefics3's ``model.text_model.layers.N``; or transformers' in-memory names): the pass runs its language
    model's layers on text-only tokens (no image token among them), and its logits are the whole model's given
    the same ids and no image (Mistral 3's head tied by its top-level config, Gemma 3's soft-capped). Qwen3-VL-MoE's
    experts (fused; transposed as the hub stores them, which transformers transposes back as it loads) run in its
    MoE layers. Llama 4's text model is one level down (``language_model.model``): MoE layers 1 and 3, chunked
    attention, layer 3 without rotary embeddings (its queries temperature-tuned)."""
    from vlm_families import make_vlm, model_class, vlm

    directory = make_vlm(tmp_path / family, vlm(family), 3, layout)
    reference = model_class(vlm(family)).from_pretrained(directory, dtype=torch.float32)
    # transformers 5.24's Llama4ForConditionalGeneration.forward fails after its language model has run (it reads
    # image_outputs from the causal LM's output): text-only, its logits are its language model's on the same ids
    whole = reference.language_model if family == "llama4" else reference
    assert_parity(directory, lambda ids: whole(input_ids=ids).logits, tmp_path)


def test_llama4_text_streams_as_transformers_runs_it(tmp_path: Path) -> None:
    """``llama4_text`` (Llama4ForCausalLM: its text model under ``model``, which its ``base_model_prefix`` does not
    name): MoE layers 1 and 3 interleaved with dense ones, chunked attention (chunks of 4 tokens, shorter than
    the sequences), layer 3 without rotary embeddings."""
    from support import perturb_vectors
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    from vlm_families import LLAMA4_TEXT

    torch.manual_seed(3)
    model = Llama4ForCausalLM(Llama4TextConfig(**LLAMA4_TEXT))
    perturb_vectors(model, 3)
    model.save_pretrained(tmp_path / "llama4_text")
    assert model.config.moe_layers == [1, 3] and model.config.no_rope_layers == [1, 1, 1, 0]
    assert model.config.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    assert_parity(tmp_path / "llama4_text", _causal(tmp_path / "llama4_text"), tmp_path)


def test_llama4_streams_through_its_conditional_generation_class_too(tmp_path: Path) -> None:
    """The engine builds ``llama4`` as transformers' causal-LM class does (Llama4ForCausalLM of the text config);
    given the whole Llama4ForConditionalGeneration, it finds the language model two levels down
    (``language_model.model``) and runs the head inside ``language_model``, with the same logits."""
    from transformers import AutoConfig, Llama4ForConditionalGeneration
    from vlm_families import make_vlm, vlm

    from resumerge.forward.engine.built import build_modules
    from resumerge.forward.engine.onmeta import weights_on_meta

    directory = make_vlm(tmp_path / "llama4", vlm("llama4"), 3)
    config = AutoConfig.from_pretrained(directory)
    assert type(build_modules(directory, torch.float32, what="test")[1]).__name__ == "Llama4ForCausalLM"
    with weights_on_meta():
        whole = Llama4ForConditionalGeneration._from_config(config, dtype=torch.float32)
    reference = Llama4ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).language_model
    assert_streamed_logits(as_checked(directory), lambda ids: reference(input_ids=ids).logits, TOKENS,
                           built=(config, whole))


@pytest.mark.parametrize(("family", "layout", "vision", "stack"), [
    ("llava", "saved", ("vision_tower.", "multi_modal_projector."), "language_model.model.layers."),
    ("qwen3_vl_moe", "hub", ("model.visual.",), "model.language_model.layers."),
    ("llama4", "saved", ("vision_model.", "multi_modal_projector."), "language_model.model.layers.")])
def test_the_static_pass_groups_a_vision_tower_apart_from_the_decoder_layers(
        tmp_path: Path, family: str, layout: str, vision: tuple[str, ...], stack: str) -> None:
    """The vision tower and projector are one ``vision`` group; a multimodal MoE's fused expert stacks are its
    MoE layer's routed experts (Llama 4's shared expert and router apart); the head is ``head``."""
    from vlm_families import make_vlm, vlm

    merge, base = (as_checked(make_vlm(tmp_path / str(s), vlm(family), s, layout)) for s in (3, 4))
    names = set(merge.opened.tensors)
    figures = static_pass([merge, replace(base, role="base")])
    groups = {(g.layer, g.kind): g.tensors for g in figures.groups}
    assert groups[(None, "vision")] == sum(n.startswith(vision) for n in names) > 0
    assert groups[(0, "attention")] == sum(n.startswith(f"{stack}0.self_attn.") and "_norm." not in n for n in names)
    assert groups[(None, "head")] == 1 and (None, "other") not in groups
    assert sum(groups.values()) == len(names)
    if family != "llava":  # layer 1 is a MoE layer: its two fused stacks, the router, Llama 4's shared expert
        assert groups[(1, "routed experts")] == sum(n.startswith(f"{stack}1.") and ".experts." in n for n in names) == 2
        assert groups[(1, "router")] == 1 and (0, "routed experts") not in groups
        assert groups.get((1, "shared experts"), 0) == (3 if family == "llama4" else 0)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])
def test_the_static_pass_compares_an_mtp_module_as_a_group_of_its_own(tmp_path: Path, family: str) -> None:
    """The MTP tensors the forward pass does not run are compared by the static pass, as one ``mtp`` group
    outside the decoder layers (Qwen3-Next's ``mtp.layers.0`` is not counted in layer 0)."""
    from stack_families import make_stack_model, make_variant, mtp_names

    base = make_stack_model(tmp_path / "base", family, 3)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": int(family == "deepseek_v3")}))
    merge = make_variant(base, tmp_path / "merge", family, 5)
    models = [as_checked(merge), replace(as_checked(base), role="base")]
    figures = static_pass(models)
    groups = {(g.layer, g.kind): g for g in figures.groups}
    mtp = mtp_names(models[0].opened.tensors, family)
    assert groups[(None, "mtp")].tensors == len(mtp) and groups[(None, "mtp")].merge_moved > 0
    assert sum(g.tensors for g in figures.groups) == len(models[0].opened.tensors)
    assert sum(g.tensors for g in figures.groups if g.layer == 0) == sum(
        n.startswith("model.layers.0.") for n in models[0].opened.tensors)


def test_a_model_transformers_builds_no_causal_lm_of_is_refused_in_one_line(tmp_path: Path) -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2)
                               ).save_pretrained(tmp_path / "t5")
    with pytest.raises(ModelInputError, match=r"builds no causal language model for T5Config") as refused:
        streams_of([as_checked(tmp_path / "t5")])
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("family", ["llava", "gpt2"])
def test_the_memory_estimate_counts_layers_under_the_model_s_own_prefixes(tmp_path: Path, family: str) -> None:
    """A layer step reserves at least a decoder layer's weights in float32, wherever the checkpoint puts the
    layers (a VLM's ``language_model.model.layers.N``, GPT-2's ``transformer.h.N``: counted as 0 B before)."""
    from families import FAMILIES, make_family_model
    from vlm_families import make_vlm, vlm

    from resumerge.analyses.check.job import _fits
    from resumerge.forward.engine.layerlists import first_list
    from resumerge.inputs.safetensors_format import numel

    directory = (make_vlm(tmp_path / family, vlm(family), 3) if family == "llava" else
                 make_family_model(tmp_path / family, next(f for f in FAMILIES if f.name == family), 3))
    model = as_checked(directory)
    streams = streams_of([model])
    try:
        stack = streams[0].prefix(first_list(streams[0].stack))
        _, steps, _ = _fits(streams, TOKENS, None, can_fold=False)
    finally:
        for stream in streams:
            stream.close()
    layer0 = sum(4 * numel(tuple(t.entry.shape)) for n, t in model.opened.tensors.items() if n.startswith(f"{stack}0."))
    assert layer0 > 0 and steps["layer"] >= layer0

"""Parity of the layer-streamed forward engine with transformers' whole-model forward, per family the suite
builds: the same weights, in float32, give the same logits (to 1e-4), and check's NLL is transformers' loss on the
same tokens: families whose checkpoints transformers renames or fuses as it loads (experts stored one by one, a
renamed head) included. A model whose decoder layers the engine cannot find is refused in one line (exit 2)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from resumerge.analyses.check.models import Checked
from resumerge.config.modelref import ModelRef
from resumerge.errors import ModelInputError
from resumerge.forward.compared.passes import PassFigures, forward_pass, streams_of
from resumerge.forward.engine.reader import Weights
from resumerge.forward.engine.stream import ModelStream
from resumerge.inputs.model import open_model
from resumerge.machine.torch_import import torch

pytest.importorskip("transformers")

from families import FAMILIES, make_family_model
from moe_families import make_moe_model

STREAMED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "gpt2", "falcon", "bloom",
            "gptj",
            # transformers fuses these families' per-expert tensors, or renames the head, as it loads
            "mixtral", "qwen2_moe", "qwen3_moe", "gpt_neox")
STREAMED_MOE = ("gpt_oss", "qwen3_moe", "deepseek_v3", "glm4_moe", "qwen3_next")
TOKENS = [[1, 5, 9, 33, 70, 2, 11, 100, 4, 6, 7], [1, 44, 3, 90]]


def _model(directory: Path, name: str, moe: bool) -> Path:
    family = next((f for f in FAMILIES if f.name == name), None)
    return make_moe_model(directory, name, 3) if moe or family is None else make_family_model(directory, family, 3)


def as_checked(directory: Path) -> Checked:
    return Checked("merge", str(directory), None, open_model(ModelRef(str(directory)), directory=directory))


def assert_streamed_logits(model: Checked, reference: Callable[[torch.Tensor], torch.Tensor],
                           tokens: list[list[int]], built: tuple[Any, Any] | None = None) -> None:
    """``model``'s logits, run one decoder layer at a time by the forward engine, are ``reference``'s (a batch of
    ids to float32 logits) to 1e-4 for each of ``tokens``; ``built``: the config and modules to stream (default:
    those the engine builds)."""
    with ModelStream(Weights.of(model.opened.directory, model.opened.tensors), model.opened.config, torch.float32,
                     what="test", built=built) as stream, torch.no_grad():
        for ids in tokens:
            batch = torch.tensor([ids])
            ((hidden, calls),) = stream.inputs([(batch, torch.ones_like(batch))])
            for index, layer in enumerate(stream.layers_list):
                with stream.loaded(layer) as loaded:
                    hidden = stream.run(loaded, hidden, calls[index])
            with stream.head() as head:
                logits = head(hidden)
            expected = reference(batch)
            assert torch.allclose(logits, expected, atol=1e-4, rtol=0), (logits - expected).abs().max()


@pytest.mark.parametrize(("name", "moe"), [(n, False) for n in STREAMED] + [(n, True) for n in STREAMED_MOE])
def test_streamed_logits_and_nll_equal_transformers(tmp_path: Path, name: str, moe: bool) -> None:
    from transformers import AutoModelForCausalLM

    directory = _model(tmp_path / name, name, moe)
    model = as_checked(directory)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert_streamed_logits(model, lambda batch: reference(input_ids=batch).logits, TOKENS)
    streams = streams_of([model])
    figures = forward_pass([model], streams, TOKENS, tmp_path / "journal")
    for stream in streams:
        stream.close()
    with torch.no_grad():
        losses = [float(reference(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss) * (len(ids) - 1)
                  for ids in TOKENS]
    assert figures.nll[0] == pytest.approx(sum(losses) / sum(len(t) - 1 for t in TOKENS), abs=1e-4)


def test_a_model_whose_layers_cannot_be_followed_is_refused_in_one_line(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # A forward whose layer calls come in no order a pass can follow (every family the census builds is followed
    # now, XLM's four lists of parts included: tests/test_census.py), as the stream finds it for every output shape
    # it tries: one line naming the model's class, never a traceback.
    from resumerge.forward.engine import stream

    model = as_checked(_model(tmp_path / "m", "gpt2", False))  # (a family transformers builds, not .native)
    streams = streams_of([model])
    monkeypatch.setattr(stream, "in_order", lambda *args: None)
    try:
        with pytest.raises(ModelInputError, match="cannot follow GPT2Model's forward one layer at a time") as refused:
            forward_pass([model], streams, TOKENS, tmp_path / "journal")
    finally:
        for opened in streams:
            opened.close()
    assert "\n" not in str(refused.value)


def test_a_block_fp8_checkpoint_reads_as_its_decoded_values(tmp_path: Path) -> None:
    """Stored block-FP8 (codes and scales), the pass sees what the codecs decode: its NLL is transformers' loss of
    the same model stored plainly with DeepSeek's formula's values."""
    from quantmodels import fp8, fp8_config, quantize_model
    from transformers import AutoModelForCausalLM

    directory = _model(tmp_path / "fp8", "llama", False)  # sharded, with an index
    quantize_model(directory, tmp_path / "decoded", fp8((16, 16)), fp8_config((16, 16)))
    figures = figures_of(as_checked(directory), tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "decoded", dtype=torch.float32)
    with torch.no_grad():
        losses = [float(reference(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss) * (len(ids) - 1)
                  for ids in TOKENS]
    assert figures.nll[0] == pytest.approx(sum(losses) / sum(len(t) - 1 for t in TOKENS), abs=1e-4)


def figures_of(model: Checked, tmp_path: Path) -> PassFigures:
    streams = streams_of([model])
    try:
        return forward_pass([model], streams, TOKENS, tmp_path / "journal")
    finally:
        for stream in streams:
            stream.close()


def test_each_layer_of_each_model_and_the_heads_are_reserved_while_they_run(tmp_path: Path) -> None:
    # run_check hands the RAM governor's acquire in: every step holding weights is admitted by it, as the merge's
    # tensors are (before, the pass reserved nothing: the budget was only a refusal made up front).
    import contextlib

    held: list[tuple[str, str, bool]] = []

    @contextlib.contextmanager
    def reserve(what: str, step: str) -> Iterator[None]:
        held.append((what, step, False))
        yield
        held.append((what, step, True))

    models = [as_checked(_model(tmp_path / n, "llama", False)) for n in ("m", "p")]
    models[1] = Checked("parent", models[1].path, None, models[1].opened)
    streams = streams_of(models)
    try:
        forward_pass(models, streams, TOKENS, tmp_path / "journal", reserve=reserve)
    finally:
        for stream in streams:
            stream.close()
    layers = streams[0].layers
    expected = [("layer 0 of model 1 (can it run batches?)", "layer")] + [
        (f"layer {i} of model {m + 1}", "layer") for i in range(layers) for m in range(2)] + [("the heads", "heads")]
    assert [(w, s) for w, s, released in held if not released] == expected
    assert [(w, s) for w, s, released in held if released] == expected  # each released after its step


def test_an_mxfp4_gpt_oss_checkpoint_reads_as_its_decoded_values(tmp_path: Path) -> None:
    """gpt-oss as it ships (its expert stacks stored in MXFP4 blocks and scales), the pass sees what the codecs
    decode: its NLL is transformers' loss of the same model stored plainly with the decoded values."""
    from quantmodels import MXFP4_CONFIG, mxfp4_experts
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(7)
    config = AutoConfig.for_model(
        "gpt_oss", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0, head_dim=8,
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape))
    decoded, stored = tmp_path / "decoded", tmp_path / "mxfp4"
    model.save_pretrained(decoded)
    plain = load_file(decoded / "model.safetensors")
    packed: dict[str, torch.Tensor] = {}
    for name, tensor in plain.items():
        parts = mxfp4_experts(name, tensor) if name.endswith(("gate_up_proj", "down_proj")) else None
        if parts is None:
            packed[name] = tensor
            continue
        plain[name] = parts.pop("value")  # what the stored codes decode to
        packed |= parts
    assert any(k.endswith("_blocks") for k in packed), "no expert stack was stored in MXFP4"
    save_file(plain, decoded / "model.safetensors", metadata={"format": "pt"})
    stored.mkdir()
    save_file(packed, stored / "model.safetensors", metadata={"format": "pt"})
    (stored / "config.json").write_text(json.dumps(
        {**json.loads((decoded / "config.json").read_text()), "quantization_config": MXFP4_CONFIG}))
    figures = figures_of(as_checked(stored), tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(decoded, dtype=torch.float32)
    with torch.no_grad():
        losses = [float(reference(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss) * (len(ids) - 1)
                  for ids in TOKENS]
    assert figures.nll[0] == pytest.approx(sum(losses) / sum(len(t) - 1 for t in TOKENS), abs=1e-4)


def test_a_layer_read_through_transformers_conversion_prints_no_progress_bar(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-MoE stored one expert at a time: each layer goes through transformers' conversion, whose "Loading
    weights" bar was printed once a layer of every model; transformers' bars are as they were after it."""
    from transformers.utils import logging

    model = as_checked(_model(tmp_path / "m", "qwen3_moe", False))
    import sys

    # as a user's process has them (another test, or HF_HUB_DISABLE_PROGRESS_BARS, may have turned them off)
    monkeypatch.setattr(sys.modules["huggingface_hub.utils.tqdm"], "HF_HUB_DISABLE_PROGRESS_BARS", None)
    shown = logging.is_progress_bar_enabled()
    logging.enable_progress_bar()
    try:
        with ModelStream(Weights.of(model.opened.directory, model.opened.tensors), model.opened.config,
                         torch.float32, what="test") as stream:
            for layer in stream.layers_list:
                with stream.loaded(layer):
                    pass
        assert "Loading weights" not in capfd.readouterr().err
        assert logging.is_progress_bar_enabled()
    finally:
        if not shown:
            logging.disable_progress_bar()

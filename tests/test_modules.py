"""The ``modules:`` form on tiny VLMs: per-module models or slices, what inherits, and what mergekit gets wrong.

Three shapes: a Gemma 3 whose text decoder is a self-stack of one model while the vision tower and projector
come from another (config.json's text layer count and ``layer_types`` follow the stack, which mergekit leaves
stale); a slerp with a per-module ``t`` and a 0-layer projector given as a slice (equal to mergekit); a Llava
config listing only its text decoder (the other modules are copied from the donor and the plan says so, where
mergekit drops them). Errors name the YAML path, before any weight is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from mergekit_oracle import Mergekit
from support import api_merge as _run
from support import output_tensors as _tensors
from support import write_config
from vlm_families import inputs, make_vlm, model_class, vlm

from resumerge.cli.commands import main

pytest.importorskip("transformers", reason="transformers (a dependency of the mergekit test extra) is needed")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("modules")
    return {name: tuple(make_vlm(root / f"{name}-{s}", vlm(name), s, layout) for s in range(2))
            for name, layout in (("gemma3", "hub"), ("llava", "saved"))}


def _load(name: str, out: Path) -> Any:
    model, info = model_class(vlm(name)).from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    with torch.no_grad():
        assert torch.isfinite(model(**inputs(vlm(name), model)).logits).all()
    return model


def test_text_decoder_stacked_from_one_model_vision_from_another(
    pairs: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    a, b = pairs["gemma3"]
    out = _run(tmp_path, {"merge_method": "passthrough", "dtype": "float32", "modules": {
        "text_decoder": {"slices": [{"sources": [{"model": str(a), "layer_range": [0, 2]}]},
                                    {"sources": [{"model": str(a), "layer_range": [1, 2]}]}]},
        "vision_tower": {"slices": [{"sources": [{"model": str(b), "layer_range": [0, 2]}]},
                                    {"sources": [{"model": str(b), "layer_range": [0, 1]}]}]},
        "multi_modal_projector": {"models": [{"model": str(b)}]}}})
    got, ta, tb = _tensors(out), _tensors(a), _tensors(b)
    text_layers, vision_layers = "language_model.model.layers.", "vision_tower.vision_model.encoder.layers."
    for name, tensor in got.items():
        if name.startswith(text_layers):
            index, suffix = name[len(text_layers):].split(".", 1)
            assert torch.equal(tensor, ta[f"{text_layers}{(0, 1, 1)[int(index)]}.{suffix}"]), name
        elif name.startswith(vision_layers):
            index, suffix = name[len(vision_layers):].split(".", 1)
            assert torch.equal(tensor, tb[f"{vision_layers}{(0, 1, 0)[int(index)]}.{suffix}"]), name
        else:
            assert torch.equal(tensor, (tb if name.startswith(("vision_tower.", "multi_modal")) else ta)[name]), name
    loose = {n for n in ta if not n.startswith((text_layers, vision_layers))}
    assert {n for n in got if not n.startswith((text_layers, vision_layers))} == loose
    written = json.loads((out / "config.json").read_text())
    types = json.loads((a / "config.json").read_text())["text_config"]["layer_types"]
    assert written["text_config"]["num_hidden_layers"] == 3
    assert written["text_config"]["layer_types"] == [types[0], types[1], types[1]]
    assert written["vision_config"]["num_hidden_layers"] == 3
    model = _load("gemma3", out)
    assert model.config.text_config.num_hidden_layers == model.config.vision_config.num_hidden_layers == 3


def _slerp_doc(a: Path, b: Path) -> dict[str, Any]:
    return {"merge_method": "slerp", "base_model": str(a), "dtype": "float32", "parameters": {"t": 1.0}, "modules": {
        "text_decoder": {"parameters": {"t": 0.0}, "models": [{"model": str(a)}, {"model": str(b)}]},
        "vision_tower": {"models": [{"model": str(a)}, {"model": str(b)}]},
        "multi_modal_projector": {"slices": [{"sources": [{"model": str(a), "layer_range": [0, 0]},
                                                          {"model": str(b), "layer_range": [0, 0]}],
                                              "parameters": {"t": 0.5}}]}}}


def test_parameters_inherit_source_slice_module_top(pairs: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    a, b = pairs["gemma3"]
    got, ta, tb = _tensors(_run(tmp_path, _slerp_doc(a, b))), _tensors(a), _tensors(b)
    for name, tensor in got.items():
        if name.startswith("language_model."):
            assert torch.equal(tensor, ta[name]), name  # the module's t: 0 beats the top level's 1
        elif name.startswith("vision_tower."):
            assert torch.equal(tensor, tb[name]), name  # no module t: the top level's 1
        elif not torch.equal(ta[name], tb[name]):  # (Gemma 3's projection weight starts at zero in both)
            assert not torch.equal(tensor, ta[name]) and not torch.equal(tensor, tb[name]), name  # slice t: 0.5


@pytest.mark.oracle
def test_slerp_per_module_equals_mergekit(pairs: dict[str, tuple[Path, Path]], tmp_path: Path,
                                          mergekit: Mergekit) -> None:
    a, b = pairs["gemma3"]
    cfg = write_config(tmp_path / "c.yml", _slerp_doc(a, b))
    done = mergekit.run(cfg, tmp_path / "theirs", "--quiet", "--no-copy-tokenizer")
    assert done.returncode == 0, done.stderr[-2000:]
    mine, theirs = _tensors(_run(tmp_path, _slerp_doc(a, b))), _tensors(tmp_path / "theirs")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)


def test_unlisted_modules_are_copied_from_the_donor_and_said(
    pairs: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """mergekit plans only the listed modules (a Llava config listing text_decoder loses the vision tower)."""
    a, b = pairs["llava"]
    out = _run(tmp_path, {"merge_method": "linear", "modules": {"text_decoder": {
        "parameters": {"weight": 0.5}, "models": [{"model": str(a)}, {"model": str(b)}]}}})
    got, ta = _tensors(out), _tensors(a)
    assert got.keys() == ta.keys()
    assert all(torch.equal(got[n], ta[n]) for n in got if not n.startswith("language_model."))
    assert not torch.equal(got["language_model.model.norm.weight"], ta["language_model.model.norm.weight"])
    card = (out / "README.md").read_text()
    assert "module vision_tower is not listed under modules: it is copied unchanged from" in card
    assert main(["status", str(out), "--state-dir", str(tmp_path / "state")]) == 0
    assert "module multi_modal_projector is not listed" in capsys.readouterr().out
    _load("llava", out)


def test_mergekit_inferred_module_names_are_accepted_for_what_they_denote(
    pairs: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """mergekit has no JSON definition of Llava: it names the modules ``default`` (every loose tensor) and the
    layer prefixes as transformers 5 holds them (``mergekit-modules-moe.md`` §2.5 c); such configs run here."""
    a, b = pairs["llava"]
    out = _run(tmp_path, {"merge_method": "passthrough", "dtype": "float32", "modules": {
        "default": {"models": [{"model": str(a)}]},
        "model.language_model.layers": {"slices": [{"sources": [{"model": str(a), "layer_range": [0, 2]}]},
                                                   {"sources": [{"model": str(a), "layer_range": [1, 2]}]}]},
        "model.vision_tower.encoder.layers": {"models": [{"model": str(b)}]}}})
    got, ta, tb = _tensors(out), _tensors(a), _tensors(b)
    text_layers, vision_layers = "language_model.model.layers.", "vision_tower.encoder.layers."
    assert {n for n in got if not n.startswith(text_layers)} == {n for n in ta if not n.startswith(text_layers)}
    for name, tensor in got.items():
        if name.startswith(text_layers):
            index, suffix = name[len(text_layers):].split(".", 1)
            assert torch.equal(tensor, ta[f"{text_layers}{(0, 1, 1)[int(index)]}.{suffix}"]), name
        else:  # vision layers from B; every loose tensor (vision embeddings too) from default's model, A
            assert torch.equal(tensor, (tb if name.startswith(vision_layers) else ta)[name]), name
    assert sum(n.startswith(text_layers) for n in got) == 3 * sum(n.startswith(f"{text_layers}0.") for n in ta)


def _refused(a: Path, modules: dict[str, Any], fragment: str, tmp_path: Path,
             capsys: pytest.CaptureFixture[str]) -> None:
    """A passthrough config of ``modules`` (model ``A`` standing for ``a``) is refused (exit 2) saying ``fragment``,
    before OUT is made."""
    text = yaml.safe_dump({"merge_method": "passthrough", "modules": modules}).replace(" A\n", f" {a}\n")
    (tmp_path / "c.yml").write_text(text.replace("model: A\n", f"model: {a}\n"))
    assert main(["run", str(tmp_path / "c.yml"), str(tmp_path / "out"), "--quiet"]) == 2
    assert fragment in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("modules", "fragment"), [
    ({"default": {"models": ["A"]}, "text_decoder": {"models": ["A"]}}, "they split the model differently"),
    ({"language_model.model.layers": {"models": ["A"]}, "model.language_model.layers": {"models": ["A"]}},
     "name the same module"),
    ({"model.audio_tower.layers": {"models": ["A"]}}, "mergekit's inferred names: default, language_model.model"),
], ids=["mixed", "twice", "unknown"])
def test_inferred_module_names_refused_when_mixed_repeated_or_unknown(
    pairs: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    modules: dict[str, Any], fragment: str,
) -> None:
    _refused(pairs["llava"][0], modules, fragment, tmp_path, capsys)


@pytest.mark.parametrize(("module", "fragment"), [
    ({"text_decoder": {"merge_method": "slerp", "models": ["A"]}}, "modules.text_decoder.merge_method"),
    ({"text_decoder": {"models": ["A"], "slices": []}}, "Must specify either output slices or models"),
    ({"vision_encoder": {"models": ["A"]}}, "modules.vision_encoder: 'vision_encoder' is not a module"),
    ({"text_decoder": {"slices": [{"sources": [{"model": "A", "layer_range": [0, 3]}]}]}},
     "modules.text_decoder.slices[0].sources[0].layer_range"),
], ids=["unknown-key", "both-forms", "unknown-module", "range-past-end"])
def test_module_errors_name_the_yaml_path(
    pairs: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    module: dict[str, Any], fragment: str,
) -> None:
    _refused(pairs["llava"][0], module, fragment, tmp_path, capsys)

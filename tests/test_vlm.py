"""Multi-module models (VLMs) in the ``models:`` form: every module merged over its own layers, nothing dropped.

Tiny Llava (transformers 5 layout, llava-1.5 hub layout, in-memory layout), Gemma 3 (saved and hub layouts),
Qwen2-VL, Qwen2.5-VL, Mistral 3 and Idefics3 models (tests/vlm_families.py) are merged; each output must hold
every input tensor name, load with the family's class with no missing or unexpected key, and give finite logits
on a dummy image + text. A gradient ``weight: [1, 0]`` / ``[0, 1]`` makes each output tensor equal to exactly one
input, which shows each module's own layer numbering and ``t`` (layer k of n gets ``t = k / (n - 1)``; loose
tensors ``t = 0``). mergekit 0.1.5 runs in the worker's oracle process on the layouts it reads: complete outputs
must be tensor-equal to ours; the cases where it drops tensors or fails are asserted as documented
(``mergekit-modules-moe.md`` §0).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mergekit_oracle import Mergekit
from support import api_merge as _merge
from support import output_tensors as _tensors
from support import write_config
from vlm_families import VLMS, Vlm, inputs, make_vlm, model_class, vlm

from resumerge.cli.commands import main

pytest.importorskip("transformers", reason="transformers (a dependency of the mergekit test extra) is needed")
CASES = [(f.name, layout) for f in VLMS for layout in ("saved", *(("hub",) if f.hub_prefixes else ()))]
CASES.insert(1, ("llava", "memory"))
# mergekit's reads: complete (tensor-equal expected) and where it drops tensors or fails (documented).
MERGEKIT_COMPLETE = [("llava", "memory"), ("gemma3", "hub"), ("mistral3", "saved"), ("qwen2_5_vl", "saved"),
                     ("idefics3", "saved")]
MERGEKIT_WRITES = {("llava", "saved"): 43, ("llava", "hub"): 4, ("qwen2_vl", "saved"): None}


@pytest.fixture(scope="session")
def vlms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], tuple[Path, Path, Path]]]:
    """Three models (seeds 0, 1, 2) of every family in every layout, generated once per session."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("vlms")
    built = {}
    for name, layout in CASES:
        family = vlm(name)
        a, b, c = (make_vlm(root / f"{name}-{layout}-{s}", family, s, layout) for s in range(3))
        (a / "preprocessor_config.json").write_text('{"image_processor_type": "tiny"}\n')
        built[(name, layout)] = (a, b, c)
    yield built


def _gradient(a: Path, b: Path) -> dict[str, Any]:
    return {"merge_method": "linear", "dtype": "float32",
            "models": [{"model": str(a), "parameters": {"weight": [1.0, 0.0]}},
                       {"model": str(b), "parameters": {"weight": [0.0, 1.0]}}]}


def _linear(a: Path, b: Path) -> dict[str, Any]:
    return {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(a), "parameters": {"weight": 0.3}}, {"model": str(b), "parameters": {"weight": 0.7}}]}


def _load(family: Vlm, out: Path) -> None:
    """Load ``out`` with the family's class: no missing/unexpected key, finite logits on image + text."""
    model, info = model_class(family).from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    with torch.no_grad():
        logits = model(**inputs(family, model)).logits
    assert torch.isfinite(logits).all()


def _stack_index(name: str, family: str) -> tuple[int, int] | None:
    """(layer index, layer count) of a layer tensor of a 2-layer stack, or None for a loose tensor."""
    for marker in (".layers.", ".blocks."):
        if marker in name:
            return int(name.split(marker, 1)[1].split(".", 1)[0]), 2
    return None


@pytest.mark.parametrize(("name", "layout"), CASES, ids=[f"{n}-{lay}" for n, lay in CASES])
def test_models_form_merges_every_module_over_its_own_layers(
    name: str, layout: str, vlms: dict[tuple[str, str], tuple[Path, Path, Path]], tmp_path: Path
) -> None:
    family, (a, b, _) = vlm(name), vlms[(name, layout)]
    out = _merge(tmp_path, _gradient(a, b))
    got, ta, tb = _tensors(out), _tensors(a), _tensors(b)
    assert got.keys() == ta.keys()  # every input tensor, under its own name
    for tensor_name, tensor in got.items():
        where = _stack_index(tensor_name, name)
        # t = k / (n - 1) per module: layer 0 is A's, layer 1 is B's; loose tensors (projector, embeddings,
        # Qwen2-VL's merger.mlp.0/2, which mergekit plans as layers) are at t = 0, A's.
        want = tb if where is not None and where[0] == 1 else ta
        assert torch.equal(tensor, want[tensor_name]), tensor_name
    donor, written = json.loads((a / "config.json").read_text()), json.loads((out / "config.json").read_text())
    assert written["text_config"]["num_hidden_layers"] == donor["text_config"]["num_hidden_layers"]
    assert written["vision_config"] == donor["vision_config"]
    assert (out / "preprocessor_config.json").read_bytes() == (a / "preprocessor_config.json").read_bytes()
    _load(family, out)


METHOD_DOCS: dict[str, dict[str, Any]] = {
    "linear": {"parameters": {"weight": 0.5}},
    "passthrough": {"only": True},
    "slerp": {"base": True, "pair": True, "parameters": {"t": [0.0, 0.5]}},
    "nuslerp": {"pair": True, "parameters": {"weight": 0.5}},
    "multislerp": {"base": True, "parameters": {"weight": 0.5}},
    "karcher": {},
    "task_arithmetic": {"base": True, "parameters": {"weight": 0.5}},
    "ties": {"base": True, "parameters": {"weight": 0.5, "density": 0.5}},
    "dare_ties": {"base": True, "parameters": {"weight": 0.5, "density": 0.6}},
    "dare_linear": {"base": True, "parameters": {"weight": 0.5, "density": 0.6}},
    "breadcrumbs": {"base": True, "parameters": {"weight": 0.5, "density": 0.8, "gamma": 0.05}},
    "breadcrumbs_ties": {"base": True, "parameters": {"weight": 0.5, "density": 0.8, "gamma": 0.05}},
    "della": {"base": True, "parameters": {"weight": 0.5, "density": 0.5, "epsilon": 0.1}},
    "della_linear": {"base": True, "parameters": {"weight": 0.5, "density": 0.5, "epsilon": 0.1}},
    "sce": {"base": True, "parameters": {"select_topk": 0.5}},
    "ram": {"base": True},
    "ramplus_tl": {"base": True},
    "model_stock": {"base": True},
    "nearswap": {"base": True, "pair": True, "parameters": {"t": 0.01}},
    "arcee_fusion": {"base": True, "pair": True},
}
# Each method on one family, rotating through them (every family meets several methods).
METHOD_CASES = [(m, VLMS[i % len(VLMS)].name) for i, m in enumerate(METHOD_DOCS)]


@pytest.mark.parametrize(("method", "name"), METHOD_CASES, ids=[f"{m}-{n}" for m, n in METHOD_CASES])
def test_every_method_writes_every_tensor_and_loads(
    method: str, name: str, vlms: dict[tuple[str, str], tuple[Path, Path, Path]], tmp_path: Path
) -> None:
    spec, (a, b, c) = METHOD_DOCS[method], vlms[(name, "saved")]
    models = [a] if spec.get("only") else [a, b] if spec.get("pair") else [a, b, c]
    doc: dict[str, Any] = {"merge_method": method, "models": [{"model": str(m)} for m in models],
                           "parameters": spec.get("parameters", {})}
    if spec.get("base"):
        doc["base_model"] = str(a)
    out = _merge(tmp_path, doc)
    assert _tensors(out).keys() == _tensors(a).keys()
    _load(vlm(name), out)


def test_slices_of_a_multi_module_model_are_refused_naming_the_modules(
    vlms: dict[tuple[str, str], tuple[Path, Path, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, _, _ = vlms[("llava", "saved")]
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": str(a), "layer_range": [0, 2]}]}]})
    assert main(["run", str(cfg), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "slices[0].sources[0].model" in err and "vision_tower.encoder.layers (2 layers)" in err
    assert not (tmp_path / "out").exists()


def test_models_with_different_vision_towers_are_refused(
    vlms: dict[tuple[str, str], tuple[Path, Path, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    family = vlm("llava")
    deeper = {**family.config, "vision_config": {**family.config["vision_config"], "num_hidden_layers": 3}}
    other = make_vlm(tmp_path / "deep", Vlm("llava", family.model_class, family.config_class, deeper), 5)
    a, _, _ = vlms[("llava", "saved")]
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": [
        {"model": str(a), "parameters": {"weight": 0.5}}, {"model": str(other), "parameters": {"weight": 0.5}}]})
    assert main(["run", str(cfg), str(tmp_path / "out"), "--quiet"]) == 2
    assert "models have different modules" in capsys.readouterr().err


def _raised(traceback: str) -> str:
    """The exception that ended a traceback, "Type: message" on one line (a message may span several)."""
    headers = [m.start() for m in re.finditer(r"^\w+: ", traceback, re.MULTILINE)]
    return " ".join(traceback[headers[-1]:].split()) if headers else traceback.strip()


@pytest.fixture(scope="session")
def mergekit_runs(
    vlms: dict[tuple[str, str], tuple[Path, Path, Path]], tmp_path_factory: pytest.TempPathFactory,
    mergekit: Mergekit,
) -> dict[str, tuple[str, Path]]:
    """mergekit 0.1.5's result (``ok`` or its error's last line) and output folder for each case, run by the
    worker's shared oracle process (tests/mergekit_oracle.py: mergekit imported once, not in a process of this
    module's own)."""
    root = tmp_path_factory.mktemp("mergekit-vlm")
    runs = {}
    for name, layout in [*MERGEKIT_COMPLETE, *MERGEKIT_WRITES, ("qwen2_5_vl", "gradient")]:
        a, b, _ = vlms[(name, "saved" if layout == "gradient" else layout)]
        doc = _gradient(a, b) if layout == "gradient" else _linear(a, b)
        key = f"{name}-{layout}"
        done = mergekit.run(write_config(root / f"{key}.yml", doc), root / key, "--random-seed", "0", "--quiet",
                            "--no-copy-tokenizer")
        runs[key] = ("ok" if done.returncode == 0 else _raised(done.stderr), root / key)
    return runs


@pytest.mark.oracle
@pytest.mark.parametrize(("name", "layout"), MERGEKIT_COMPLETE, ids=[f"{n}-{lay}" for n, lay in MERGEKIT_COMPLETE])
def test_equal_to_mergekit_where_its_output_is_complete(
    name: str, layout: str, vlms: dict[tuple[str, str], tuple[Path, Path, Path]],
    mergekit_runs: dict[str, tuple[str, Path]], tmp_path: Path,
) -> None:
    result, theirs = mergekit_runs[f"{name}-{layout}"]
    assert result == "ok"
    a, b, _ = vlms[(name, layout)]
    out = _merge(tmp_path, _linear(a, b))
    mine, other = _tensors(out), _tensors(theirs)
    assert mine.keys() == other.keys()
    assert all(torch.equal(mine[n], other[n]) for n in mine)


@pytest.mark.oracle
def test_where_mergekit_drops_tensors_or_fails(
    vlms: dict[tuple[str, str], tuple[Path, Path, Path]], mergekit_runs: dict[str, tuple[str, Path]]
) -> None:
    """mergekit 0.1.5 with transformers 5: a Llava as transformers saves it loses its language model (43 of 64
    tensors written, exit 0), the llava-1.5 hub layout keeps only the projector (4), Qwen2-VL fails, and a
    Qwen2.5-VL gradient gives the projector MLP ``t = 1`` (planned twice). Ours: all tensors, ``t = 0``."""
    for (name, layout), count in MERGEKIT_WRITES.items():
        result, theirs = mergekit_runs[f"{name}-{layout}"]
        if count is None:
            assert result.startswith("RuntimeError") and result.endswith("has no attribute num_hidden_layers")
            continue
        assert result == "ok" and len(_tensors(theirs)) == count < len(_tensors(vlms[(name, layout)][0]))
    result, theirs = mergekit_runs["qwen2_5_vl-gradient"]
    a, b, _ = vlms[("qwen2_5_vl", "saved")]
    other, ta, tb = _tensors(theirs), _tensors(a), _tensors(b)
    assert result == "ok" and torch.equal(other["visual.merger.mlp.0.weight"], tb["visual.merger.mlp.0.weight"])
    assert torch.equal(other["visual.merger.ln_q.weight"], ta["visual.merger.ln_q.weight"])

"""Gemma 4's tables packed per layer (``embed_tokens_per_layer`` [vocab, layers·8], ``per_layer_model_projection``
[layers·8, hidden]) cut per layer for a stack of slices.

Before, a stack of other layers than the model's own was refused ("holds a part for each layer ... resumerge does
not yet cut such a table per layer"). Now each output layer's block comes from the models of the slice that made it,
at its source layer's block, merged as that slice merges the layer: a passthrough stack's tables are the source's
blocks concatenated by hand here, and the output loads in transformers with the logits of that model built by
hand; a linear stack of two models merges each block with its own slice's weights. The packing axis and width are
found from the models transformers builds (``hidden_size_per_layer_input``), not from the tensors' names.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from newest_families import make_newest_model
from safetensors.torch import save_file
from support import api_merge as _merge
from support import cli
from support import output_tensors as _tensors

from resumerge.merge.plan.packing import Packing, packed_tables

pytest.importorskip("transformers", reason="transformers (a dependency of the mergekit test extra) is needed")
TOKENS = torch.tensor([[1, 5, 9, 2, 77, 127]])
S, F = "sliding_attention", "full_attention"
EMBED, PROJECTION = "model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight"
W = 8  # the tiny Gemma 4's hidden_size_per_layer_input


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("gemma4")
    yield make_newest_model(root / "a", "gemma4", 0), make_newest_model(root / "b", "gemma4", 1)


def _blocks(table: torch.Tensor, axis: int, layers: list[int]) -> torch.Tensor:
    return torch.cat([table.narrow(axis, i * W, W) for i in layers], dim=axis)


def test_the_packed_tables_and_their_axis_are_found_from_the_model_transformers_builds(
    gemma4: tuple[Path, Path],
) -> None:
    doc = json.loads((gemma4[0] / "config.json").read_text())
    assert packed_tables(doc) == {EMBED: Packing(axis=1, width=W), PROJECTION: Packing(axis=0, width=W)}
    # the width is the config's, whatever the tensor is named
    assert packed_tables({**doc, "hidden_size_per_layer_input": 4}) == {EMBED: Packing(1, 4), PROJECTION: Packing(0, 4)}
    assert packed_tables({**doc, "hidden_size_per_layer_input": 0}) == {}


def test_a_donor_s_packed_tables_are_found_once_per_process(gemma4: tuple[Path, Path], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # a search plans every candidate over the same donor: its two models are built on the meta device once
    from resumerge.merge.plan import packing

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # none kept yet by this installation (see the next test)
    built: list[object] = []
    build = packing.build_meta
    monkeypatch.setattr(packing, "build_meta", lambda *args: built.append(args[2]) or build(*args))
    packing._packed.cache_clear()
    doc = json.loads((gemma4[0] / "config.json").read_text())
    assert packed_tables(doc) == packed_tables(json.loads(json.dumps(doc))) == {EMBED: Packing(1, W),
                                                                                PROJECTION: Packing(0, W)}
    assert len(built) == 2
    assert packed_tables({**doc, "hidden_size_per_layer_input": 4})[EMBED] == Packing(1, 4) and len(built) == 4


# A process of its own: whether it imported transformers, and the tables it found.
PACKED_IN_A_PROCESS = """
import json, sys
from resumerge.merge.plan.packing import packed_tables
found = packed_tables(json.loads(sys.argv[1]))
tables = {name: [packing.axis, packing.width] for name, packing in found.items()}
print(json.dumps({"imported": "transformers" in sys.modules, "tables": tables}))
"""


def test_a_later_process_finds_the_packed_tables_kept_without_importing_transformers(
        gemma4: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every resume and every start of a search plans its slices again: the first process builds the two models
    # (importing transformers, 3.5-4.5 CPU s), the next ones read what it found from resumerge's cache.
    from resumerge.merge.plan import packing

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    packing._packed.cache_clear()
    doc = json.loads((gemma4[0] / "config.json").read_text())
    llama = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 64}  # a family with none
    assert packed_tables(doc) == {EMBED: Packing(1, W), PROJECTION: Packing(0, W)} and packed_tables(llama) == {}
    kept = sorted((tmp_path / "cache" / "resumerge" / "transformers-facts").glob("packed-*.json"))
    assert len(kept) == 2
    script = tmp_path / "packed.py"
    script.write_text(PACKED_IN_A_PROCESS)
    for config, tables in ((doc, {EMBED: [1, W], PROJECTION: [0, W]}), (llama, {})):
        done = cli(json.dumps(config), script=script)  # a process of its own, the same cache
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout.splitlines()[-1]) == {"imported": False, "tables": tables}
    for path in kept:  # a file not theirs (torn, edited) is not read: the tables are found again, and kept again
        path.write_text("{torn")
    packing._packed.cache_clear()
    built: list[object] = []
    build = packing.build_meta
    monkeypatch.setattr(packing, "build_meta", lambda *args: built.append(args[2]) or build(*args))
    assert packed_tables(doc) == {EMBED: Packing(1, W), PROJECTION: Packing(0, W)} and len(built) == 2
    assert sorted(path.read_text() == "{torn" for path in kept) == [False, True]  # the llama's not asked again


@pytest.mark.parametrize(("ranges", "layer_types", "head_dims"), [
    (((0, 2), (1, 4)), [S, F, F, S, F], {"1": {"head_dim": 16}, "2": {"head_dim": 16}, "4": {"head_dim": 16}}),
    (((2, 4), (0, 2)), [S, F, S, F], {"1": {"head_dim": 16}, "3": {"head_dim": 16}}),
])
def test_a_stack_of_slices_takes_each_layer_s_block_of_the_packed_tables(
    ranges: tuple[tuple[int, int], ...], layer_types: list[str], head_dims: dict[str, Any],
    gemma4: tuple[Path, Path], tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    source = gemma4[0]
    doc = {"merge_method": "passthrough", "dtype": "float32",
           "slices": [{"sources": [{"model": str(source), "layer_range": list(r)}]} for r in ranges]}
    out = _merge(tmp_path, doc)
    layers = [i for start, end in ranges for i in range(start, end)]
    written = json.loads((out / "config.json").read_text())
    assert (written["num_hidden_layers"], written["layer_types"], written["per_layer_config"]) == (
        len(layers), layer_types, head_dims)
    # by hand: the source's layers renumbered, its packed tables cut to those layers' blocks
    src = _tensors(source)
    expected = {n: t for n, t in src.items() if not n.startswith("model.layers.")}
    for i, layer in enumerate(layers):
        start = f"model.layers.{layer}."
        expected.update({f"model.layers.{i}.{n[len(start):]}": t for n, t in src.items() if n.startswith(start)})
    expected[EMBED] = _blocks(src[EMBED], 1, layers)
    expected[PROJECTION] = _blocks(src[PROJECTION], 0, layers)
    got = _tensors(out)
    assert got.keys() == expected.keys()
    assert [n for n in expected if not torch.equal(got[n], expected[n])] == []
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    config = json.loads((source / "config.json").read_text())
    facts = {"num_hidden_layers": len(layers), "layer_types": layer_types, "per_layer_config": head_dims}
    (reference_dir / "config.json").write_text(json.dumps({**config, **facts}))
    save_file({n: t.clone() for n, t in expected.items()}, reference_dir / "model.safetensors",
              metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(reference_dir)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS).logits, reference(TOKENS).logits, rtol=0, atol=0)


def test_a_merged_stack_merges_each_block_as_its_slice_merges_the_layer(
    gemma4: tuple[Path, Path], tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    a, b = gemma4
    doc = {"merge_method": "linear", "dtype": "float32", "slices": [
        {"sources": [{"model": str(a), "layer_range": [0, 2], "parameters": {"weight": 1.0}},
                     {"model": str(b), "layer_range": [0, 2], "parameters": {"weight": 1.0}}]},
        {"sources": [{"model": str(a), "layer_range": [3, 4], "parameters": {"weight": 3.0}},
                     {"model": str(b), "layer_range": [1, 2], "parameters": {"weight": 1.0}}]},
    ]}
    out = _merge(tmp_path, doc)
    ta, tb = _tensors(a), _tensors(b)
    got = _tensors(out)
    for name, axis in ((EMBED, 1), (PROJECTION, 0)):
        want = torch.cat([(ta[name].narrow(axis, 0, W) + tb[name].narrow(axis, 0, W)) / 2,
                          (ta[name].narrow(axis, W, W) + tb[name].narrow(axis, W, W)) / 2,
                          (3 * ta[name].narrow(axis, 3 * W, W) + tb[name].narrow(axis, W, W)) / 4], dim=axis)
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-7)
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}

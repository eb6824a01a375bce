"""What a check holds is bounded by blocks, not by whole tensors (issue 57): the static pass reads each tensor a span
at a time, the heads read a block of the head's rows at a time, and the embeddings keep only the rows of the
tokens used. Each gives the figures, to the bit, that whole reads give."""

from __future__ import annotations

from pathlib import Path

import pytest

from resumerge.analyses.check import static
from resumerge.analyses.check.models import Checked
from resumerge.analyses.check.static import static_pass
from resumerge.config.modelref import ModelRef
from resumerge.forward.compared import heads
from resumerge.forward.compared.passes import batches_of, forward_pass, streams_of
from resumerge.inputs.model import open_model
from resumerge.machine.torch_import import torch

pytest.importorskip("transformers")

from families import FAMILIES, make_family_model

TOKENS = [[1, 5, 9, 33, 70, 2, 11, 100, 4, 6, 7], [1, 44, 3, 90], [7, 7, 120, 3, 2, 9]]


def _models(tmp_path: Path, family: str) -> list[Checked]:
    found = next(f for f in FAMILIES if f.name == family)
    models = []
    for role, seed in (("merge", 3), ("base", 4), ("parent", 5), ("parent", 6)):
        directory = make_family_model(tmp_path / f"{family}-{seed}", found, seed)
        models.append(Checked(role, str(directory), None, open_model(ModelRef(str(directory)), directory=directory)))
    return models


def _figures(models: list[Checked], workdir: Path) -> tuple[object, object]:
    streams = streams_of(models)
    try:
        return static_pass(models), forward_pass(models, streams, TOKENS, workdir)
    finally:
        for stream in streams:
            stream.close()


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # an untied head; a tied one with soft-capped logits
def test_spans_blocks_of_the_head_and_rows_of_the_embeddings_give_the_figures_of_whole_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    models = _models(tmp_path, family)
    monkeypatch.setattr(static, "_BLOCK", 64)
    monkeypatch.setattr(static, "_SPAN", 1 << 40)  # every tensor whole
    monkeypatch.setattr(heads, "HEAD_BLOCK_BYTES", 1 << 40)
    whole = _figures(models, tmp_path / "whole")
    monkeypatch.setattr(static, "_SPAN", 128)  # 1,536-value projections in 12 spans
    monkeypatch.setattr(heads, "HEAD_BLOCK_BYTES", 50 * 32 * 4)  # 48 of the 128 vocabulary rows a block
    streams = streams_of(models[:1])
    blocks = heads.head_blocks(streams[0])
    streams[0].close()
    assert blocks == [(0, 48), (48, 96), (96, 128)]
    assert _figures(models, tmp_path / "blocks") == whole
    assert not (tmp_path / "blocks" / heads.SCRATCH).exists()  # the log-probabilities kept on disk are gone


def test_static_figures_taken_from_the_layers_reads_are_the_static_pass_s_and_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The check folds the static pass into the forward pass's reads of the layers (resumerge.analyses.check.folded): the
    # same figures to the bit, the forward's too, and a pass stopped after layer 1 resumes with what it found.
    from resumerge.analyses.check.folded import FoldedStatic
    from resumerge.forward.job import layerpass

    models = _models(tmp_path, "llama")
    monkeypatch.setattr(static, "_BLOCK", 64)  # many blocks a tensor
    monkeypatch.setattr(static, "_SPAN", 128)
    expected = static_pass(models)
    roles, shapes = [m.role for m in models], static.logical_shapes(models)
    outside = static.tensor_results(models, only=lambda name: static.layer_of(name) is None)
    assert outside and all(static.layer_of(n) is None for n in outside)
    streams = streams_of(models)

    class Stopped(Exception):
        pass

    layers: list[str] = []

    def stop_after_two(point: str, **_: object) -> None:
        layers.append(point)
        if len(layers) == 2:
            raise Stopped

    try:
        plain = forward_pass(models, streams, TOKENS, tmp_path / "plain")
        monkeypatch.setattr(layerpass, "reach", stop_after_two)
        with pytest.raises(Stopped):
            forward_pass(models, streams, TOKENS, tmp_path / "folded", fold=FoldedStatic(roles, shapes))
        fold = FoldedStatic(roles, shapes)  # a new process's: what layers 0 and 1 found is in the journal
        assert forward_pass(models, streams, TOKENS, tmp_path / "folded", fold=fold) == plain
    finally:
        for stream in streams:
            stream.close()
    assert set(fold.found) == {n for n in shapes[0] if static.layer_of(n) is not None}  # every layer tensor, once
    assert static_pass(models, {**outside, **fold.found}) == expected
    # The merge's values are finite where their sum is, else as isfinite finds (test_realmodel: a NaN layer).
    nan = static.all_finite(torch.tensor([1.0, float("nan")])), static.all_finite(torch.tensor([float("inf"), 1.0]))
    assert nan == (False, False) and static.all_finite(torch.tensor([3e38, 3e38]))  # a sum overflowing is finite


def test_the_embeddings_rows_of_the_tokens_used_give_the_hidden_states_of_the_whole_table(tmp_path: Path) -> None:
    (model,) = _models(tmp_path, "llama")[:1]
    (stream,) = streams_of([model])
    try:
        batches = []
        for group in batches_of(TOKENS):
            longest = max(len(TOKENS[i]) for i in group)
            ids = torch.zeros(len(group), longest, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(group):
                ids[row, :len(TOKENS[i])] = torch.tensor(TOKENS[i])
                mask[row, :len(TOKENS[i])] = 1
            batches.append((ids, mask))
        with torch.no_grad():
            whole = stream.inputs(batches)
            rows = stream.inputs_of_rows(batches, block_bytes=7 * 32 * 4)  # 7 rows of the table a block
        for (a, _), (b, _) in zip(whole, rows):
            assert torch.equal(a, b)
        assert all(p.is_meta and p.shape == (128, 32) for p in stream.model.get_input_embeddings().parameters())
    finally:
        stream.close()


def test_the_token_sequences_are_kept_until_the_tokenizer_or_the_prompts_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A resumed check finds its journal by its tokens: kept, it need not load the tokenizer again to find them.
    from resumerge.forward.text import tokens

    loaded: list[Path] = []

    class Tokenizer:
        chat_template = None

        def __call__(self, text: str) -> dict[str, list[int]]:
            return {"input_ids": [ord(c) for c in text]}

    def load(directories: list[Path]) -> Tokenizer:
        loaded.append(directories[0])
        return Tokenizer()

    monkeypatch.setattr(tokens, "load_tokenizer", load)
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"x")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ab\ncde\n")
    cache = tmp_path / "checks"
    first = tokens.cached_sequences([model], prompts, cache).tokens
    assert first == [[97, 98], [99, 100, 101]] and len(loaded) == 1
    (model / "model.safetensors").write_bytes(b"changed weights")  # not what tokens depend on
    assert tokens.cached_sequences([model], prompts, cache).tokens == first and len(loaded) == 1
    prompts.write_text("xy\n")
    assert tokens.cached_sequences([model], prompts, cache).tokens == [[120, 121]] and len(loaded) == 2
    (model / "tokenizer.json").write_text('{"changed": 1}')
    assert tokens.cached_sequences([model], prompts, cache).tokens == [[120, 121]] and len(loaded) == 3
    for kept in (cache / tokens.TOKENS_DIR).iterdir():
        kept.write_text("not json")  # damaged: computed again
    assert tokens.cached_sequences([model], prompts, cache).tokens == [[120, 121]] and len(loaded) == 4


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_modules_built_without_weights_skip_drawing_them_and_keep_their_buffers(tmp_path: Path, family: str) -> None:
    """The weightless build marks its meta parameters initialised and leaves a meta tensor to torch.nn.init's
    functions untouched (a resume pays the build again), while its buffers are the ones a real build computes, and
    torch.nn.init is torch's own again after it (transformers' modules: llama's native ones draw nothing either,
    tests/check/test_native.py)."""
    from transformers import AutoModelForCausalLM

    from resumerge.forward.engine.built import build_modules
    from resumerge.forward.engine.onmeta import weights_on_meta

    directory = make_family_model(tmp_path / family, next(f for f in FAMILIES if f.name == family), 3)
    inits = dict(vars(torch.nn.init))
    config, built = build_modules(directory, torch.float32, what="test", native=False)
    assert dict(vars(torch.nn.init)) == inits
    assert all(p.is_meta and getattr(p, "_is_hf_initialized", False) for p in built.parameters())
    real = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ours, theirs = dict(built.named_buffers()), dict(real.named_buffers())
    assert ours.keys() == theirs.keys() and ours
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    drawn = torch.zeros(4)
    with weights_on_meta():
        assert torch.nn.init.normal_(torch.empty(4, device="meta")).is_meta
        torch.nn.init.normal_(drawn)
    assert bool(drawn.ne(0).any())  # a real tensor is still drawn inside the block


def test_a_local_check_imports_neither_the_merge_engine_nor_the_hub_nor_the_ledgers_writer() -> None:
    """Every check, a resumed one included, pays its imports again: the engine (via ``--executor``'s parsing and
    ``run --check``'s outcome), the hub's range reader and the ledger's writer (sqlite-utils) only where used."""
    import subprocess
    import sys

    code = ("import sys\nfrom resumerge.api import check\nfrom resumerge.api.flagmap import executor_option\n"
            "import resumerge.analyses.check.run, resumerge.cli.checkcmd\nassert executor_option('local') is None\n"
            "print(sorted(m for m in sys.modules\n"
            "             if m.startswith(('resumerge.merge.engine', 'resumerge.inputs.hub', 'sqlite_utils'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"

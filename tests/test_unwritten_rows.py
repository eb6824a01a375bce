"""Some rows of a tensor of a merge never written, merged alone: a generation's candidates merge of their input
embeddings only the rows their texts read. Each row is the same bytes as that row of the whole merge, for every
method that takes that path (elementwise ones, and the rank windows without a rescale: their cut taken from the
whole table's keys); a method that cannot (a random draw over the whole tensor, a rescale's norms) declines and the
table is merged whole. Tiny generated models: a few seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ModelFactory
from test_unwritten import SPEC, TEXTS, _config

from resumerge import api
from resumerge.forward.engine.reader import Weights
from resumerge.forward.engine.stream import ModelStream
from resumerge.merge.engine.compute import TensorCompute
from resumerge.merge.methods.rankstream import StreamedWindow, key_counts

EMBED = "model.embed_tokens.weight"
# Rows with runs and gaps, the first and the last among them.
ROWS = torch.tensor([0, 1, 2, 5, 9, 10, 31, 40, 63])


@pytest.mark.parametrize(("start", "stop", "descending"), [(0, 37, True), (0, 1, True), (11, 70, False),
                                                           (30, 31, False), (0, 100, True), (5, 5, True)])
@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_windows_mask_at_some_positions_is_its_whole_mask_there(start: int, stop: int, descending: bool,
                                                                   counted: bool, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(start * 100 + stop)
    # Long runs of equal keys at every bound; counted: keys exact at shift 16 (bfloat16's), the bounds read from
    # their histogram.
    keys = torch.randint(0, 6, (100,), generator=generator, dtype=dtype) << 16
    shift = 16 if counted else None
    whole = StreamedWindow(100, start, stop, descending=descending, shift=shift, whole=True).mask(keys, torch.bfloat16)
    counts = key_counts(keys, 16) if counted else None
    for trial in range(20):
        positions = torch.nonzero(torch.rand(100, generator=generator) < (trial + 1) / 20).reshape(-1)
        if not len(positions):
            continue
        window = StreamedWindow(100, start, stop, descending=descending, shift=shift, whole=True)
        at = window.mask_at(keys, positions, torch.bfloat16, counts)
        assert torch.equal(at.view(torch.int16), whole[positions].view(torch.int16)), positions.tolist()
    with pytest.raises(ValueError, match="whole window"):
        StreamedWindow(100, start, stop, descending=descending).mask_at(keys, positions, torch.bfloat16)


def _docs(models: list[str]) -> list[tuple[dict[str, Any], bool]]:
    """Candidate configs, each with whether its embeddings' rows are merged alone."""
    pair = [{"model": models[1], "parameters": {"weight": 0.6, "density": 0.45, "gamma": 0.05}},
            {"model": models[2], "parameters": {"weight": 0.4, "density": 0.3, "gamma": 0.1}}]

    def doc(method: str, **extra: Any) -> dict[str, Any]:
        return {"merge_method": method, "base_model": models[0], "models": pair, **extra}

    return [(doc("ties", dtype="bfloat16"), True),  # bfloat16 magnitudes: equal keys straddle the cut
            (doc("ties", parameters={"normalize": False}), True),
            (doc("breadcrumbs_ties", dtype="bfloat16"), True),
            (doc("breadcrumbs"), True),
            (doc("task_arithmetic", dtype="bfloat16"), True),
            ({"merge_method": "linear", "models": [{"model": m, "parameters": {"weight": w}} for m, w in
                                                   zip(models, (0.2, 0.3, 0.5), strict=True)]}, True),
            (doc("ties", parameters={"rescale": True}), False),  # its norms sum every kept entry of the table
            (doc("dare_ties", dtype="bfloat16"), False)]  # drawn over the whole table, in order


def test_the_rows_merged_alone_are_the_whole_merges_rows_and_a_method_that_cannot_declines(
        tmp_path: Path, make: ModelFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    models = [str(make(name, seed=seed, **SPEC)) for seed, name in enumerate(("base", "a", "b"), start=1)]
    docs = _docs(models)
    configs = [_config(tmp_path / f"candidate{i}.yml", doc) for i, (doc, _) in enumerate(docs)]
    wholes: list[str] = []
    whole = TensorCompute.whole

    def counted(self: TensorCompute, *args: Any, **kwargs: Any) -> Any:
        wholes.append(self.tp.name)
        return whole(self, *args, **kwargs)

    monkeypatch.setattr(TensorCompute, "whole", counted)
    # One block for all: the whole table's keys and task vectors shared, as in a pass.
    with api.open_population(configs,
                             settings=api.Settings(state_dir=tmp_path / "state")) as population, population.layer():
        for candidate, (doc, alone) in zip(population.candidates, docs, strict=True):
            t = candidate.tensors[EMBED]
            where = (t.file, t.entry.start, t.entry.end, t.entry.dtype, tuple(t.entry.shape))
            rows = candidate.source.read_rows(*where, ROWS)
            assert wholes == [], doc["merge_method"]
            all_rows = candidate.source.read_tensor(*where)
            assert wholes == [EMBED]
            wholes.clear()
            if not alone:
                assert rows is None, doc
                continue
            assert rows is not None, doc
            want = all_rows[ROWS].contiguous()
            assert rows.dtype == want.dtype and rows.shape == want.shape
            assert torch.equal(rows.view(torch.uint8), want.view(torch.uint8)), doc
            # The head's rows are not asked for this way by a pass, but any plain 2-D tensor answers alike.
            head = candidate.tensors["lm_head.weight"]
            there = (head.file, head.entry.start, head.entry.end, head.entry.dtype, tuple(head.entry.shape))
            head_rows = candidate.source.read_rows(*there, ROWS)
            assert head_rows is not None
            want = candidate.source.read_tensor(*there)[ROWS].contiguous()
            assert torch.equal(head_rows.view(torch.uint8), want.view(torch.uint8)), doc
            wholes.clear()


def test_a_pass_reads_only_the_rows_its_texts_use_into_the_same_hidden_states(tmp_path: Path,
                                                                                make: ModelFactory) -> None:
    models = [str(make(name, seed=seed, **SPEC)) for seed, name in enumerate(("base", "a", "b"), start=1)]
    docs = _docs(models)
    configs = [_config(tmp_path / f"candidate{i}.yml", doc) for i, (doc, _) in enumerate(docs)]
    batches = [(torch.tensor([t]), torch.ones(1, len(t), dtype=torch.long)) for t in TEXTS]
    with api.open_population(configs,
                             settings=api.Settings(state_dir=tmp_path / "state")) as population, torch.no_grad():
        for candidate, (doc, alone) in zip(population.candidates, docs, strict=True):
            stream = ModelStream(Weights.of(candidate.directory, candidate.tensors, source=candidate.source),
                                 candidate.config, torch.float32, what="test")
            with stream, population.layer():
                before = candidate.source.computed
                rows = stream.inputs_of_rows(batches)
                # Alone: no whole tensor merged for the embeddings (a decliner merges the table whole).
                assert candidate.source.computed - before == (0 if alone else 1), doc
                whole = stream.inputs(batches)
            for (a, _), (b, _) in zip(rows, whole, strict=True):
                assert torch.equal(a, b), doc

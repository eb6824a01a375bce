"""A generation of candidate merges read in one streamed pass (:func:`resumerge.api.open_population`): per layer
each input byte range is read once for every candidate, each candidate's tensors are its single unwritten source's
byte for byte, the forward figures of a pass over every candidate are each one's own, and what a generation holds
is said before it runs."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ModelFactory
from test_unwritten import SPEC, TEXTS, _config, _unwritten_tensors
from textnll import population_nlls, stream_nlls

from resumerge import api
from resumerge.errors import UsageError
from resumerge.forward.engine.reader import Weights
from resumerge.inputs.source import InputSources, LocalFiles
from resumerge.merge.engine.compute import TensorCompute
from resumerge.merge.engine.unwritten import Population, generation_bytes, largest_popsize, layer_of
from resumerge.merge.plan import workunits


class CountedFiles(LocalFiles):
    """A model's local files, every read counted in ``counts`` by (model, file, start, end)."""

    def __init__(self, key: str, directory: str, counts: Counter[tuple[str, str, int, int]]) -> None:
        super().__init__(directory)
        self.key, self.counts = key, counts

    def read_tensor(self, file: str, start: int, end: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        self.counts[(self.key, file, start, end)] += 1
        return super().read_tensor(file, start, end, dtype, shape)


def _candidates(tmp_path: Path, make: ModelFactory) -> list[Path]:
    base, a, b = (make(name, seed=seed, **SPEC) for seed, name in enumerate(("base", "a", "b"), start=1))
    models = [str(base), str(a), str(b)]
    docs: list[dict[str, Any]] = [
        {"merge_method": "ties", "base_model": models[0], "parameters": {"normalize": True}, "models": [
            {"model": models[1], "parameters": {"weight": 0.6, "density": 0.5}},
            {"model": models[2], "parameters": {"weight": 0.4, "density": 0.7}}]},
        {"merge_method": "ties", "base_model": models[0], "models": [
            {"model": models[1], "parameters": {"weight": 0.3, "density": 0.9}},
            {"model": models[2], "parameters": {"weight": 0.9, "density": 0.3}}]},
        {"merge_method": "task_arithmetic", "base_model": models[0], "models": [
            {"model": models[1], "parameters": {"weight": 0.5}}, {"model": models[2], "parameters": {"weight": 0.7}}]},
        {"merge_method": "linear", "dtype": "bfloat16", "models": [
            {"model": m, "parameters": {"weight": w}} for m, w in zip(models, (0.2, 0.3, 0.5), strict=True)]},
    ]
    return [_config(tmp_path / f"candidate{i}.yml", doc) for i, doc in enumerate(docs)]


def _every_tensor_by_layer(population: Population) -> list[dict[str, torch.Tensor]]:
    """Each candidate's every tensor, read layer by layer as a pass reads them (the embeddings first)."""
    got: list[dict[str, torch.Tensor]] = [{} for _ in population.candidates]
    for index in sorted({layer_of(n) for n in population.plans[0].tensors}, key=lambda i: -1 if i is None else i):
        with population.layer():
            for c, candidate in enumerate(population.candidates):
                for name, t in candidate.tensors.items():
                    if layer_of(name) == index:
                        got[c][name] = candidate.source.read_tensor(t.file, t.entry.start, t.entry.end,
                                                                    t.entry.dtype, tuple(t.entry.shape))
    return got


def test_each_input_range_is_read_once_per_generation_and_every_candidate_is_its_own_merge(
        tmp_path: Path, make: ModelFactory) -> None:
    configs = _candidates(tmp_path, make)
    state = tmp_path / "state"
    with api.open_population(configs, settings=api.Settings(state_dir=state)) as opened:
        plans = opened.plans
    counts: Counter[tuple[str, str, int, int]] = Counter()
    counted = InputSources({k: CountedFiles(k, d, counts) for k, d in plans[0].model_dirs.items()})
    with Population(plans, state / "unwritten", inputs=counted) as population:
        got = _every_tensor_by_layer(population)
        assert population.candidates[0].directory == population.candidates[1].directory  # one folder for all
    every = {(r.model, r.file, r.start, r.end) for plan in plans for tp in plan.tensors.values() for r in tp.reads()}
    assert set(counts) == every and set(counts.values()) == {1}
    counted.close()
    for config, tensors in zip(configs, got, strict=True):
        with api.open_unwritten(config, settings=api.Settings(state_dir=state)) as single:
            want = _unwritten_tensors(single)
        assert sorted(want) == sorted(tensors)
        for name, t in want.items():
            assert torch.equal(t.contiguous().view(torch.uint8), tensors[name].contiguous().view(torch.uint8)), name


def test_what_depends_on_the_inputs_alone_is_computed_once_for_the_generation(tmp_path: Path,
                                                                            make: ModelFactory) -> None:
    configs = _candidates(tmp_path, make)[:3]  # two ties candidates and a task_arithmetic one, float32
    state = tmp_path / "state"
    with api.open_population(configs, settings=api.Settings(state_dir=state)) as population:
        got: list[dict[str, torch.Tensor]] = [{} for _ in configs]
        for c, candidate in enumerate(population.candidates):
            with population.layer():  # each candidate in a block of its own: nothing shared
                for name, t in candidate.tensors.items():
                    got[c][name] = candidate.source.read_tensor(t.file, t.entry.start, t.entry.end, t.entry.dtype,
                                                                tuple(t.entry.shape))
        alone = dict(population.loaded.computed)
        assert not population.loaded.reused["inputs"]  # (a merge's own task vector is read by its keys and its sum)
        population.loaded.computed.clear()
        population.loaded.reused.clear()
        with population.layer():  # one block for all: each chunk's inputs and task vectors computed once
            for c, candidate in enumerate(population.candidates):
                for name, t in candidate.tensors.items():
                    shared = candidate.source.read_tensor(t.file, t.entry.start, t.entry.end, t.entry.dtype,
                                                          tuple(t.entry.shape))
                    assert torch.equal(shared.view(torch.uint8), got[c][name].view(torch.uint8)), (c, name)
        together, reused = population.loaded.computed, population.loaded.reused
    # Alone, each candidate computes its own; together, the first computes and the two others reuse it.
    assert alone["inputs"] == 3 * together["inputs"] and reused["inputs"] == 2 * together["inputs"] > 0
    assert alone["task vector"] == 3 * together["task vector"] > 0
    # Only the ties candidates rank: their keys computed once, then read by the other ties candidate.
    assert alone["task vector keys"] == 2 * together["task vector keys"] > 0
    assert population.loaded.peak_kept > 0


def test_a_value_the_method_does_not_declare_is_never_shared() -> None:
    from resumerge.merge.engine.unwritten.population import LayerInputs
    from resumerge.merge.methods.task_stream import TASK_KEYS
    from resumerge.merge.methods.task_vectors import TASK_VECTOR

    layer = LayerInputs()
    with layer.sharing():
        memo = layer.memo("chunk", (TASK_VECTOR,))
        one = torch.ones(3)
        assert memo.value(TASK_VECTOR, 1, lambda: one) is one
        assert memo.value(TASK_VECTOR, 1, lambda: torch.zeros(3)) is one  # kept for the next merge
        with pytest.raises(ValueError, match="not declared"):
            memo.value(TASK_KEYS, 1, lambda: one)
    assert layer.memo("chunk", (TASK_VECTOR,)).value(TASK_VECTOR, 1, lambda: torch.zeros(3)).sum() == 0


def test_a_pass_over_the_generation_gives_each_candidate_its_own_figures(tmp_path: Path,
                                                                        make: ModelFactory) -> None:
    configs = _candidates(tmp_path, make)[:3]
    state = tmp_path / "state"
    with api.open_population(configs, settings=api.Settings(state_dir=state)) as population:
        figures = population_nlls(population, TEXTS)
        distinct = {(r.model, r.file, r.start, r.end) for p in population.plans for tp in p.tensors.values()
                    for r in tp.reads()}
        assert population.shared.reads == len(distinct)  # the whole generation: one read of each range
        # Held: one layer's inputs at a time, never the models.
        assert population.shared.peak_kept < population.shared.bytes_read / 2
        assert population.shared.peak_kept <= generation_bytes(population.plans, 1)
        # With the task vectors kept for every candidate: within what the generation is said to hold.
        assert population.loaded.peak_kept > 0
        assert population.shared.peak_kept + population.loaded.peak_kept <= population.holds(popsize=1, shared=True)
        assert population.holds(popsize=1, shared=True) > generation_bytes(population.plans, 1)
    for config, figure in zip(configs, figures, strict=True):
        with api.open_unwritten(config, settings=api.Settings(state_dir=state)) as single:
            own = stream_nlls(Weights.of(single.directory, single.tensors, source=single.source), single.config, TEXTS)
        assert figure == pytest.approx(own, abs=1e-6, rel=0)
    assert figures[0] != figures[1]


def test_a_generation_merges_whole_what_run_merges_in_statistics_passes_with_the_same_bytes(
        tmp_path: Path, make: ModelFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks of a few rows: run (and a merge alone) takes TIES' statistics passes over each tensor's chunks; a
    # generation's candidates merge each tensor whole from the keys they share, faster, into the same bytes.
    monkeypatch.setattr(workunits, "CHUNK_ELEMENTS", 256)
    monkeypatch.setattr(workunits, "STACKED_ELEMENTS", 512)
    configs = _candidates(tmp_path, make)[:2]  # the two TIES candidates
    state = tmp_path / "state"
    passes: Counter[str] = Counter()
    observe = TensorCompute.observe

    def counted(self: TensorCompute, pass_index: int, first: int, stop: int) -> None:
        passes[self.tp.name] += 1
        observe(self, pass_index, first, stop)

    monkeypatch.setattr(TensorCompute, "observe", counted)
    with api.open_population(configs, settings=api.Settings(state_dir=state)) as population:
        got = _every_tensor_by_layer(population)
    assert not passes
    for config, tensors in zip(configs, got, strict=True):
        with api.open_unwritten(config, settings=api.Settings(state_dir=state)) as single:
            want = _unwritten_tensors(single)
        assert passes  # alone, as run computes it: in passes
        assert sorted(want) == sorted(tensors)
        for name, t in want.items():
            assert torch.equal(t.view(torch.uint8), tensors[name].view(torch.uint8)), name


def test_what_a_generation_holds_is_said_before_it_runs(tmp_path: Path, make: ModelFactory) -> None:
    configs = _candidates(tmp_path, make)
    with api.open_population(configs, settings=api.Settings(state_dir=tmp_path / "state")) as population:
        plans = population.plans
        hidden = 3 * 8 * SPEC["hidden"] * 4  # three texts of eight tokens, float32
        one, four = generation_bytes(plans, 1, hidden), generation_bytes(plans, 4, hidden)
        assert four - one == 3 * hidden and population.holds(hidden_bytes=hidden, shared=False) == four
        # As the pass holds it: what is kept for every candidate counted while sharing is enabled, not after.
        kept = generation_bytes(plans, 4, hidden, shared=True)
        assert population.loaded.enabled and population.holds(hidden_bytes=hidden) == kept > four
        assert population.largest_popsize(kept, hidden) == 4 == largest_popsize(plans, kept, hidden, shared=True)
        assert population.largest_popsize(kept - 1, hidden) == 3
        population.loaded.enabled = False
        assert population.holds(hidden_bytes=hidden) == four and population.largest_popsize(kept - 1, hidden) >= 4
        population.loaded.enabled = True
        # At least a layer's inputs: every range one decoder layer of the candidates reads.
        layer0 = {(r.model, r.file, r.start, r.end): r.end - r.start for p in plans for tp in p.tensors.values()
                  if layer_of(tp.name) == 0 for r in tp.reads()}
        assert one > sum(layer0.values())
        budget = four + hidden // 2
        assert largest_popsize(plans, budget, hidden) == 4 == population.largest_popsize(budget, hidden, shared=False)
        assert largest_popsize(plans, one - 1, hidden) == 0
        with pytest.raises(UsageError):
            generation_bytes(plans, 0, hidden)


def test_candidates_over_other_models_or_a_recipe_are_refused(tmp_path: Path, make: ModelFactory) -> None:
    configs = _candidates(tmp_path, make)
    other = make("other", seed=9, **SPEC)
    odd = _config(tmp_path / "odd.yml", {"merge_method": "linear", "models": [
        {"model": str(other), "parameters": {"weight": 0.5}}, {"model": str(tmp_path / "models" / "a"),
                                                               "parameters": {"weight": 0.5}}]})
    with pytest.raises(UsageError, match="other models"):
        api.open_population([configs[0], odd], settings=api.Settings(state_dir=tmp_path / "state"))
    recipe = _config(tmp_path / "recipe.yml", [{"name": "s", "merge_method": "linear", "models": [
        {"model": str(other), "parameters": {"weight": 1.0}}]}, {"merge_method": "linear", "models": [
            {"model": "s", "parameters": {"weight": 1.0}}]}])
    with pytest.raises(UsageError, match="one merge config"):
        api.open_population([recipe], settings=api.Settings(state_dir=tmp_path / "state"))
    with pytest.raises(UsageError):
        api.open_population([], settings=api.Settings(state_dir=tmp_path / "state"))

"""A generation scored in one streamed pass per task: every candidate a merge never written
(:class:`~resumerge.engine.unwritten.Population`), so that at each decoder layer each parent's layer tensors are
read once and every candidate's layer is merged from them in memory by ``run``'s own method code, run on that
candidate's hidden states, and dropped. The pass is check's (:func:`~resumerge.analyses.check.passes.run_pass`:
the same batches and padding, every model's hidden states journaled after each layer, so a killed pass resumes at
the layer it reached); the models here are the candidates and, for a ``kl`` task, its parent last. The heads give
each candidate the figures its written merge gives (:mod:`.scoring`): KL(parent ‖ candidate) per predicted token,
and its NLL per predicted token.

What it holds: the parents' layer (kept for every candidate inside the layer's block), one candidate's layer while
it runs, and every candidate's hidden states."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.analyses.check.heads import HeadTotals, kl_at, logprobs, nll_sum, targets_of
from resumerge.analyses.check.passes import batched_on, model_layer, run_pass, streams_of
from resumerge.analyses.check.tokens import cached_sequences
from resumerge.config.locations import StateDir
from resumerge.errors import UsageError
from resumerge.evolve import storage
from resumerge.evolve.spec import Task
from resumerge.forward import Weights
from resumerge.forward.opened import PassModel, open_for_pass
from resumerge.forward.stream import LayerCall, ModelStream
from resumerge.torch_import import torch

if TYPE_CHECKING:
    from resumerge.engine.unwritten import Population

# Opens the candidate merge configs (YAML texts) of one generation as a population (handed in by the API).
OpenPopulation = Callable[[Sequence[str]], AbstractContextManager["Population"]]


class StreamedCandidates:
    """Scores a generation's candidates in one pass per task (see the module's docstring); ``tokenizer``: the
    folder whose tokenizer reads the texts (None: the candidates' own), ``state``: where the parents' small files
    are found (a hub parent's), ``device``: where the passes' layers run."""

    def __init__(self, store: Path, tasks: Sequence[Task], open_population: OpenPopulation,
                 tokenizer: Path | None, state: StateDir, device: str = "cpu") -> None:
        self.store, self.open_population, self.device = store, open_population, device
        self.tasks = tuple(t for t in tasks if t.kind in ("kl", "nll"))
        self.tokenizer, self.state = tokenizer, state

    def score(self, generation: int, configs: Sequence[Mapping[str, Any]],
              done: Callable[[int], dict[str, float] | None],
              record: Callable[[int, dict[str, float]], None]) -> list[dict[str, float]]:
        import yaml

        found = {i: done(i) for i in range(len(configs))}
        pending = [i for i, figures in found.items() if figures is None]
        # A population reads one set of models: slerp's candidates may each read two of three, so those that read
        # the same models are a population of their own (one for every candidate of the other methods).
        groups: dict[tuple[str, ...], list[int]] = {}
        for i in pending:
            groups.setdefault(_models_read(configs[i]), []).append(i)
        for group in groups.values():
            texts = [yaml.safe_dump(dict(configs[i]), sort_keys=False) for i in group]
            storage.say(self.store, generation=generation, candidate=group[0], phase="plan", layer=None,
                        layers=None)
            figures: dict[int, dict[str, float]] = {i: {} for i in group}
            with self.open_population(texts) as population:
                for number, task in enumerate(self.tasks):
                    # Named by the candidates it runs: a pass journaled for others is never resumed as theirs.
                    work = (self.store / storage.WORK / f"generation-{generation:04d}"
                            / f"task-{number}-candidates-{'-'.join(map(str, group))}")
                    values = self._task(population, task, work)
                    for i, value in zip(group, values):
                        figures[i][task.name] = value
            for i in group:
                record(i, figures[i])
                found[i] = figures[i]
        return [f for _, f in sorted(found.items()) if f is not None]

    def _task(self, population: Population, task: Task, work: Path) -> list[float]:
        """Each candidate's figure for ``task``, from one pass over the layers."""
        candidates = [PassModel("merge", f"candidate {i}", None, c.opened)
                      for i, c in enumerate(population.candidates)]
        parent = []
        if task.kind == "kl":
            assert task.parent is not None
            parent = [replace(open_for_pass(task.parent, "the kl task's parent", self.state), role="parent")]
        models = [*candidates, *parent]
        assert task.texts is not None
        directories = [self.tokenizer or models[0].opened.directory, *(m.opened.directory for m in models[1:])]
        texts = cached_sequences(directories, Path(task.texts), self.store / storage.TOKENS,
                                 configs=[m.opened.config for m in models], paths=[m.path for m in models], cut=True)
        if texts.vocab is not None:
            raise UsageError(f"{task.parent} and the candidates tokenize differently",
                             hint="a kl task's parent is one of the genome's models or of their vocabulary")
        streams: list[ModelStream] = []
        for i, c in enumerate(population.candidates):
            built = (streams[0].config, streams[0].model) if streams else None
            streams.append(ModelStream(Weights.of(c.directory, c.tensors, source=c.source), c.config, torch.float32,
                                       what="resumerge evolve", key=f"candidate {i}", built=built,
                                       device=self.device))
        streams += streams_of(parent, self.device)
        try:
            def on_layer(layer: int) -> None:
                storage.say(self.store, phase=f"score {task.name} (all candidates)", layer=layer,
                            layers=streams[0].layers)

            figures = run_pass([m.role for m in models], Generation(population, streams, bool(parent), on_layer),
                               texts.tokens, work)
        finally:
            for stream in streams:
                stream.close()
        assert figures is not None
        count = len(population.candidates)
        if task.kind == "kl":
            return [value for value in figures.kl[:count] if value is not None]
        return figures.nll[:count]


class Generation:
    """The pass's models (check's :class:`~resumerge.analyses.check.passes.PassModels`): every candidate, then the
    kl task's parent (``parent``), each layer of every candidate read inside the population's block of that layer
    (the parents' tensors read once for all), each model's layer run on its own hidden states only."""

    def __init__(self, population: Population, streams: Sequence[ModelStream], parent: bool,
                 on_layer: Callable[[int], None]) -> None:
        self.population, self.streams, self.parent, self.on_layer = population, streams, parent, on_layer
        self.layers = streams[0].layers
        self.calls: list[list[list[LayerCall]]] = []
        self.entering: list[tuple[torch.Tensor, list[LayerCall]]] = []

    def enter(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[torch.Tensor]]:
        with self.population.layer():
            entering = [stream.inputs_of_rows(batches) for stream in self.streams]
        self.entering = entering[0]
        self.calls = [[c for _, c in model] for model in entering]
        return [[h for h, _ in model] for model in entering]

    def runs_batched(self) -> bool:
        stream = self.streams[0]
        with self.population.layer(), stream.loaded(stream.layers_list[0]) as layer:
            return batched_on(stream, layer, self.entering)

    def layer(self, index: int, hidden: list[list[torch.Tensor]], reference: int | None
              ) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        self.on_layer(index)
        own = []
        with self.population.layer():
            for m, stream in enumerate(self.streams):
                out, _ = model_layer(stream, index, hidden[m], self.calls[m], None)
                own.append(out)
        return own, own

    def heads(self, hidden: list[list[torch.Tensor]], batches: Sequence[Sequence[Sequence[int]]],
              base: int | None) -> HeadTotals:
        """Per candidate its NLL and, with a parent (the last model), KL(parent ‖ candidate); batch by batch,
        the parent's log-probabilities of a batch held while every candidate's are compared with them."""
        count = len(self.streams) - (1 if self.parent else 0)
        tokens = sum(len(s) - 1 for batch in batches for s in batch)
        targets = targets_of(batches, None, 0)
        nll = [0.0] * len(self.streams)
        kl: list[list[torch.Tensor]] = [[] for _ in range(count)]
        with self.population.layer():
            rows = [logprobs(s, hidden[m], batches) for m, s in enumerate(self.streams)]
            for b in range(len(batches)):
                theirs = list(next(rows[-1])) if self.parent else []
                for m in range(count):
                    for r, found in enumerate(next(rows[m])):
                        nll[m] = nll_sum(found, targets[b][r], nll[m])
                        if self.parent:
                            kl[m].append(kl_at(theirs[r], found))
            for each in rows:  # past its last batch: its head's weights are let go
                next(each, None)
        means: list[float | None] = [float(torch.cat(k).double().mean()) if k else None for k in kl]
        means += [None] * (len(self.streams) - count)
        empty: list[float | None] = [None] * len(self.streams)
        return HeadTotals(nll=[n / tokens for n in nll], kl=means, kl_p95=empty, top1=empty, base_kl=empty,
                          tokens=tokens)


def _models_read(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Every model a merge config names (its base, its models, its slices' sources and bases), sorted."""
    found = {config.get("base_model")}
    for entry in config.get("models") or ():
        found.add(entry.get("model"))
    for piece in config.get("slices") or ():
        found.add(piece.get("base_model"))
        found.update(source.get("model") for source in piece.get("sources") or ())
    return tuple(sorted(str(m) for m in found if m is not None))

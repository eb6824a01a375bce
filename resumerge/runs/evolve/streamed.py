"""A generation scored in one streamed pass for all its kl/nll tasks: every candidate a merge never written
(:class:`~resumerge.merge.engine.unwritten.Population`), so that at each decoder layer each parent's layer tensors are
read once and every candidate's layer is merged from them in memory by ``run``'s own method code, run on that
candidate's hidden states of every task's texts, and dropped; each ``kl`` task's parent runs beside them on its own
texts (:mod:`.generation`). The figures are those its written merge gives (:mod:`.scoring`): KL(parent ‖ candidate)
per predicted token (over the tokens both hold where the parent's vocabulary differs, as ``eval`` measures it), and
its NLL per predicted token.

What it holds: the parents' layer (kept for every candidate inside the layer's block, with what its method computes
from the inputs alone: the task vectors, computed once for every candidate; not kept where the budget cannot hold
them), one candidate's layer while it runs, and every model's hidden states; each step admitted by the RAM governor
(:class:`~resumerge.forward.job.admission.Admission`), the pass refused up front (exit 2, naming the budget that fits)
where its largest step beside the hidden states cannot fit ``--max-memory``. The pass is a job of the one pass
driver (:class:`GenerationJob`, :func:`~resumerge.forward.job.driver.drive`): its lock, proof, fit, admission and
Ctrl-C's line (the layers journaled, the search's command) are the driver's, as ``check``'s are."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.config.locations import StateDir
from resumerge.errors import UsageError
from resumerge.forward.engine.reader import Weights
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.job.driver import Fit, PassFolder, drive
from resumerge.forward.job.journal import Journal, latest
from resumerge.forward.job.layerpass import LayerPass, Reserve
from resumerge.forward.job.proof import JournalProof, merge_inputs
from resumerge.forward.opening.opened import PassModel, open_for_pass
from resumerge.machine.memory import SystemProbe, budget_fitting
from resumerge.machine.memory.allocator import malloc_trim, tune_allocator
from resumerge.machine.torch_import import torch
from resumerge.runs.evolve import storage
from resumerge.runs.evolve.budget import pass_steps
from resumerge.runs.evolve.generation import SCRATCH, GenerationPass, TaskTexts
from resumerge.runs.evolve.scoring import task_texts, text_task
from resumerge.runs.evolve.spec import Task

if TYPE_CHECKING:
    from resumerge.merge.engine.unwritten import Population

# Opens the candidate merge configs (YAML texts) of one generation as a population (handed in by the API).
OpenPopulation = Callable[[Sequence[str]], AbstractContextManager["Population"]]
LAYER_PREFIX = "layer-"
PASS_WORDS = "the generation's streamed pass"  # as its refusal names it


class StreamedCandidates:
    """Scores a generation's candidates in one pass for all tasks (see the module's docstring); ``tokenizer``: the
    folder whose tokenizer reads the texts (None: the candidates' own), ``state``: where the parents' small files
    are found (a hub parent's), ``max_memory``: the budget in bytes (None: the default one), ``device``: where the
    pass's layers run, ``say``: told where the pass is (None: ``progress.json`` in ``store`` alone), ``command``:
    what continues the search, named by Ctrl-C's line (empty: none, the interrupt goes on up)."""

    def __init__(self, store: Path, tasks: Sequence[Task], open_population: OpenPopulation,
                 tokenizer: Path | None, state: StateDir, max_memory: int | None = None, device: str = "cpu",
                 say: storage.Say | None = None, command: str = "") -> None:
        self.store, self.open_population, self.device, self.command = store, open_population, device, command
        self.say: storage.Say = say or partial(storage.say, store)
        self.tasks = tuple(t for t in tasks if t.kind in ("kl", "nll"))
        self.tokenizer, self.state, self.max_memory = tokenizer, state, max_memory

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
            self.say(generation=generation, candidates=group, phase="plan", layer=None, layers=None)
            # Named by the candidates it runs: a pass journaled for others is never resumed as theirs.
            work = (self.store / storage.WORK / f"generation-{generation:04d}"
                    / f"candidates-{'-'.join(map(str, group))}")
            with self.open_population(texts) as population:
                figures = self._pass(population, work)
            for i, each in zip(group, figures):
                record(i, each)
                found[i] = each
        return [f for _, f in sorted(found.items()) if f is not None]

    def _pass(self, population: Population, work: Path) -> list[dict[str, float]]:
        """Each candidate's figure per task, from one pass over the layers (:class:`GenerationJob`)."""
        candidate = PassModel("merge", "candidate 0", None, population.candidates[0].opened)
        parents: dict[str, PassModel] = {}
        for task in self.tasks:
            if task.kind == "kl" and task.parent is not None and task.parent not in parents:
                parents[task.parent] = replace(open_for_pass(task.parent, "the kl task's parent", self.state),
                                               role="parent")
        texts = [self._texts(task, candidate, parents, list(parents)) for task in self.tasks]
        folder = PassFolder(work, f"the generation's pass in {work}", self.command or "resumerge evolve",
                            hint="wait for the search to end")
        return drive(GenerationJob(folder, self, population, parents, texts))

    def _texts(self, task: Task, candidate: PassModel, parents: Mapping[str, PassModel],
               order: Sequence[str]) -> TaskTexts:
        """``task``'s texts as the one owner of NLL and KL scoring tokenizes them
        (:func:`~.scoring.task_texts`: as ``check --prompts`` reads them, once per
        search, kept in STORAGE), cut to the context of the candidates and the task's parent, and how a parent's
        other vocabulary meets the candidates' (refused in one line, exit 2, where it cannot)."""
        scored = text_task(task)
        models = [candidate] + ([parents[scored.parent]] if scored.parent is not None else [])
        directories = [self.tokenizer or candidate.opened.directory, *(m.opened.directory for m in models[1:])]
        found = task_texts(task, directories, [m.opened.config for m in models], [m.path for m in models],
                           self.store / storage.TOKENS)
        return TaskTexts(task.name, [list(s) for s in found.tokens],
                         order.index(scored.parent) if scored.parent is not None else None, found.vocab)


def _models_read(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Every model a merge config names (its base, its models, its slices' sources and bases), sorted."""
    found = {config.get("base_model")}
    for entry in config.get("models") or ():
        found.add(entry.get("model"))
    for piece in config.get("slices") or ():
        found.add(piece.get("base_model"))
        found.update(source.get("model") for source in piece.get("sources") or ())
    return tuple(sorted(str(m) for m in found if m is not None))


@dataclass(frozen=True)
class _Ready:
    """What the generation's fit made, held open while it runs: each candidate's modules and each parent's."""

    streams: list[ModelStream]
    theirs: list[ModelStream]


@dataclass(frozen=True)
class GenerationJob:
    """A generation's streamed pass as the pass driver runs it (:class:`~resumerge.forward.job.driver.PassJob`): its
    models the ``population``'s candidates and the kl tasks' ``parents``, its texts every task's; no answer cache
    (each candidate's figures are recorded in STORAGE as the pass ends, and a pass runs only for candidates
    without: :meth:`StreamedCandidates.score`); its proof the parents' and the candidates' inputs' bytes its
    journal came from; its steps :class:`~.generation.GenerationPass`'s."""

    folder: PassFolder
    scorer: StreamedCandidates
    population: Population
    parents: Mapping[str, PassModel]
    texts: Sequence[TaskTexts]

    def answered(self) -> tuple[list[dict[str, float]] | None, str | None]:
        """None: the figures of candidates scored before are the search's own (``score``'s ``done``)."""
        return None, None

    def proved(self) -> str | None:
        """Before any weight is read: the inputs' bytes the journal's layers came from, proved (exit 4 where a
        journaled layer's changed), and what the pass will read recorded before its first layer; a file touched,
        an edit in ranges not read yet, told STORAGE's progress (for status to show)."""
        work = self.folder.path
        proof = JournalProof(list(self.parents.values()), f"the generation's pass in {work}",
                             *merge_inputs(self.population.plans, self.scorer.state))
        proof.before_resuming(Journal(work, LAYER_PREFIX))
        for line in proof.said:
            storage.say(self.scorer.store, inputs=line)
        return None

    @contextmanager
    def fitted(self) -> Iterator[Fit[_Ready]]:
        """Every model's modules, the pass judged against ``--max-memory`` (refused, exit 2, naming the budget that
        fits); the modules closed and the allocator put back as the block ends."""
        population, scorer = self.population, self.scorer
        streams: list[ModelStream] = []
        theirs: list[ModelStream] = []
        try:
            for i, c in enumerate(population.candidates):
                built = (streams[0].config, streams[0].model) if streams else None
                streams.append(ModelStream(Weights.of(c.directory, c.tensors, source=c.source), c.config,
                                           torch.float32, what="resumerge evolve", key=f"candidate {i}", built=built,
                                           device=scorer.device))
            theirs.extend(ModelStream(Weights.of(m.opened.directory, m.opened.tensors, m.remote, m.reads),
                                      m.opened.config, torch.float32, what="resumerge evolve", key=m.path,
                                      device=scorer.device) for m in self.parents.values())
            steps, budget = self._fit(streams, theirs)
            restore = tune_allocator()  # freed layers go back to the OS: RSS follows what is held
            try:
                yield Fit(budget, steps, _Ready(streams, theirs))
            finally:
                if restore is not None:
                    restore()
        finally:
            for stream in (*streams, *theirs):
                stream.close()

    def _fit(self, streams: list[ModelStream], theirs: list[ModelStream]) -> tuple[dict[str, int], int]:
        """What each step reserves and the budget: the largest step beside the hidden states."""
        population, texts, max_memory = self.population, list(self.texts), self.scorer.max_memory
        steps, states = pass_steps(population, streams, theirs, texts)
        try:
            return steps, budget_fitting(PASS_WORDS, states + max(steps.values()), max_memory, SystemProbe())
        except UsageError:
            # What depends on the inputs alone (the task vectors) is then merged again for each candidate
            # instead of kept for all of them: slower, within the budget.
            population.loaded.enabled = False
            steps, states = pass_steps(population, streams, theirs, texts)
            return steps, budget_fitting(PASS_WORDS, states + max(steps.values()), max_memory, SystemProbe())

    def run(self, ready: _Ready, reserve: Reserve) -> list[dict[str, float]]:
        """:class:`~.generation.GenerationPass` over the layers, from the journal."""
        streams, say = ready.streams, self.scorer.say
        names = ", ".join(t.name for t in self.texts)

        def on_layer(layer: int) -> None:
            trim = malloc_trim()  # the last layer's freed pages handed back: RSS follows what is held
            if trim is not None:
                trim(0)
            say(phase=f"score {names} (all candidates)", layer=layer, layers=streams[0].layers)

        work = self.folder.path
        step = GenerationPass(self.population, streams, ready.theirs, list(self.parents), list(self.texts), reserve,
                              on_layer, work / SCRATCH)
        with torch.no_grad():
            entering = step.enter()
        layers = LayerPass(Journal(work, LAYER_PREFIX), streams[0].layers, point="after_check_layer",
                           carries=step.handing)
        figures = layers.run(step, entering, len(entering[0]))
        assert figures is not None  # the step never stops the pass
        return figures

    def finish(self, found: list[dict[str, float]], proof: str | None) -> list[dict[str, float]]:
        """Each candidate's figures (recorded by the search)."""
        return found

    def stopped_at(self) -> str | None:
        """Where the pass stopped: the layers its journal holds (None where no command continues the search: the
        interrupt goes on up)."""
        if not self.scorer.command:
            return None
        found = latest(self.folder.path, LAYER_PREFIX)
        kept = "none of its layers journaled yet" if found is None else f"layers 1-{found[0] + 1} journaled"
        return f"the search was interrupted in {self.folder.what} ({kept}; it resumes at the layer it reached)"

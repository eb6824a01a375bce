"""A structure search's candidates scored from the base's cached hidden states: the pass is one job of the pass
driver (:class:`ShapeJob`: its lock, threads, fit and admission, Ctrl-C's line are the driver's), whose run builds
the base's :class:`~resumerge.runs.evolve.layercache.LayerCache` on every task's texts (journaled: a killed build
resumes at its last boundary), keeps each ``kl`` task's parent's log-probabilities on disk (one pass of the parent),
then hands a :class:`ShapeScorer` to the search, which scores each candidate from the layer where it departs from the
base.

The figures are those of the candidate written by ``run`` and scored by ``eval`` (:mod:`..scoring`): each task's
texts batched alone, as a pass over that task batches them, its NLL per predicted token and KL(parent ‖ candidate)
per predicted token, summed in the same order. The cache's size is bounded by ``--max-disk`` (the states kept
every ``stride`` layers: a candidate then runs from the kept layer below its departure), each step of the pass by
``--max-memory`` (refused up front, exit 2, where the largest does not fit)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from resumerge.analyses.evaluation.settings import EvalSettings
from resumerge.analyses.evaluation.tasks import TaskIndex
from resumerge.config.locations import StateDir
from resumerge.errors import UsageError
from resumerge.forward.compared.heads import head_step_bytes, kl_at, logprobs, nll_sum
from resumerge.forward.engine.reader import CastReader, Weights, base_formats, step_sizes
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.job.driver import Fit, PassFolder
from resumerge.forward.job.layerpass import Reserve
from resumerge.forward.job.placement import runs_batched
from resumerge.forward.opening.opened import PassModel, open_for_pass
from resumerge.forward.text.batches import Batch, batches_of, padded
from resumerge.inputs.tensorio import TORCH_DTYPES
from resumerge.machine.memory import SystemProbe, budget_fitting
from resumerge.machine.torch_import import torch
from resumerge.runs.evolve.layercache import PREFIX, Entered, Layer, LayerCache, stride_for
from resumerge.runs.evolve.layercache import branch as branch_of
from resumerge.runs.evolve.scoring import task_texts
from resumerge.runs.evolve.shapes.lmtasks import LmGroup, lm_group
from resumerge.runs.evolve.spec import Task

Found = TypeVar("Found")
LmAsked = tuple[tuple[Task, ...], EvalSettings, TaskIndex]  # lm-eval tasks scored together, how, their index
CACHE = "cache"
PARENTS = "parents"  # each kl parent's log-probabilities of its texts, one file a sequence
WORDS = "the structure search's pass"


@dataclass
class TaskBatches:
    """A task's texts in the pass: its ``sequences``, its batches' indices into the pass's one list (``batches``)
    and each batch's sequence indices (``groups``)."""

    task: Task
    sequences: list[list[int]]
    groups: list[list[int]]
    batches: list[int] = field(default_factory=list)
    lm: LmGroup | None = None  # lm-eval's tasks, scored together: their requests' runs are the sequences


@dataclass(frozen=True)
class Budgets:
    """What bounds the pass: ``max_memory`` and ``max_disk`` in bytes (None: the default, no bound)."""

    max_memory: int | None = None
    max_disk: int | None = None


class ShapeScorer:
    """Scores a layer path on tasks from the cache (see the module's docstring)."""

    def __init__(self, cache: LayerCache, texts: Sequence[TaskBatches], parents: Path, reserve: Reserve) -> None:
        self.cache, self.texts, self.parents, self.reserve = cache, list(texts), parents, reserve
        # a beam parent's path run so far: (its path, the batches, the position reached, the states entering it)
        self.prefix: tuple[tuple[Layer, ...], tuple[int, ...], int, list[torch.Tensor]] | None = None
        self.prefix_layers = 0  # the layers the parents' prefixes ran (beside each candidate's own)

    def score(self, path: Sequence[Layer], tasks: Sequence[Task], parent: Sequence[Layer] | None = None
              ) -> tuple[dict[str, float], int]:
        """The figure per task of the candidate running ``path`` and the decoder layers run to find them; with a
        ``parent`` (a beam's member this candidate adds an edit to), from the parent's states where its path departs
        from the parent's, past where it departs from the base: the parent's prefix run once for its children, the
        next child of the same parent taking it on from where the last one branched off (the same numbers as a
        run from the base's states: the same layers on the same inputs)."""
        chosen = [t for t in self.texts if (t.task in tasks if t.lm is None else all(x in tasks for x in t.lm.tasks))]
        which = [b for t in chosen for b in t.batches]
        branch = branch_of(path, parent) if parent is not None else 0
        start = self.cache.start_of(path)
        if parent is not None and branch > start:
            hidden = self.cache.advance(path, branch, len(path), self._prefix(parent, which, start, branch), which,
                                        self.reserve)
            computed = len(path) - branch
        else:
            hidden, computed = self.cache.run_path(path, which, self.reserve)
        states = dict(zip(which, hidden))
        figures: dict[str, float] = {}
        with self.reserve("the head", "heads"):
            for each in chosen:
                if each.lm is not None:
                    figures.update(each.lm.figures(self.cache.stream, [states[x] for x in each.batches],
                                                   each.groups))
                else:
                    figures[each.task.name] = self._figure(each, states)
        return figures, computed

    def _prefix(self, parent: Sequence[Layer], which: Sequence[int], start: int, position: int) -> list[torch.Tensor]:
        """The states entering ``position`` of the ``parent``'s path, run on from where its prefix reached (or from
        the kept layer ``start``, at or below the child's departure from the base: the two paths are one below
        ``position``)."""
        key, batches = tuple(parent), tuple(which)
        if self.prefix is None or self.prefix[:2] != (key, batches) or self.prefix[2] > position:
            self.prefix = (key, batches, start, self.cache.states(start, which))
        _, _, reached, hidden = self.prefix
        hidden = self.cache.advance(parent, reached, position, hidden, which, self.reserve)
        self.prefix_layers += position - reached
        self.prefix = (key, batches, position, hidden)
        return hidden

    def _figure(self, each: TaskBatches, states: dict[int, torch.Tensor]) -> float:
        sequences = [[each.sequences[i] for i in g] for g in each.groups]
        nll, kl = 0.0, []
        for b, (batch, rows) in enumerate(zip(sequences, logprobs(self.cache.stream,
                                                                   [states[x] for x in each.batches], sequences))):
            for r, found in enumerate(rows):
                if each.task.kind == "kl":
                    kl.append(kl_at(_parent_lp(self.parents, each.batches[b], r), found))
                else:
                    nll = nll_sum(found, torch.tensor(list(batch[r][1:])), nll)
        if each.task.kind == "kl":
            return float(torch.cat(kl).double().mean())
        return nll / sum(len(s) - 1 for s in each.sequences)


def _parent_lp(folder: Path, batch: int, row: int) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(folder / f"{batch}-{row}.safetensors"))["lp"]


@dataclass(frozen=True)
class _Ready:
    stream: ModelStream
    entered: Entered
    texts: list[TaskBatches]
    stride: int
    sources: list[CastReader] = field(default_factory=list)


@dataclass(frozen=True)
class ShapeJob(Generic[Found]):
    """The structure search's pass as the pass driver runs it (:class:`~resumerge.forward.job.driver.PassJob`): the
    base ``model`` on every task's texts (``tasks``: searched and held out), the cache in ``folder``; ``work`` is the
    search, handed the scorer once the cache is built; ``say`` is told where the pass is."""

    folder: PassFolder
    model: str
    tasks: Sequence[Task]
    state: StateDir
    tokens: Path
    work: Callable[[ShapeScorer], Found]
    budgets: Budgets = Budgets()
    device: str = "cpu"
    say: Callable[..., None] = lambda **_: None
    sources: Sequence[str] = ()  # the other models a candidate borrows layers from (source 1, 2, ...)
    lm: Sequence[LmAsked] = ()  # lm-eval's tasks: the searched ones, the held-out ones
    written: str | None = None  # the dtype run writes the candidates' layers in (None: not one dtype)

    def answered(self) -> tuple[Found | None, str | None]:
        return None, None

    def proved(self) -> str | None:
        """Before any weight is read: the base's and the kl parents' bytes the cache's layers came from, proved
        (exit 4 where a kept layer's inputs changed since), and what the build will read recorded before its first
        file."""
        from resumerge.forward.job.journal import Journal
        from resumerge.forward.job.proof import JournalProof

        parents = dict.fromkeys(t.parent for t in self.tasks if t.parent is not None)
        models = [open_for_pass(self.model, "genome.model", self.state),
                  *(open_for_pass(p, "the kl task's parent", self.state) for p in parents if p is not None)]
        proof = JournalProof(models, f"the structure search's cache in {self.folder.path}")
        proof.before_resuming(Journal(self.folder.path, PREFIX))
        for line in proof.said:
            self.say(inputs=line)
        return None

    @contextmanager
    def fitted(self) -> Iterator[Fit[_Ready]]:
        base = open_for_pass(self.model, "genome.model", self.state)
        stream = _stream(base, self.device)
        sources: list[CastReader] = []
        try:
            for i, path in enumerate(self.sources):
                opened = open_for_pass(path, f"genome.sources[{i}]", self.state)
                model = opened.opened
                weights = Weights.of(model.directory, model.tensors, opened.remote, opened.reads)
                sources.append(CastReader(weights, base_formats(weights.tensors, model.config, model.directory),
                                          torch.float32, key=opened.path))
            texts = [self._batches(task, base) for task in self.tasks if task.kind != "lm-eval"]
            for tasks, settings, index in self.lm:  # lm-eval's requests, asked once: their runs join the texts
                group = lm_group(tasks, settings, base, index)
                texts.append(TaskBatches(tasks[0], group.runs, batches_of(group.runs), lm=group))
            batches = _numbered(texts)
            entered = Entered.of(stream, batches)
            if any(len(g) > 1 for t in texts for g in t.groups) and \
                    not runs_batched(stream, list(zip(entered.hidden, entered.calls)), batches=batches):
                for t in texts:  # the family's first layer cannot run a padded batch: one sequence a batch
                    t.groups = [[i] for g in t.groups for i in g]
                batches = _numbered(texts)
                entered = Entered.of(stream, batches)
            boundary = sum(h.numel() * 4 for h in entered.hidden)
            parents = sum(len(s) * _vocab(stream) * 4 for t in texts if t.task.kind == "kl" for s in t.sequences)
            if self.budgets.max_disk is not None and parents > self.budgets.max_disk:
                raise UsageError(f"--max-disk {self.budgets.max_disk}: the kl parents' log-probabilities alone need "
                                 f"{parents} bytes", hint="give more disk, or fewer or shorter kl texts")
            room = None if self.budgets.max_disk is None else self.budgets.max_disk - parents
            stride = stride_for(stream.layers, boundary, room)
            layer = max(step_sizes(stream.formats, stream.layers, 4).values())
            longest = max(len(s) for t in texts for s in t.sequences)
            positions = max(int(ids.numel()) for ids, _ in batches)
            steps = {"layer": layer, "heads": head_step_bytes(stream, positions, longest)}
            budget = budget_fitting(WORDS, 2 * boundary + max(steps.values()), self.budgets.max_memory,
                                    SystemProbe())
            yield Fit(budget, steps, _Ready(stream, entered, texts, stride, sources))
        finally:
            for reader in sources:
                reader.close()
            stream.close()

    def _batches(self, task: Task, base: PassModel) -> TaskBatches:
        models = [base]
        if task.parent is not None:
            models.append(open_for_pass(task.parent, "the kl task's parent", self.state))
        found = task_texts(task, [m.opened.directory for m in models], [m.opened.config for m in models],
                           [m.path for m in models], self.tokens)
        if found.vocab is not None:
            raise UsageError(f"task {task.name}: the parent's vocabulary is not the model's",
                             hint="a structure search measures KL from a parent of the model's own vocabulary")
        sequences = [list(s) for s in found.tokens]
        return TaskBatches(task, sequences, batches_of(sequences))

    def run(self, ready: _Ready, reserve: Reserve) -> Found:
        folder = self.folder.path
        written = TORCH_DTYPES.get(self.written) if self.written is not None else None
        cache = LayerCache(folder, ready.stream, ready.entered, ready.stride, sources=ready.sources, written=written)
        phase = "cache the base's hidden states"
        cache.build(reserve, lambda layer: self.say(phase=phase, layer=layer, layers=cache.layers))
        parents = folder / PARENTS
        self._parents(ready, parents, reserve)
        return self.work(ShapeScorer(cache, ready.texts, parents, reserve))

    def _parents(self, ready: _Ready, folder: Path, reserve: Reserve) -> None:
        """Each kl task's parent's log-probabilities of its texts, kept in ``folder`` (done once: ``done.json``
        says so; a pass killed before it is computed again)."""
        done = folder / "done.json"
        if done.is_file():
            return
        from safetensors.torch import save_file

        from resumerge.machine.durable import write_file_atomic

        folder.mkdir(parents=True, exist_ok=True)
        for t in ready.texts:
            if t.task.parent is None:
                continue
            opened = open_for_pass(t.task.parent, "the kl task's parent", self.state)
            with _stream(opened, self.device) as stream:
                batches = [padded([t.sequences[i] for i in g]) for g in t.groups]
                entered = Entered.of(stream, batches)
                own = LayerCache(folder, stream, entered, stream.layers + 1)
                hidden, _ = own.run_path(range(stream.layers), range(len(batches)), reserve)
                sequences = [[t.sequences[i] for i in g] for g in t.groups]
                with reserve(f"the head of {t.task.parent}", "heads"):
                    for b, rows in zip(t.batches, logprobs(stream, hidden, sequences)):
                        for r, found in enumerate(rows):
                            save_file({"lp": found.contiguous()}, str(folder / f"{b}-{r}.safetensors"))
        write_file_atomic(done, json.dumps({"parents": True}).encode())

    def finish(self, found: Found, proof: str | None) -> Found:
        return found

    def stopped_at(self) -> str | None:
        return f"the structure search was interrupted in {self.folder.what} (it resumes where it stopped)"


def _stream(model: PassModel, device: str) -> ModelStream:
    opened = model.opened
    return ModelStream(Weights.of(opened.directory, opened.tensors, model.remote, model.reads), opened.config,
                       torch.float32, what="resumerge evolve", key=model.path, device=device)


def _numbered(texts: Sequence[TaskBatches]) -> list[Batch]:
    """Every task's batches in one list, each task told its batches' indices in it."""
    found: list[Batch] = []
    for t in texts:
        t.batches = list(range(len(found), len(found) + len(t.groups)))
        found += [padded([t.sequences[i] for i in g]) for g in t.groups]
    return found


def _vocab(stream: ModelStream) -> int:
    head = stream.model.get_output_embeddings()
    weight = next((p for _, p in head.named_parameters()), None) if head is not None else None
    return int(weight.shape[0]) if weight is not None else 0

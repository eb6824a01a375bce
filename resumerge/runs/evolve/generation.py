"""One generation's streamed pass over every kl/nll task at once: the pass's models are the candidates (each a merge
never written, its layer merged in memory from one read of the parents' layer) and each ``kl`` task's parent. The
candidates run every task's texts; a parent runs only the texts of the tasks that name it. Each task's texts are
batched on their own (as a pass over that task alone batches them), so every sequence's hidden states are the same
numbers as in a pass over its task alone, and a candidate's figures are those of its written merge.

The pass is the one journaled layer pass (:class:`~resumerge.forward.job.layerpass.LayerPass`): its hidden states, one
tensor per model and batch, are journaled after each layer as one list (the models' batches one after another: a
parent holds fewer batches than a candidate), so that a killed pass resumes at the layer it reached. Each step is
admitted by the pass's ``reserve`` (:class:`~resumerge.forward.job.admission.Admission`): ``candidate`` (one
candidate's layer merged and run, beside the parents' layer kept for every candidate), ``parent`` (a parent's
layer), ``heads`` (one candidate's head and one batch's logits), ``parent heads``.

The heads run one model at a time: each parent's log-probabilities of its texts first, kept in a scratch folder on
disk (float32, as computed), then each candidate's head over every task's texts, its KL from the parent read back
sequence by sequence: one candidate's head is held at a time, never the population's.

A ``kl`` task whose parent's vocabulary differs from the candidates' (check's rule,
:mod:`resumerge.forward.text.vocabs`: its :class:`~resumerge.forward.text.vocabs.SharedVocab`, the candidates
model 0, the parent 1) is measured as ``eval`` measures it: each model reads the task's texts as its own ids of the
same tokens, the candidates' NLL targets are their own ids, and the KL is over the shared tokens, each model's
log-probabilities renormalised over them (the parent's kept so on disk)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.forward.compared.heads import kl_at, logprobs, nll_sum, shared, targets_of
from resumerge.forward.engine.handed import Held
from resumerge.forward.engine.standins import LayerCall
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.job.layerpass import Reserve, Step
from resumerge.forward.job.placement import batched_on, model_layer
from resumerge.forward.text.batches import Batch, Hidden, batches_of, padded
from resumerge.forward.text.vocabs import SharedVocab, own_batches
from resumerge.machine.torch_import import torch

if TYPE_CHECKING:
    from resumerge.merge.engine.unwritten import Population

SCRATCH = "heads"
# Where the hidden states (and their layers' calls) of one model's batch sit in the pass's one list.
Slot = tuple[int, int]  # (model, batch)


@dataclass(frozen=True)
class TaskTexts:
    """A task's token sequences in the pass: ``name``, its ``sequences`` (the ids of the tokenizer that cut them),
    the index of its parent among the pass's parents (None: an ``nll`` task, the candidates alone) and how that
    parent's vocabulary meets the candidates' (None: they are one)."""

    name: str
    sequences: list[list[int]]
    parent: int | None
    vocab: SharedVocab | None = None


@dataclass(frozen=True)
class Batches:
    """The pass's batches: per task, its sequences' indices in each batch; ``padded`` every batch, task after task;
    ``of_task`` the indices (into ``padded``) of each task's batches."""

    groups: list[list[list[int]]]
    padded: list[Batch]
    of_task: list[list[int]]

    def task_of(self, b: int) -> int:
        """The task whose batch ``b`` is."""
        return next(t for t, batches in enumerate(self.of_task) if b in batches)

    @classmethod
    def of(cls, texts: Sequence[TaskTexts], alone: bool = False) -> Batches:
        """Each task's sequences in batches (:func:`~resumerge.forward.text.batches.batches_of`), or each one a batch
        of its own (``alone``: a family whose first layer cannot run a padded batch)."""
        groups = [[[i] for i in range(len(t.sequences))] if alone else batches_of(t.sequences) for t in texts]
        found: list[Batch] = []
        of_task = []
        for task, task_groups in zip(texts, groups):
            of_task.append(list(range(len(found), len(found) + len(task_groups))))
            found += [padded([task.sequences[i] for i in g]) for g in task_groups]
        return cls(groups, found, of_task)


class GenerationPass(Step[list[dict[str, float]]]):
    """The pass's :class:`~resumerge.forward.job.layerpass.Step` over ``candidates`` (the population's, in order) and
    ``parents`` (each kl task's parent, once), for the tasks ``texts``; ``reserve`` admits each step, ``on_layer``
    is told as each layer starts, ``scratch`` is where the parents' log-probabilities wait. :meth:`finish` gives
    each candidate's figure per task (``kl``: KL(parent ‖ candidate) per predicted token, ``nll``: its NLL per
    predicted token)."""

    def __init__(self, population: Population, candidates: Sequence[ModelStream], parents: Sequence[ModelStream],
                 parent_names: Sequence[str], texts: Sequence[TaskTexts], reserve: Reserve,
                 on_layer: Callable[[int], None], scratch: Path) -> None:
        self.population, self.candidates, self.parents = population, list(candidates), list(parents)
        self.parent_names, self.texts, self.reserve = list(parent_names), list(texts), reserve
        self.on_layer, self.scratch = on_layer, scratch
        self.layers = self.candidates[0].layers
        self.batches = Batches.of(texts)
        self.slots: list[Slot] = []
        self.calls: dict[Slot, list[LayerCall]] = {}

    # -- entering --------------------------------------------------------------------------------------------

    def enter(self) -> Hidden:
        """Every model's hidden states entering its first decoder layer, as the pass's one list (:data:`Slot`
        order), its layers' calls kept; one sequence a batch where the first candidate's first layer cannot run
        the padded batches (decided from the model alone: a resumed pass decides the same)."""
        flat = self._enter()
        if any(len(g) > 1 for task in self.batches.groups for g in task) and not self._runs_batched(flat):
            self.batches = Batches.of(self.texts, alone=True)
            flat = self._enter()
        return [flat]

    def _enter(self) -> list[torch.Tensor]:
        self.slots, self.calls = [], {}
        flat: list[torch.Tensor] = []
        every = list(range(len(self.batches.padded)))
        with self.population.layer():
            for c, stream in enumerate(self.candidates):
                with self.reserve(f"the embeddings of candidate {c}", "candidate"):
                    flat += self._entered(c, stream, every)
        for p, stream in enumerate(self.parents):
            with self.reserve(f"the embeddings of {self.parent_names[p]}", "parent"):
                flat += self._entered(len(self.candidates) + p, stream, self._batches_of_parent(p))
        return flat

    def _entered(self, m: int, stream: ModelStream, batches: list[int]) -> list[torch.Tensor]:
        found = stream.inputs_of_rows([self._own(m, b) for b in batches])
        for b, (_, calls) in zip(batches, found):
            self.slots.append((m, b))
            self.calls[(m, b)] = calls
        return [h for h, _ in found]

    def _runs_batched(self, flat: list[torch.Tensor]) -> bool:
        stream = self.candidates[0]
        entering = [(h, self.calls[(0, b)]) for (m, b), h in zip(self.slots, flat) if m == 0]
        with self.population.layer(), self.reserve("layer 0 of candidate 0 (can it run batches?)", "candidate"), \
                stream.loaded(stream.layers_list[0]) as layer:
            return batched_on(stream, layer, entering, [self._own(0, b) for b in range(len(self.batches.padded))])

    def _vocab(self, b: int) -> SharedVocab | None:
        """How the models of batch ``b``'s task meet (None: one vocabulary)."""
        return self.texts[self.batches.task_of(b)].vocab

    def _own(self, m: int, b: int) -> Batch:
        """Batch ``b`` as model ``m`` reads it: its own ids of the same tokens (a candidate model 0 of its task's
        vocabularies, a parent 1)."""
        return own_batches(self._vocab(b), 0 if m < len(self.candidates) else 1, [self.batches.padded[b]])[0]

    def _batches_of_parent(self, p: int) -> list[int]:
        return [b for t, task in enumerate(self.texts) if task.parent == p for b in self.batches.of_task[t]]

    @property
    def handing(self) -> Held:
        """What the models' layers hand later ones beside the hidden states (GLM-5's top-k indices), for the
        pass's journal: the pass's one list of batches (:data:`Slot` order), as its hidden states are."""
        return Held(lambda: [[self.calls[slot] for slot in self.slots]])

    # -- the layers -------------------------------------------------------------------------------------------

    def layer(self, index: int, hidden: Hidden) -> Hidden:
        self.on_layer(index)
        flat = hidden[0]
        out: list[torch.Tensor] = []
        with self.population.layer():  # each parent's layer read once for every candidate
            for c, stream in enumerate(self.candidates):
                with self.reserve(f"layer {index} of candidate {c}", "candidate"):
                    out += self._run(c, stream, index, flat)
        for p, stream in enumerate(self.parents):
            with self.reserve(f"layer {index} of {self.parent_names[p]}", "parent"):
                out += self._run(len(self.candidates) + p, stream, index, flat)
        return [out]

    def _run(self, m: int, stream: ModelStream, index: int, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        """Model ``m``'s layer ``index``, read once, on each of its batches."""
        mine = [s for s, slot in enumerate(self.slots) if slot[0] == m]
        own, _ = model_layer(stream, index, [flat[s] for s in mine], [self.calls[self.slots[s]] for s in mine], None)
        return own

    # -- the heads --------------------------------------------------------------------------------------------

    def finish(self, hidden: Hidden) -> list[dict[str, float]]:
        flat = hidden[0]
        states = {slot: h for slot, h in zip(self.slots, flat)}
        shutil.rmtree(self.scratch, ignore_errors=True)  # a killed pass's: computed again
        self.scratch.mkdir(parents=True)
        try:
            for p, stream in enumerate(self.parents):
                with self.reserve(f"the head of {self.parent_names[p]}", "parent heads"):
                    self._keep_parent(p, stream, states)
            figures: list[dict[str, float]] = []
            with self.population.layer():  # the parents' heads read once for every candidate
                for c, stream in enumerate(self.candidates):
                    with self.reserve(f"the head of candidate {c}", "heads"):
                        figures.append(self._candidate(c, stream, states))
            return figures
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _sequences(self, b: int) -> list[list[int]]:
        for t, batches in enumerate(self.batches.of_task):
            if b in batches:
                return [self.texts[t].sequences[i] for i in self.batches.groups[t][batches.index(b)]]
        raise AssertionError(f"batch {b} belongs to no task")

    def _keep_parent(self, p: int, stream: ModelStream, states: dict[Slot, torch.Tensor]) -> None:
        """Parent ``p``'s log-probabilities of its tasks' texts, each sequence's saved to the scratch folder."""
        from safetensors.torch import save_file

        m = len(self.candidates) + p
        batches = self._batches_of_parent(p)
        for b, rows in zip(batches, logprobs(stream, [states[(m, b)] for b in batches],
                                             [self._sequences(b) for b in batches])):
            for row, found in enumerate(rows):  # over the shared tokens where its vocabulary differs
                save_file({"lp": shared(self._vocab(b), 1, found).contiguous()},
                          str(self.scratch / f"{p}-{b}-{row}.safetensors"))

    def _candidate(self, c: int, stream: ModelStream, states: dict[Slot, torch.Tensor]) -> dict[str, float]:
        """Candidate ``c``'s figure per task from its head over its last hidden states, task after task."""
        from safetensors.torch import load_file

        every = list(range(len(self.batches.padded)))
        sequences = [self._sequences(b) for b in every]
        targets = [targets_of([batch], self._vocab(b), 0)[0] for b, batch in zip(every, sequences)]
        nll = [0.0] * len(self.texts)
        kl: list[list[torch.Tensor]] = [[] for _ in self.texts]
        owner = {b: self.batches.task_of(b) for b in every}
        for b, rows in zip(every, logprobs(stream, [states[(c, b)] for b in every], sequences)):
            t = owner[b]
            parent = self.texts[t].parent
            for row, found in enumerate(rows):
                nll[t] = nll_sum(found, targets[b][row], nll[t])
                if parent is not None:
                    theirs = load_file(str(self.scratch / f"{parent}-{b}-{row}.safetensors"))["lp"]
                    kl[t].append(kl_at(theirs, shared(self.texts[t].vocab, 0, found)))
        figures = {}
        for t, task in enumerate(self.texts):
            if task.parent is not None:
                figures[task.name] = float(torch.cat(kl[t]).double().mean())
            else:
                figures[task.name] = nll[t] / sum(len(s) - 1 for s in task.sequences)
        return figures

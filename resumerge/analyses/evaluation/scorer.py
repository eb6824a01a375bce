"""A pass's scoring on the forward engine: every run of a :class:`~.requests.Scoring` through the model one decoder
layer at a time (each layer read once for all of them), then the head, and each request's log-likelihood and
whether its continuation is the greedy one.

Journaled in its own folder: after each layer the hidden states of every batch (temp file, fsync, rename; the
previous layer's file deleted), after the head of each batch that batch's answers, and at the end all answers
(``answers.json``), after which the layer files go. A killed pass resumes at the layer, or the batch, it reached,
and ends with the same answers; a pass asked again is answered from its file without reading a weight.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from resumerge.analyses.evaluation.requests import Scoring
from resumerge.analyses.evaluation.status import LAYER_PREFIX
from resumerge.analyses.evaluation.tails import tail_answers
from resumerge.forward.batches import Hidden, enter
from resumerge.forward.journal import Journal
from resumerge.forward.layerpass import LayerPass, Reserve, Step, unreserved
from resumerge.forward.placement import Placement, Streams
from resumerge.forward.proof import JournalProof
from resumerge.forward.stream import ModelStream
from resumerge.store.durable import write_file_atomic
from resumerge.torch_import import torch

ANSWERS = "answers.json"
Answer = tuple[float, bool]


def answered(workdir: Path) -> list[Answer] | None:
    """The answers of the pass journaled in ``workdir`` once it finished (None: not finished)."""
    try:
        doc = json.loads((workdir / ANSWERS).read_text())
    except (OSError, ValueError):
        return None
    return [(float(lp), bool(greedy)) for lp, greedy in doc]


def score(stream: ModelStream, work: Scoring, workdir: Path, *, reserve: Reserve = unreserved,
          on_layer: Callable[[int | None], None] | None = None,
          placed: Callable[[Callable[[int], None]], AbstractContextManager[Placement]] | None = None,
          proof: JournalProof | None = None) -> list[Answer]:
    """Each request's (log-likelihood, greedy) of ``work`` on the model ``stream`` (float32 as lm-eval's ``hf``
    model computes them), resuming the pass journaled in ``workdir``; ``on_layer`` is told each layer as it starts
    (None: the heads); ``reserve(what, step)`` holds a step's memory while it runs. A client of the forward
    engine's one journaled pass (:class:`~resumerge.forward.layerpass.LayerPass`). ``placed(on_layer)``: where the
    decoder layers run instead of this process (a Ray actor, ``--executor ray``: the same answers, the journal the
    same file); the head runs here. ``proof``: the models' bytes proved against the journal before any is read
    (:meth:`~resumerge.forward.proof.JournalProof.before_resuming`: exit 4 where a journaled layer's changed)."""
    done = answered(workdir)
    if done is not None:
        return done
    told = on_layer if on_layer is not None else (lambda layer: None)
    if placed is None:
        return _scored(Streams([stream], on_model=lambda layer, m: told(layer), reserve=reserve), stream, work,
                       workdir, reserve, told, proof)
    with placed(told) as placement:
        return _scored(placement, stream, work, workdir, reserve, told, proof)


def _scored(streams: Placement, stream: ModelStream, work: Scoring, workdir: Path, reserve: Reserve,
            told: Callable[[int | None], None], proof: JournalProof | None) -> list[Answer]:
    """:func:`score`'s pass with its layers where ``streams`` runs them, its head on ``stream``."""
    workdir.mkdir(parents=True, exist_ok=True)
    if proof is not None:
        proof.before_resuming(Journal(workdir, LAYER_PREFIX))
    with torch.no_grad():
        entered = enter(work.runs, streams.enter, streams.runs_batched)
    journal = Journal(workdir, LAYER_PREFIX)
    step = _Scored(streams, stream, work, entered.groups, workdir, reserve, told)
    answers = LayerPass(journal, streams.layers, point="after_eval_layer", carries=streams).run(
        step, entered.hidden, len(entered.batches))
    assert answers is not None  # the step never stops the pass
    write_file_atomic(workdir / ANSWERS, json.dumps(answers).encode())
    journal.clear()
    for path in workdir.glob("heads-*.json"):
        path.unlink(missing_ok=True)
    return answers


class _Scored(Step[list[Answer]]):
    """The pass's step: each decoder layer over every batch (its weights read once), then the head."""

    def __init__(self, streams: Placement, stream: ModelStream, work: Scoring, groups: list[list[int]],
                 workdir: Path, reserve: Reserve, told: Callable[[int | None], None]) -> None:
        self.streams, self.stream, self.work, self.groups, self.workdir = streams, stream, work, groups, workdir
        self.reserve, self.told = reserve, told

    def layer(self, index: int, hidden: Hidden) -> Hidden:
        own, _ = self.streams.layer(index, hidden, None)
        return own

    def finish(self, hidden: Hidden) -> list[Answer]:
        self.told(None)
        return _heads(self.stream, self.work, self.groups, hidden[0], self.workdir, self.reserve)


def _heads(stream: ModelStream, work: Scoring, groups: list[list[int]], hidden: list[torch.Tensor], workdir: Path,
           reserve: Reserve) -> list[Answer]:
    """Every request's answer from the head over the last hidden states, batch by batch (a batch's answers
    journaled as it ends)."""
    readers: dict[int, list[int]] = {}
    for request, run in enumerate(work.run_of):
        readers.setdefault(run, []).append(request)
    answers: list[Answer | None] = [None] * len(work.run_of)
    todo = []
    for b in range(len(groups)):
        kept = _kept_heads(workdir, b)
        if kept is None:
            todo.append(b)
        else:
            for request, answer in kept.items():
                answers[request] = answer
    with reserve("the head", "heads"):
        for b in todo:
            runs = groups[b]
            wanted = [[work.targets[request] for request in readers.get(run, [])] for run in runs]
            found: dict[int, Answer] = {}
            for run, row in zip(runs, tail_answers(stream, hidden[b], [len(work.runs[i]) for i in runs], wanted)):
                for request, answer in zip(readers.get(run, []), row):
                    found[request] = answer
            write_file_atomic(workdir / f"heads-{b:06d}.json", json.dumps(sorted(found.items())).encode())
            for request, answer in found.items():
                answers[request] = answer
    assert all(a is not None for a in answers)
    return [a for a in answers if a is not None]


def _kept_heads(workdir: Path, batch: int) -> dict[int, Answer] | None:
    try:
        doc = json.loads((workdir / f"heads-{batch:06d}.json").read_text())
    except (OSError, ValueError):
        return None
    return {int(request): (float(lp), bool(greedy)) for request, (lp, greedy) in doc}



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
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from resumerge.analyses.check.heads import logprobs
from resumerge.analyses.check.passes import batched_on, batches_of
from resumerge.analyses.evaluation.requests import Scoring
from resumerge.forward.journal import durable_save, latest
from resumerge.forward.stream import LayerCall, ModelStream
from resumerge.store.durable import write_file_atomic
from resumerge.store.killpoints import reach
from resumerge.torch_import import torch

LAYER_PREFIX = "layer-"
ANSWERS = "answers.json"
# Holds the memory of one step while it runs: (what, step: "layer" or "heads") -> a context manager.
Reserve = Callable[[str, str], AbstractContextManager[object]]
Answer = tuple[float, bool]


def _unreserved(what: str, step: str) -> AbstractContextManager[object]:
    return nullcontext()


def answered(workdir: Path) -> list[Answer] | None:
    """The answers of the pass journaled in ``workdir`` once it finished (None: not finished)."""
    try:
        doc = json.loads((workdir / ANSWERS).read_text())
    except (OSError, ValueError):
        return None
    return [(float(lp), bool(greedy)) for lp, greedy in doc]


def score(stream: ModelStream, work: Scoring, workdir: Path, *, reserve: Reserve = _unreserved,
          on_layer: Callable[[int | None], None] | None = None) -> list[Answer]:
    """Each request's (log-likelihood, greedy) of ``work`` on the model ``stream`` (float32 as lm-eval's ``hf``
    model computes them), resuming the pass journaled in ``workdir``; ``on_layer`` is told each layer as it starts
    (None: the heads); ``reserve(what, step)`` holds a step's memory while it runs."""
    done = answered(workdir)
    if done is not None:
        return done
    workdir.mkdir(parents=True, exist_ok=True)
    groups = batches_of(work.runs)
    with torch.no_grad():
        batches = [_padded([work.runs[i] for i in g]) for g in groups]
        entering = stream.inputs_of_rows(batches)
        if any(len(g) > 1 for g in groups) and not _runs_batched(stream, entering, reserve):
            groups = [[i] for g in groups for i in g]  # this family's layers take one sequence at a time
            batches = [_padded([work.runs[i] for i in g]) for g in groups]
            entering = stream.inputs_of_rows(batches)
        calls = [c for _, c in entering]
        start, hidden = _restart(workdir, len(batches))
        if hidden is None:
            hidden = [h for h, _ in entering]
        del entering
        for index in range(start, stream.layers):
            if on_layer is not None:
                on_layer(index)
            hidden = _layer(stream, index, hidden, calls, reserve)
            _save(workdir, index, hidden)
            reach("after_eval_layer")  # tests kill the evaluation here: it resumes after this layer
        if on_layer is not None:
            on_layer(None)
        answers = _heads(stream, work, groups, hidden, workdir, reserve)
    write_file_atomic(workdir / ANSWERS, json.dumps(answers).encode())
    for path in [*workdir.glob(f"{LAYER_PREFIX}*.safetensors"), *workdir.glob("heads-*.json")]:
        path.unlink(missing_ok=True)
    return answers


def _layer(stream: ModelStream, index: int, hidden: list[torch.Tensor], calls: list[list[LayerCall]],
           reserve: Reserve) -> list[torch.Tensor]:
    """Decoder layer ``index`` over every batch, its weights read once."""
    with reserve(f"layer {index + 1} of {stream.layers}", "layer"), \
            stream.loaded(stream.layers_list[index]) as layer:
        return [stream.run(layer, h, calls[b][index]) for b, h in enumerate(hidden)]


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
    # heads.logprobs gives a sequence's rows at all but its last position: one more is named than the run holds
    named = [[range(len(work.runs[i]) + 1) for i in groups[b]] for b in todo]
    with reserve("the head", "heads"):
        for b, rows in zip(todo, logprobs(stream, [hidden[b] for b in todo], named)):
            found: dict[int, Answer] = {}
            for run, lp in zip(groups[b], rows):
                for request in readers.get(run, []):
                    target = torch.tensor(work.targets[request])
                    tail = lp[-len(target):]
                    value = float(tail.gather(-1, target.unsqueeze(-1)).sum())
                    found[request] = (value, bool((tail.argmax(-1) == target).all()))
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


def _runs_batched(stream: ModelStream, entering: list[tuple[torch.Tensor, list[LayerCall]]],
                  reserve: Reserve) -> bool:
    with reserve("layer 1 (can it run batches?)", "layer"), stream.loaded(stream.layers_list[0]) as layer:
        return batched_on(stream, layer, entering)


def _padded(batch: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids padded on the right (a causal model's real positions never see what follows them) and the
    attention mask, both (batch, longest)."""
    longest = max(len(s) for s in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, s in enumerate(batch):
        ids[row, :len(s)] = torch.tensor(list(s))
        mask[row, :len(s)] = 1
    return ids, mask


def _save(workdir: Path, index: int, hidden: list[torch.Tensor]) -> None:
    name = f"{LAYER_PREFIX}{index:05d}.safetensors"
    durable_save({f"hidden.{b}": h.contiguous() for b, h in enumerate(hidden)}, workdir / name)
    for older in workdir.glob(f"{LAYER_PREFIX}*.safetensors"):
        if older.name != name:
            older.unlink(missing_ok=True)


def _restart(workdir: Path, batches: int) -> tuple[int, list[torch.Tensor] | None]:
    """The next layer of a journaled pass and its hidden states (0 and None: nothing journaled)."""
    found = latest(workdir, LAYER_PREFIX)
    if found is None:
        return 0, None
    from safetensors import safe_open

    layer, path = found
    with safe_open(str(path), "pt") as opened:
        return layer + 1, [opened.get_tensor(f"hidden.{b}") for b in range(batches)]

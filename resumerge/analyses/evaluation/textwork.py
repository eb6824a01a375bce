"""What ``eval`` needs of a text task (:mod:`.texttasks`) before any weight is read — its parent opened (headers
only), its texts tokenized — and how its figure joins lm-eval's results object (:func:`add_text_task`; an
evaluation of text tasks alone starts from :func:`no_lm_tasks`, a results object of no lm-eval task)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from resumerge.analyses.evaluation.settings import EvalSettings
from resumerge.analyses.evaluation.texttasks import TextFigures, TextTask, result_entries, shared_texts
from resumerge.config.locations import StateDir
from resumerge.forward.compared.heads import head_step_bytes
from resumerge.forward.engine.reader import Weights
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.opening.opened import PassModel, open_for_pass
from resumerge.forward.text.batches import largest_batch
from resumerge.forward.text.vocabs import SharedVocab


@dataclass(frozen=True)
class TextWork:
    """A text task ready to run: the ``task``, its ``parent`` opened (a KL task's; None for NLL), the texts'
    ``tokens`` and, where the parent's vocabulary differs from the model's, how the two meet (``vocab``: check's
    rule, the KL over the shared tokens)."""

    task: TextTask
    parent: PassModel | None
    tokens: list[list[int]]
    vocab: SharedVocab | None = None

    def key(self) -> list[Any]:
        """What the pass's key holds beside the model's: the kind, and the parent's files' identities."""
        if self.parent is None:
            return [self.task.kind]
        files = [[f.name, f.size, f.identity] for f in self.parent.opened.files]
        where = self.parent.path if self.parent.remote else os.path.abspath(self.parent.path)
        return [self.task.kind, where, files]

    def streams(self, scored: ModelStream, config: Mapping[str, Any]) -> list[ModelStream]:
        """The parent's modules without weights (none for NLL), sharing ``scored``'s where their config.json
        (``config``: the scored model's) says the same (the pass gives a module its weights only while it runs),
        each layer run on ``scored``'s device."""
        if self.parent is None:
            return []
        opened = self.parent.opened
        same = json.dumps(dict(opened.config), sort_keys=True) == json.dumps(dict(config), sort_keys=True)
        return [ModelStream(Weights.of(opened.directory, opened.tensors, self.parent.remote), opened.config,
                            scored.dtype, what="resumerge eval", key=f"task {self.task.name}'s parent",
                            built=(scored.config, scored.model) if same else None, device=str(scored.device))]


def text_work(task: TextTask, model: PassModel, state: StateDir) -> TextWork:
    """``task`` for ``model``: its parent opened and its texts tokenized (refused, exit 2, where they cannot be)."""
    parent = None
    if task.parent is not None:
        parent = replace(open_for_pass(task.parent, f"task {task.name}'s parent", state), role="parent")
    models = [model, *([parent] if parent is not None else [])]
    found = shared_texts([m.opened.directory for m in models], [m.opened.config for m in models],
                         [m.path for m in models], task, state.evals_dir)
    return TextWork(task, parent, found.tokens, found.vocab)


def digest_of(tokens: Sequence[Sequence[int]]) -> str:
    """The texts' tokens, hashed (part of the pass's key)."""
    return hashlib.sha256(json.dumps([list(t) for t in tokens]).encode()).hexdigest()[:32]


def text_heads_bytes(streams: Sequence[ModelStream], tokens: Sequence[Sequence[int]]) -> int:
    """What the heads of a text task hold at most: one model's head step, and with a parent its log-probabilities
    of a whole batch held beside it (:func:`~.texttasks.text_heads`)."""
    batch, longest = largest_batch(tokens), max(map(len, tokens), default=0)
    held = batch if len(streams) > 1 else 0
    return max(head_step_bytes(s, batch, longest, held=held) for s in streams)


def add_text_task(results: dict[str, Any], work: TextWork, figures: TextFigures) -> None:
    """The text task's figure in lm-eval's ``results`` object, each of its sections as lm-eval fills them."""
    vocabulary = work.vocab.describe(["model", "parent"]) if work.vocab is not None else None
    entries = result_entries(work.task, figures.figure(work.task), figures.tokens, len(work.tokens), vocabulary)
    for section, value in entries.items():
        results.setdefault(section, {})[work.task.name] = value


def no_lm_tasks(target: str, settings: EvalSettings) -> tuple[dict[str, Any], Any]:
    """The results object of an evaluation that names no lm-eval task (its text tasks join it) and the tracker
    that writes it with ``output_path`` (None without), as lm-eval's CLI would have them."""
    results: dict[str, Any] = {"results": {}, "group_subtasks": {}, "configs": {}, "versions": {}, "n-shot": {},
                               "higher_is_better": {}, "n-samples": {},
                               "config": {"model": "resumerge", "model_args": {"pretrained": target},
                                          "limit": settings.whole_limit}}
    tracker = None
    if settings.output_path is not None:
        from lm_eval.loggers import EvaluationTracker

        tracker = EvaluationTracker(output_path=settings.output_path)
        tracker.general_config_tracker.log_experiment_args(
            model_source="resumerge", model_args={"pretrained": target}, system_instruction=None,
            chat_template=None, fewshot_as_multiturn=False)
    return results, tracker

"""A written candidate's figure for one of resumerge's own tasks, scored by the one owner of NLL and KL scoring
(:func:`resumerge.analyses.evaluation.textpass.score_texts`, ``eval``'s ``nll:FILE`` and ``kl:PARENT:FILE`` tasks:
one decoder layer of one model at a time on the forward engine, in float32, each layer's hidden states journaled so
a killed pass resumes at the layer it reached; the figures equal ``check``'s).

``kl``: KL(parent ‖ candidate) per predicted token, averaged over the parent's texts — how far the candidate moved
from what that parent does where it is the expert. ``nll``: the candidate's negative log-likelihood per predicted
token of the texts. The texts are one per line, tokenized as ``check --prompts`` tokenizes them (no template),
cut to the models' context. A parent of another vocabulary (a ``tokenizer_source: union`` candidate's parent, a
fine-tune with added tokens, a tokenizer that numbers the tokens otherwise) is compared as ``eval`` compares it: over
the tokens both hold, each model's log-probabilities renormalised over them (check's rule,
:mod:`resumerge.forward.text.vocabs`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from resumerge.analyses.evaluation.textpass import score_texts
from resumerge.analyses.evaluation.texttasks import TextTask, shared_texts
from resumerge.config.locations import StateDir
from resumerge.errors import UsageError
from resumerge.forward.compared.passes import streams_of
from resumerge.forward.opening.opened import open_for_pass
from resumerge.forward.text.tokens import Texts
from resumerge.runs.evolve.spec import Task


def text_task(task: Task) -> TextTask:
    """An objective's ``kl`` or ``nll`` entry as the text task that scores it (:mod:`resumerge.analyses.evaluation.
    texttasks`, the one owner of NLL and KL scoring: ``eval``'s ``nll:FILE`` and ``kl:PARENT:FILE``)."""
    assert task.texts is not None
    return TextTask(task.kind, task.texts, task.parent, task.name)


def task_texts(task: Task, directories: Sequence[Path], configs: Sequence[Mapping[str, Any]],
               paths: Sequence[str], cache: Path) -> Texts:
    """``task``'s texts as the one owner of NLL and KL scoring tokenizes them for the models at ``directories``
    (the candidates' tokenizer first, a ``kl`` task's parent second; :func:`~resumerge.analyses.evaluation.
    texttasks.shared_texts`), kept under ``cache``, with how a parent's other vocabulary meets the candidates';
    where they cannot meet, :class:`UsageError` (exit 2) naming the task."""
    try:
        return shared_texts(directories, configs, paths, text_task(task), cache, option="texts")
    except UsageError as exc:
        if task.parent is None:
            raise
        raise UsageError(f"task {task.name}: {exc.message}",
                         hint="leave out the texts that hold a token the parent lacks, or measure KL from a parent "
                              "that shares the candidates' tokens") from None


def task_figure(candidate: Path, task: Task, state: StateDir, workdir: Path, tokens: Path, tokenizer: Path | None,
                on_layer: Callable[[int, int], None] | None = None, device: str = "cpu") -> float:
    """``task``'s figure for the model written in ``candidate`` (``kl`` or ``nll``), its pass journaled in
    ``workdir``; ``on_layer(layer, layers)`` is told as each layer starts. The texts are tokenized once per search
    and kept in ``tokens``, by the tokenizer of the folder ``tokenizer`` (the model the candidates' tokenizer is
    copied from; None: the candidate's own); the pass's layers run on ``device``."""
    scored = text_task(task)
    models = [replace(open_for_pass(str(candidate), "the candidate", state), role="merge")]
    if scored.parent is not None:
        models.append(replace(open_for_pass(scored.parent, "the kl task's parent", state), role="parent"))
    # As check reads its prompts: the candidate's tokenizer (the genome's tokenizer_source) where it has one.
    directories = [tokenizer or models[0].opened.directory, *(m.opened.directory for m in models[1:])]
    texts = task_texts(task, directories, [m.opened.config for m in models], [m.path for m in models], tokens)
    streams = streams_of(models, device)
    try:
        layers = streams[0].layers
        figures = score_texts(streams, texts.tokens, workdir / "pass", parent=len(models) > 1,
                              on_model=None if on_layer is None else lambda layer, m: on_layer(layer, layers),
                              point="after_check_layer", vocab=texts.vocab)
    finally:
        for stream in streams:
            stream.close()
    return figures.figure(scored)

"""A written candidate's figure for one of resumerge's own tasks, on the forward engine that ``check`` runs
(:func:`resumerge.analyses.check.passes.forward_pass`: one decoder layer of one model at a time, in float32, each
layer's hidden states journaled so a killed pass resumes at the layer it reached).

``kl``: KL(parent ‖ candidate) per predicted token, averaged over the parent's texts — how far the candidate moved
from what that parent does where it is the expert. ``nll``: the candidate's negative log-likelihood per predicted
token of the texts. The texts are one per line, tokenized as ``check --prompts`` tokenizes them (no template),
cut to the models' context."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from resumerge.analyses.check.passes import forward_pass, streams_of
from resumerge.analyses.check.tokens import cached_sequences
from resumerge.config.locations import StateDir
from resumerge.evolve.spec import Task
from resumerge.forward.opened import open_for_pass


def task_figure(candidate: Path, task: Task, state: StateDir, workdir: Path, tokens: Path, tokenizer: Path | None,
                on_layer: Callable[[int, int], None] | None = None, device: str = "cpu") -> float:
    """``task``'s figure for the model written in ``candidate`` (``kl`` or ``nll``), its pass journaled in
    ``workdir``; ``on_layer(layer, layers)`` is told as each layer starts. The texts are tokenized once per search
    and kept in ``tokens``, by the tokenizer of the folder ``tokenizer`` (the model the candidates' tokenizer is
    copied from; None: the candidate's own); the pass's layers run on ``device``."""
    models = [replace(open_for_pass(str(candidate), "the candidate", state), role="merge")]
    if task.kind == "kl":
        assert task.parent is not None
        models.append(replace(open_for_pass(task.parent, "the kl task's parent", state), role="parent"))
    assert task.texts is not None
    # As check reads its prompts: the candidate's tokenizer (the genome's tokenizer_source) where it has one.
    directories = [m.opened.directory for m in models]
    texts = cached_sequences([tokenizer or directories[0], *directories[1:]], Path(task.texts), tokens,
                             configs=[m.opened.config for m in models], paths=[m.path for m in models], cut=True)
    streams = streams_of(models, device)
    try:
        layers = streams[0].layers
        figures = forward_pass(models, streams, texts.tokens, workdir / "pass", vocab=texts.vocab,
                               on_model=None if on_layer is None else lambda layer, m: on_layer(layer, layers))
    finally:
        for stream in streams:
            stream.close()
    assert figures is not None  # no static pass folded in: the pass always ends
    if task.kind == "kl":
        found = figures.kl[1]
        assert found is not None
        return found
    return figures.nll[0]


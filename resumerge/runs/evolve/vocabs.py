"""Each ``kl`` objective whose parent's vocabulary differs from the candidates', judged before STORAGE is written:
the candidates and the parent must meet as ``check`` and ``eval`` make them meet (:mod:`resumerge.analyses.check.
vocabs`: some token shared, every text's every token held by both), else the search is refused in one line, exit 2,
before any weight is read. The generation's pass then measures the KL over the shared tokens (:mod:`.generation`).

Judged here where the candidates' tokenizer is a local folder (the genome's ``tokenizer_source`` model, its base or
its first model); a ``union`` tokenizer is built with each generation's candidates, so a parent that cannot meet it
is refused in the same line by the generation's pass, before it reads a weight. The texts' tokens are kept where
``eval`` keeps them (the state dir's evals folder), so a search asked again does not load the tokenizers again."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from resumerge.config.locations import StateDir
from resumerge.forward.opening.opened import open_for_pass
from resumerge.forward.text.vocabs import model_rows, same_vocabularies
from resumerge.runs.evolve.genome import tokenizer_model
from resumerge.runs.evolve.scoring import task_texts
from resumerge.runs.evolve.spec import EvolveSpec

CANDIDATES = "the candidates"  # how a refusal names them (none is made yet)


def refuse_unmet(spec: EvolveSpec, out_config: Mapping[str, Any], state: StateDir) -> None:
    """Raise :class:`~resumerge.errors.UsageError` (exit 2) where a ``kl`` task's parent and the candidates (their
    config.json ``out_config``, as the first candidate's plan writes it) share no token, or one of the task's texts
    holds a token one of them lacks. Loads a tokenizer only where the vocabularies differ."""
    source = tokenizer_model(spec.genome)
    if source is None:  # a union built per candidate, or a hub model's: judged in the generation's pass
        return
    for task in spec.tasks:
        if task.kind != "kl" or task.parent is None:
            continue
        parent = open_for_pass(task.parent, "the kl task's parent", state).opened
        directories = [Path(source), parent.directory]
        if same_vocabularies(directories, [model_rows(out_config), model_rows(parent.config)]):
            continue
        task_texts(task, directories, [out_config, parent.config], [CANDIDATES, task.parent], state.evals_dir)

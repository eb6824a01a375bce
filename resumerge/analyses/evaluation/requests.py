"""From lm-eval's log-likelihood requests to the token sequences a pass scores (pure: no model, no weights).

A request is a context's and a continuation's tokens, as lm-eval's ``TemplateLM`` encodes them (its own code, in
:mod:`.lm`); what the model runs is the two joined, the last token left off, cut on the left to the model's context
(lm-eval's ``hf`` model does the same), and what is scored is the continuation's tokens at the last positions.
Requests whose runs are the same tokens (a multiple-choice question's one-token answers, the same context with another
continuation's first tokens) share one run: each run is computed once, and every request reads its own tokens
from it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from resumerge.errors import UsageError


@dataclass(frozen=True)
class Scoring:
    """A pass's work: the distinct token ``runs`` (each at least one token) and, per request, the run it reads
    (``run_of``) and its continuation's tokens (``targets``), scored at the run's last ``len(target)`` positions."""

    runs: tuple[tuple[int, ...], ...]
    run_of: tuple[int, ...]
    targets: tuple[tuple[int, ...], ...]

    def digest(self) -> str:
        """What the pass computes, hashed: the key of its journal."""
        return hashlib.sha256(json.dumps([self.runs, self.run_of, self.targets]).encode()).hexdigest()[:32]

    @property
    def tokens(self) -> int:
        """The positions the pass runs (every run's tokens)."""
        return sum(len(r) for r in self.runs)


def scoring(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], max_length: int) -> Scoring:
    """The :class:`Scoring` of requests given as (context tokens, continuation tokens) for a model of context
    ``max_length``; raises :class:`UsageError` for a request lm-eval cannot score either (an empty context or
    continuation, a continuation longer than the context)."""
    runs: dict[tuple[int, ...], int] = {}
    run_of: list[int] = []
    targets: list[tuple[int, ...]] = []
    for context, continuation in pairs:
        if not context or not continuation or len(continuation) > max_length:
            raise UsageError(f"a request of {len(context)} context and {len(continuation)} continuation tokens "
                             f"cannot be scored within the model's context of {max_length} tokens",
                             hint="check the task's doc_to_text and doc_to_target")
        run = tuple([*context, *continuation][-(max_length + 1):][:-1])
        run_of.append(runs.setdefault(run, len(runs)))
        targets.append(tuple(continuation))
    return Scoring(tuple(runs), tuple(run_of), tuple(targets))

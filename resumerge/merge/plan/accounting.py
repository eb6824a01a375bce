"""What became of every input tensor of a merge: merged, copied, renumbered or dropped (and why): the records.

The plan is the one owner of the fact (:attr:`~resumerge.merge.plan.merge_plan.Plan.accounting`); ``plan`` (text and
``--json``), ``status --json`` and the model card show it. Planners say why they leave a tensor out, in one line::

    drops.add(model_key, names, "layers outside the slices")

and :func:`resumerge.merge.plan.input_fates.account` sorts every stored tensor of every input model (each name once)
into

- ``merged``: read by an output tensor with more than one input;
- ``renumbered``: else read by an output tensor at another layer index (a slice's layers renumbered);
- ``copied``: else read by an output tensor with it as its only input;
- ``dropped``: read by none, by the reason a planner gave (:data:`UNEXPLAINED` when none did).

A quantized tensor's companions (scales, zero points) count with the tensor they belong to; a LoRA adapter's
tensors are not counted (they change an input, they are not one).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

MERGED, COPIED, RENUMBERED, DROPPED = "merged", "copied", "renumbered", "dropped"
# The reason of a tensor no output reads and no planner explained: never expected (tests keep it out of every
# family's accounting), shown rather than hidden.
UNEXPLAINED = "no output tensor reads it"


class Drops:
    """The input tensors one plan build leaves out on purpose, with the reason for each (the first reason given
    for a name wins)."""

    def __init__(self) -> None:
        self._why: dict[tuple[str, str], str] = {}

    def add(self, model: str, names: Iterable[str], reason: str) -> None:
        """Record that the tensors ``names`` of input ``model`` are left out, because of ``reason`` (a short phrase
        shown as it is: "layers outside the slices")."""
        for name in names:
            self._why.setdefault((model, name), reason)

    def reason(self, model: str, name: str) -> str:
        """Why tensor ``name`` of ``model`` was left out (:data:`UNEXPLAINED` when no planner said)."""
        return self._why.get((model, name), UNEXPLAINED)


@dataclass(frozen=True)
class ModelAccount:
    """One input model's stored tensors by what became of them; ``dropped`` counts them by reason."""

    tensors: int
    merged: int = 0
    copied: int = 0
    renumbered: int = 0
    dropped: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """``{"tensors", "merged", "copied", "renumbered", "dropped", "dropped_by_reason"}``."""
        return {"tensors": self.tensors, MERGED: self.merged, COPIED: self.copied, RENUMBERED: self.renumbered,
                DROPPED: sum(self.dropped.values()), "dropped_by_reason": dict(self.dropped)}


@dataclass(frozen=True)
class Accounting:
    """Every input model's :class:`ModelAccount`, by model key; :meth:`total` adds them up."""

    models: Mapping[str, ModelAccount]

    def total(self) -> ModelAccount:
        """All models together."""
        dropped: Counter[str] = Counter()
        for m in self.models.values():
            dropped.update(m.dropped)
        accounts = self.models.values()
        return ModelAccount(sum(m.tensors for m in accounts), sum(m.merged for m in accounts),
                            sum(m.copied for m in accounts), sum(m.renumbered for m in accounts), dict(dropped))

    def to_json(self) -> dict[str, Any]:
        """The totals (:meth:`ModelAccount.to_json`) and ``"models": {key: ModelAccount.to_json()}``."""
        return self.total().to_json() | {"models": {k: m.to_json() for k, m in sorted(self.models.items())}}

    def summary(self) -> str:
        """One line: ``N input tensors: M merged, C copied, R renumbered, D dropped (reason: n; …)``."""
        t = self.total()
        why = "; ".join(f"{reason}: {n}" for reason, n in t.dropped.items())
        dropped = sum(t.dropped.values())
        return (f"{t.tensors} input tensors: {t.merged} merged, {t.copied} copied, {t.renumbered} renumbered, "
                f"{dropped} dropped" + (f" ({why})" if why else ""))

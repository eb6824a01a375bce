"""What a check found: each model's figures, the static pass's groups, the per-layer drift and localisation,
the verdict and the thresholds it was judged by. Plain data: the CLI renders it, ``--json`` dumps it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from resumerge.analyses.check.strict import finite, restore

WORKS, NO_EFFECT, BROKEN = "works", "no_effect", "broken"


@dataclass(frozen=True)
class ModelFigures:
    """One model of the check: ``role`` merge, base or parent; ``nll`` its mean next-token NLL (nats); ``kl`` the
    merge's mean KL from it, KL(this ‖ merge), in nats per token, its 95th percentile and the top-1 agreement
    (None for the merge itself); ``base_kl`` KL(base ‖ this) for a parent; ``drift`` per decoder layer,
    ‖h_merge − h_this‖ / ‖h_this‖; ``depart`` per layer, the localising pass's departure of the merge from it;
    ``own``: whether the merge's record names it (False: a model it was only compared with)."""

    role: str
    path: str
    nll: float | None = None
    kl: float | None = None
    kl_p95: float | None = None
    top1: float | None = None
    base_kl: float | None = None
    drift: tuple[float, ...] = ()
    depart: tuple[float, ...] = ()
    own: bool = True  # the merge's own base or parent (its record names it), not a model it was only compared with


@dataclass(frozen=True)
class GroupFigures:
    """A group of tensors (``layer``: its decoder layer or None; ``kind``): ‖M−B‖ over the group against the
    parents' weighted ‖Pᵢ−B‖, and their ``ratio``."""

    layer: int | None
    kind: str
    tensors: int
    merge_moved: float
    parents_moved: float
    ratio: float | None


@dataclass(frozen=True)
class StaticFigures:
    """The static pass: parameter counts, tensors with non-finite values, shape differences, the groups, and the
    groups the parents move but the merge does not."""

    parameters: dict[str, int]
    nonfinite: tuple[str, ...]
    shape_problems: tuple[str, ...]
    groups: tuple[GroupFigures, ...]
    unmoved: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """As strict JSON (:mod:`.strict`: a non-finite figure is null, what it was beside it); the check's journal
        keeps it, so a resumed check does not read every model again."""
        return dict(finite(asdict(self)))

    @staticmethod
    def from_json(doc: dict[str, Any]) -> StaticFigures:
        """What :meth:`to_json` made."""
        return _static_from_json(doc)


def _static_from_json(doc: dict[str, Any]) -> StaticFigures:
    doc = restore(doc)
    return StaticFigures(parameters=dict(doc["parameters"]), nonfinite=tuple(doc["nonfinite"]),
                         shape_problems=tuple(doc["shape_problems"]),
                         groups=tuple(GroupFigures(**g) for g in doc["groups"]), unmoved=tuple(doc["unmoved"]))


@dataclass(frozen=True)
class CheckReport:
    """The check of one merge: the ``verdict`` (works, no_effect, broken), the ``reasons`` it rests on (each
    naming the figures compared), ``broken_layer`` (0-based, or None), the models' figures, the static pass,
    the tokens it ran, the ``thresholds`` used, where its drift ``chart`` is, the ``prompts`` it ran, what became
    of MODEL's model ``card``, what the merge was ``compared`` with (one line; with no base and no parent it says
    that nothing was, and what was judged without them), and where the models' vocabularies differ the
    ``shared_tokens`` the comparisons were over and the ``vocabulary`` line saying how."""

    verdict: str
    reasons: tuple[str, ...]
    broken_layer: int | None
    models: tuple[ModelFigures, ...]
    static: StaticFigures
    sequences: int
    tokens: int
    thresholds: dict[str, float]
    spread: tuple[float, ...] = field(default=())
    chart: str | None = None  # the per-layer drift chart (PNG) beside the report, when the forward pass ran
    prompts: str | None = None  # the texts run: "built-in (...)" or the file's name and sha256
    card: str | None = None  # what became of MODEL's model card (a resumerge output's), in one line
    # where the models' vocabularies differ: the tokens they share, and how they were compared
    # (resumerge.forward.text.vocabs)
    shared_tokens: int | None = None
    vocabulary: str | None = None
    compared: str | None = None  # what the merge was compared with, in one line
    # what proving the models' bytes found, in one line (a file touched, its bytes the same; one changed in ranges
    # not read yet; a report of bytes no longer held, checked again): resumerge.forward.job.proof
    proof: str | None = None

    @property
    def exit_code(self) -> int:
        """0 works, 5 no effect, 6 broken (:data:`resumerge.errors.EXIT_CODES`' rows for a check)."""
        from resumerge.errors import EXIT_BROKEN, EXIT_NO_EFFECT, EXIT_OK

        codes: dict[str, int] = {WORKS: EXIT_OK, NO_EFFECT: EXIT_NO_EFFECT, BROKEN: EXIT_BROKEN}
        return codes[self.verdict]

    def to_json(self) -> dict[str, Any]:
        """The report as ``--json`` prints it and ``report.json`` keeps it: strict JSON, every number finite (a
        non-finite figure is null, with ``<key>_nonfinite`` beside it saying what it was: :mod:`.strict`)."""
        return dict(finite(asdict(self)))

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> CheckReport:
        """The report :meth:`to_json` made (a finished check's journal), its non-finite figures restored."""
        doc = restore(doc)
        models = tuple(ModelFigures(**{**m, "drift": tuple(m["drift"]), "depart": tuple(m["depart"])})
                       for m in doc["models"])
        return cls(**{**doc, "reasons": tuple(doc["reasons"]), "models": models,
                      "static": StaticFigures.from_json(doc["static"]),
                      "spread": tuple(doc["spread"])})

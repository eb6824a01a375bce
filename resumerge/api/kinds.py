"""Every kind of run, in one tuple the API walks: a new kind of run is one class (see
:mod:`~resumerge.api.runkind`) added here; and the one place that finds the kind a run recorded."""

from __future__ import annotations

from typing import TYPE_CHECKING

from resumerge.api.extraction_kind import ExtractionKind
from resumerge.api.merge_kind import MergeKind
from resumerge.api.moe_kind import MoeKind
from resumerge.api.recipe_kind import RecipeKind
from resumerge.api.runkind import Journaled, KeepsItsRecord, Plans, PlansLong, RunKind
from resumerge.api.surgery_kind import SurgeryKind

if TYPE_CHECKING:
    from resumerge.config.locations import RunLocations
    from resumerge.errors import NothingRecordedError

# The most specific first: a recipe, MoE upcycling, a LoRA extraction's and a transplant's recorded texts, and a
# single merge (which takes any other config).
EXTRACTION = ExtractionKind()  # also run by its own entry, extract_lora
MERGE = MergeKind()  # plans what has no single plan of its own, as the merge config loader refuses it
SURGERY = SurgeryKind()  # also run by its own entry, tokensurgeon
KINDS: tuple[RunKind, ...] = (RecipeKind(), MoeKind(), EXTRACTION, SURGERY, MERGE)


def kind_of(text: str) -> RunKind:
    """The kind of run whose config (or recorded text) ``text`` is."""
    return next(kind for kind in KINDS if kind.recognises(text))


def planner_of(kind: RunKind) -> Plans:
    """``kind`` where it has a single plan; else the single merge's planner, which refuses the config as it
    refuses every text that is not one merge config (a recipe's several documents)."""
    return kind if isinstance(kind, Plans) else MERGE


def own_record(where: RunLocations) -> KeepsItsRecord | None:
    """The kind whose own record ``where.out`` holds (a recipe's), or None: a single run's ledger, or nothing,
    says."""
    return next((k for k in KINDS if isinstance(k, KeepsItsRecord) and k.holds(where)), None)


def killed_account(error: NothingRecordedError, where: RunLocations) -> NothingRecordedError:
    """``error`` (nothing recorded for ``where.out``) with the account the kind its planning mark named gives of what
    a run killed while planning had done (:class:`~resumerge.api.runkind.PlansLong`); unchanged otherwise."""
    named = getattr(error, "kind", "")  # a KilledPlanningError's
    kind = next((k for k in KINDS if k.name == named), None) if named else None
    started_by = getattr(kind, "started_by", None)  # a kind started by a command of its own (tokensurgeon)
    if started_by is not None:
        error.hint = f"run the same {started_by} {where.out} again (with the options it was given)"
    if isinstance(kind, PlansLong):
        error.hint = f"{error.hint or ''}{kind.planning_done(where)}"
    return error


def recorded_kind(name: str | None, text: str | None) -> Journaled:
    """The kind of the single run whose ledger records ``name`` and ``text``.

    The one place a kind is derived rather than read: a run recorded before runs recorded their kind (``name``
    None), or one only OUT's manifest holds (its bytes stay as they were), is told by its recorded ``text`` as the
    front door tells a config's kind: an extraction's spec, a mergekit-moe config, else a merge config. Nothing
    recorded (``text`` None too): the single merge, whose resume and status say so."""
    if name is not None:
        for kind in KINDS:
            if kind.name == name and isinstance(kind, Journaled):
                return kind
        from resumerge.errors import LedgerError

        raise LedgerError(f"this run was recorded as a {name!r} run, which this resumerge does not know",
                          hint="resume it with the resumerge version that started it")
    by_text = kind_of(text) if text is not None else MERGE
    return by_text if isinstance(by_text, Journaled) else MERGE

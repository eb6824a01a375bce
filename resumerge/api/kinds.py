"""Every kind of run, in one tuple the API walks: a new kind of run is one class (see
:class:`~resumerge.api.runkind.RunKind`) added here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from resumerge.api.extraction_kind import ExtractionKind
from resumerge.api.merge_kind import MergeKind
from resumerge.api.moe_kind import MoeKind
from resumerge.api.recipe_kind import RecipeKind
from resumerge.api.runkind import PathLike, RunKind
from resumerge.config.settings import RunSettings

if TYPE_CHECKING:
    from resumerge.engine.executor import Reporter
    from resumerge.plan.merge_plan import PlanOptions
    from resumerge.plan.prepared import Prepared

# The most specific first: a recipe, MoE upcycling, a LoRA extraction's recorded text, and a single merge (which
# takes any other config).
EXTRACTION = ExtractionKind()  # also run by its own entry, extract_lora
KINDS: tuple[RunKind, ...] = (RecipeKind(), MoeKind(), EXTRACTION, MergeKind())


def kind_of(text: str) -> RunKind:
    """The kind of run whose config (or recorded text) ``text`` is."""
    return next(kind for kind in KINDS if kind.recognises(text))


def prepare_recorded(text: str, options: PlanOptions, model_dirs: Mapping[str, str], settings: RunSettings,
                     reporter: Reporter | None, *, out: PathLike) -> Prepared:
    """The prepared plan of the run recorded as ``text`` in ``out``, by its kind (the session's resume calls it)."""
    return kind_of(text).prepare_recorded(text, options, model_dirs, settings, reporter, out)

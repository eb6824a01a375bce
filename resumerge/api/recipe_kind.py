"""A recipe (mergekit-multi): several YAML documents, each a stage merged by the session path in turn; its OUT
holds the recipe's record, by which ``resume`` and ``status`` know it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from resumerge.api.runkind import Call, PathLike
from resumerge.errors import UsageError

if TYPE_CHECKING:
    from resumerge.analyses.estimate.measuring import Measuring
    from resumerge.config.locations import RunLocations
    from resumerge.config.settings import RunSettings
    from resumerge.merge.engine.drive import Outcome
    from resumerge.merge.engine.reporting import Driving
    from resumerge.runs.recipes.estimate import RecipeEstimate
    from resumerge.runs.recipes.view import RecipeStatus


class RecipeKind:
    """A recipe: its stages are planned and run by :mod:`resumerge.runs.recipes`, which keeps the recipe's own record
    (each stage is a merge of its own ledger). It has no single plan: ``plan`` estimates every stage."""

    name = "recipe"

    def recognises(self, text: str) -> bool:
        """More than one non-empty YAML document."""
        from resumerge.runs.recipes.recipe import is_recipe_text

        return is_recipe_text(text)

    def check(self, call: Call, driving: Driving) -> None:
        """MoE's flag refused (a recipe's stages are merge configs)."""
        from resumerge.api.options import source_name  # here: status imports the kinds, not the options

        if call.allow_same_experts:
            raise UsageError("--i-understand-this-is-not-useful-without-training applies to mergekit-moe configs "
                             f"(base_model and experts) only, and {source_name(call.config, 'the config')} is not "
                             "one")

    def run(self, call: Call, driving: Driving) -> Outcome:
        """Every stage still to do; the final stage's outcome. With an ``hf://`` OUT only the final stage is
        committed to the repo, with the recipe's record."""
        from resumerge.api.options import source_name
        from resumerge.runs.recipes.run import run_recipe

        return run_recipe(call.text, call.locations, call.options, call.settings, driving,
                          source=source_name(call.config, "recipe")).outcome()

    def holds(self, where: RunLocations) -> bool:
        """Whether ``where.out`` holds a recipe's record (in the state dir, or in OUT: for an ``hf://`` OUT without
        a recipe ledger here, in the repo)."""
        from resumerge.runs.recipes.held import is_recipe_out

        return is_recipe_out(where.out, where.state)

    def resume_own(self, where: RunLocations, settings: RunSettings, driving: Driving) -> Outcome:
        """Every stage still to do of the recipe recorded in ``where.out``; the final stage's outcome."""
        from resumerge.runs.recipes.run import resume_recipe

        return resume_recipe(where, settings, driving).outcome()

    def status_own(self, where: RunLocations) -> RecipeStatus:
        """Every stage of the recipe writing to ``where.out``, and the one in progress."""
        from resumerge.runs.recipes.view import read_recipe_status

        return read_recipe_status(where.out, where.state)

    def estimate(self, call: Call, measuring: Measuring, *, fresh_process: bool,
                 intermediate_dir: PathLike | None) -> RecipeEstimate:
        """Every stage estimated (:func:`~resumerge.runs.recipes.estimate.estimate_recipe`); needs OUT to place them."""
        from resumerge.api.options import source_name
        from resumerge.merge.engine.reporting import Driving  # the engine's, imported by a run alone
        from resumerge.runs.recipes.estimate import estimate_recipe

        self.check(call, Driving(should_stop=_never))
        if call.out is None:
            raise UsageError("planning a recipe needs OUT: its stages are placed relative to it",
                             hint=f"resumerge plan {call.config} OUT")
        return estimate_recipe(call.text, call.options, call.settings, out_dir=call.out,
                               source=source_name(call.config, "recipe"), intermediate_dir=intermediate_dir,
                               probe_bytes=measuring.probe_bytes, disk_free=measuring.disk_free)


def _never() -> bool:
    return False

"""Whether an OUT holds a recipe's record, and that record as OUT holds it: what ``resumerge status`` asks of every
OUT first, kept apart from :mod:`.view`'s report types so that it imports none of them (the hub's record is imported
for an ``hf://`` OUT only).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.config.hubtarget import is_hub_target
from resumerge.errors import StorageError
from resumerge.runs.recipes.ledger_read import RECIPE_LEDGER_NAME
from resumerge.runs.recipes.manifest import RECIPE_MANIFEST_NAME, read_recipe_manifest, recipe_dir

if TYPE_CHECKING:
    from resumerge.config.locations import RunLocations, StateDir
    from resumerge.runs.recipes.manifest import RecipeRecord


def is_recipe_out(out_dir: str | os.PathLike[str], state: StateDir) -> bool:
    """True when ``out_dir`` is (or is being) written by a recipe: its record is in the state dir or in OUT (for
    an ``hf://`` OUT without a recipe ledger here: in the repo, one small request)."""
    where = state.run(out_dir)
    if (recipe_dir(where) / RECIPE_LEDGER_NAME).exists():
        return True
    if is_hub_target(out_dir):
        try:
            return out_record(where) is not None
        except StorageError:  # the hub refused the token: the single-merge path says what to do about it
            return False
    return (Path(out_dir) / RECIPE_MANIFEST_NAME).is_file()


def out_record(where: RunLocations) -> RecipeRecord | None:
    """OUT's ``resumerge-recipe.json``: the folder's, or the repo's for an ``hf://`` OUT."""
    if not is_hub_target(where.out):
        return read_recipe_manifest(Path(where.out))
    from resumerge.runs.recipes.hub import remote_recipe_record

    return remote_recipe_record(where.out, where.resume_command)

"""A recipe's ``hf://`` OUT: the repo opened before any weight is read, and its recipe record kept in step.

Only the final stage writes to the repo (through the same sink as a single merge); the named stages are written
on local disk. Opening checks write access (exit 2), creates the repo when missing (private unless ``--public``),
reads the final stage's manifest and the recipe record (two small requests) and refuses a repo holding files
resumerge did not write (exit 4), exactly as for one merge — the record itself is resumerge's.
"""

from __future__ import annotations

import os

from resumerge.config.hubtarget import parse_hub_target
from resumerge.engine.hubout import HubOutput
from resumerge.store.hubrepo import check_repo_is_ours, open_hub_repo, read_remote_manifest
from resumerge.store.hubsink import HubOutputOptions
from resumerge.store.recipe_hub import check_recipe_repo_is_ours, commit_recipe_record, read_remote_recipe
from resumerge.store.recipe_manifest import RecipeRecord
from resumerge.store.statusview import resume_command


class RecipeHub:
    """An opened hub repo OUT of a recipe: the final stage's output, and the record the repo holds."""

    def __init__(self, output: HubOutput, record: RecipeRecord | None, committed: bytes | None) -> None:
        self.output, self.record = output, record
        self.committed = committed  # the record's bytes at the branch head: a commit is made only on a change

    @property
    def url(self) -> str:
        """The target as the user writes it (``hf://NAMESPACE/NAME[@BRANCH]``)."""
        return self.output.url

    def final_output(self) -> HubOutput:
        """The repo as the final stage's sink must see it when that stage starts, maybe hours after the repo was
        opened: its manifest read again, and the branch head left to the sink to read (the recipe's own commits
        came after the opening, and are not another writer's)."""
        repo, resume = self.output.repo, self.output.resume
        return HubOutput(repo, read_remote_manifest(repo, resume=resume), resume, self.output.options)

    def store(self, record: RecipeRecord) -> None:
        """Commit ``record`` as the repo's ``resumerge-recipe.json`` unless the repo already holds these bytes."""
        data = record.to_bytes()
        if data != self.committed:
            commit_recipe_record(self.output.repo, data, resume=self.output.resume)
            self.committed = data


def open_recipe_hub(out: str, *, state_dir: str | os.PathLike[str] | None,
                    options: HubOutputOptions | None = None, create: bool = True) -> RecipeHub:
    """Open ``out`` (``hf://…``) as a recipe's OUT; raises UsageError (exit 2) for a bad target or token,
    OutputDirError (exit 4) for a repo holding files resumerge did not write, UnreachableError (exit 3)."""
    target = parse_hub_target(out)
    repo = open_hub_repo(target, public=bool(options and options.public), create=create)
    resume = resume_command(target.url, state_dir)
    manifest = read_remote_manifest(repo, resume=resume)
    found = read_remote_recipe(repo, resume=resume)
    if manifest is None and found is None:
        check_repo_is_ours(repo, None, resume=resume)
    elif manifest is None:  # killed before the final stage committed: the record is all the repo should hold
        check_recipe_repo_is_ours(repo, resume=resume)
    output = HubOutput(repo, manifest, resume, options or HubOutputOptions())
    return RecipeHub(output, found[0] if found else None, found[1] if found else None)

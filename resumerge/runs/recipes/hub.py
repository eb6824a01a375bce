"""A recipe's ``hf://`` OUT: the repo opened before any weight is read, and the recipe's record
(``resumerge-recipe.json``) in it read and kept in step.

The repo is opened exactly as for one merge (:func:`resumerge.merge.engine.hubout.open_hub_output`: write access
checked, exit 2; created when missing, private unless ``--public``; a repo holding files resumerge did not write
refused, exit 4 — the record itself is resumerge's). Only the final stage writes to the repo, through the same sink as a
single merge; the named stages are written on local disk.

The record sits in the repo beside the final stage's files and manifest, exactly as it sits in a local recipe
OUT, so ``resumerge resume hf://…`` on a fresh machine finds the whole recipe from the repo alone. It is committed
on its own (never inside the final stage's batches): before the first stage runs, and when its state changes.
A commit is made only when the repo's copy differs, and it names nothing but the record, so replaying one after a
crash is harmless. The token never reaches the record: it lives only in :class:`~resumerge.merge.store.hubrepo.HubRepo`.
"""

from __future__ import annotations

import json

from huggingface_hub import CommitOperationAdd, get_token

from resumerge.config.hubtarget import parse_hub_target
from resumerge.config.locations import RunLocations
from resumerge.config.settings import HubOutputOptions
from resumerge.errors import LedgerError
from resumerge.inputs.hub.cache import hub_settings
from resumerge.merge.engine.hubout import HubOutput, open_hub_output
from resumerge.merge.store.hubrepo import HubRepo, read_file, read_remote_manifest
from resumerge.merge.store.hubretry import with_retries
from resumerge.runs.recipes.manifest import RECIPE_MANIFEST_NAME, RecipeRecord, published_record, record_from_doc


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
        data = published_record(record, self.url).to_bytes()
        if data != self.committed:
            commit_recipe_record(self.output.repo, data, resume=self.output.resume)
            self.committed = data


def open_recipe_hub(where: RunLocations, options: HubOutputOptions, *, create: bool = True) -> RecipeHub:
    """Open ``where.out`` (``hf://…``) as a recipe's OUT, as for one merge, tolerating the recipe's record (a
    recipe killed before its final stage committed leaves only that); then read the record (one small request)."""
    output = open_hub_output(where.out, state=where.state, options=options, create=create,
                             ours=frozenset({RECIPE_MANIFEST_NAME}))
    found = read_remote_recipe(output.repo, resume=output.resume)
    return RecipeHub(output, found[0] if found else None, found[1] if found else None)


def parse_recipe_bytes(data: bytes, where: str) -> RecipeRecord:
    """The record in ``data``; raises :class:`LedgerError` naming ``where`` when it is unreadable."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LedgerError(f"the recipe record {where} is unreadable ({exc})", path=where) from None
    return record_from_doc(doc, where)


def read_remote_recipe(repo: HubRepo, *, resume: str) -> tuple[RecipeRecord, bytes] | None:
    """The repo's recipe record and its bytes at the branch head, or None when it has none (one small request)."""
    data = read_file(repo, RECIPE_MANIFEST_NAME, resume=resume)
    if data is None:
        return None
    return parse_recipe_bytes(data, f"{repo.target.url}/{RECIPE_MANIFEST_NAME}"), data


def commit_recipe_record(repo: HubRepo, data: bytes, *, resume: str) -> None:
    """Commit ``data`` as the repo's ``resumerge-recipe.json`` (retried like every hub commit; exit 3 when the hub
    keeps failing). Raises like :func:`~resumerge.merge.store.hubretry.with_retries`."""
    api = repo.api()
    target = repo.target
    operation = CommitOperationAdd(path_in_repo=RECIPE_MANIFEST_NAME, path_or_fileobj=data)
    with_retries(repo, "committing the recipe record", lambda: api.create_commit(
        target.repo_id, operations=[operation], commit_message="resumerge: record the recipe",
        revision=target.branch), resume=resume)


def remote_recipe_record(out: str, command: str) -> RecipeRecord | None:
    """The recipe record of the repo ``out`` names (for ``status``: reading needs no write access, and a public
    repo no token), or None when it holds none."""
    repo = HubRepo(parse_hub_target(out), hub_settings(offline=False).endpoint, get_token() or "")
    found = read_remote_recipe(repo, resume=command)
    return found[0] if found is not None else None

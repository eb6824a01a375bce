"""A recipe's record (``resumerge-recipe.json``) in a hub repo OUT: read it, and commit a new version of it.

The record sits in the repo beside the final stage's files and manifest, exactly as it sits in a local recipe
OUT, so ``resumerge resume hf://…`` on a fresh machine finds the whole recipe from the repo alone. It is committed
on its own (never inside the final stage's batches): before the first stage runs, and when its state changes.
A commit is made only when the repo's copy differs, and it names nothing but the record, so replaying one after a
crash is harmless. The token never reaches the record: it lives only in :class:`~resumerge.store.hubrepo.HubRepo`.
"""

from __future__ import annotations

import json

from huggingface_hub import CommitOperationAdd, get_token

from resumerge.config.hubtarget import parse_hub_target
from resumerge.errors import LedgerError
from resumerge.inputs.hub.cache import hub_settings
from resumerge.store.hubcommits import with_retries
from resumerge.store.hubrepo import HubRepo, check_repo_is_ours, read_file
from resumerge.store.recipe_manifest import RECIPE_MANIFEST_NAME, RecipeRecord, record_from_doc


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


def check_recipe_repo_is_ours(repo: HubRepo, *, resume: str) -> None:
    """Refuse (exit 4) a repo holding a recipe record but no final-stage manifest, and files besides the hub's
    initial ones and that record: resumerge wrote the record, not those files."""
    check_repo_is_ours(repo, None, resume=resume, ours=frozenset({RECIPE_MANIFEST_NAME}))


def commit_recipe_record(repo: HubRepo, data: bytes, *, resume: str) -> None:
    """Commit ``data`` as the repo's ``resumerge-recipe.json`` (retried like every hub commit; exit 3 when the hub
    keeps failing). Raises like :func:`~resumerge.store.hubcommits.with_retries`."""
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

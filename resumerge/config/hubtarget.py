"""``hf://NAMESPACE/NAME[@BRANCH]``: a Hugging Face Hub model repo given where an output directory is accepted.

Parsing only: what the user wrote becomes a :class:`HubTarget` (or a :class:`~resumerge.errors.UsageError`, exit 2,
saying what a valid target looks like). Whether the repo exists or may be written is decided later, by the store.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

from resumerge.errors import UsageError

SCHEME = "hf://"
# The hub's own rule for repo names (huggingface_hub's validate_repo_id): letters, digits, "-", "_", ".", no "--" or
# "..", not starting or ending with "-" or ".", at most 96 characters.
_PART = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9][A-Za-z0-9._-]{0,94}[A-Za-z0-9_]$|^[A-Za-z0-9]$")
_BRANCH = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$")


@dataclass(frozen=True)
class HubTarget:
    """A model repo on the hub as the output: ``repo_id`` (``namespace/name``) and the ``branch`` committed to."""

    namespace: str
    name: str
    branch: str = "main"

    @property
    def repo_id(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def url(self) -> str:
        """The target as the user writes it (``@branch`` only when it is not ``main``)."""
        suffix = "" if self.branch == "main" else f"@{self.branch}"
        return f"{SCHEME}{self.repo_id}{suffix}"

    def state_key(self) -> str:
        """The name of this target's folder under the state dir: stable across machines and working directories."""
        digest = hashlib.sha256(self.url.encode()).hexdigest()[:12]
        return f"hf-{self.namespace}--{self.name}-{digest}"


def is_hub_target(out: str | os.PathLike[str]) -> bool:
    """True when ``out`` is written as ``hf://…`` (a path object never is)."""
    return isinstance(out, str) and out.startswith(SCHEME)


def parse_hub_target(out: str) -> HubTarget:
    """Parse ``hf://NAMESPACE/NAME[@BRANCH]``; raises :class:`UsageError` (exit 2) for anything else."""
    body = out[len(SCHEME):] if out.startswith(SCHEME) else out
    repo, _, branch = body.partition("@")
    parts = repo.split("/")
    hint = "write the output as hf://NAMESPACE/NAME or hf://NAMESPACE/NAME@BRANCH (a model repo)"
    if len(parts) != 2 or not all(_PART.match(p) for p in parts):
        raise UsageError(f"{out} is not a hub repo id", path=out, hint=hint)
    if "@" in body and not (_BRANCH.match(branch) and ".." not in branch and not branch.endswith((".lock", "/"))):
        raise UsageError(f"{out} names an invalid branch {branch!r}", path=out, hint=hint)
    return HubTarget(parts[0], parts[1], branch or "main")

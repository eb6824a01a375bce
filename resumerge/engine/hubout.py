"""OUT as a hub repo (``hf://NAMESPACE/NAME[@BRANCH]``) for a session: open it before any weight is read, and
build its sink once the plan is known.

Opening checks write access (exit 2 without a usable token), creates the repo when missing (private unless
``public``), reads its manifest (one small request) and refuses a repo holding files resumerge did not write
(exit 4). The session then runs exactly as for a local OUT; only the sink differs. The branch head read here is
the parent of the run's first commit: a commit another run makes from then on is refused to this one (exit 4).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from resumerge.config.hubtarget import parse_hub_target
from resumerge.errors import UsageError
from resumerge.memory import format_size
from resumerge.plan.merge_plan import Plan
from resumerge.store.hubrepo import (
    HubRepo,
    branch_head,
    check_repo_is_ours,
    open_hub_repo,
    read_remote_manifest,
)
from resumerge.store.hubsink import HubOutputOptions, HubRepoSink
from resumerge.store.manifest import Manifest
from resumerge.store.statusview import resume_command


@dataclass(frozen=True)
class HubOutput:
    """An opened hub repo OUT: the repo, its manifest when it holds one, and the command that resumes into it."""

    repo: HubRepo
    manifest: Manifest | None
    resume: str
    options: HubOutputOptions
    head: str | None = None  # the branch head when opened, read before the manifest (None: read by the sink)

    @property
    def url(self) -> str:
        return self.repo.target.url

    def sink(self, plan: Plan, run_dir: Path, planned: list[str], max_disk: int | None,
             should_stop: Callable[[], bool] = lambda: False) -> HubRepoSink:
        """The sink committing ``plan``'s files, staged under ``run_dir``/staging, under ``max_disk`` bytes; its
        wait for the last commits ends early when ``should_stop`` turns true."""
        check_max_disk(plan, max_disk)
        reserve = max((s.file_size for s in plan.shards), default=0)
        return HubRepoSink(self.repo, run_dir / "staging", planned=planned, resume=self.resume,
                           batching=self.options.batching, max_disk=max_disk, reserve=reserve, head=self.head,
                           should_stop=should_stop)


def open_hub_output(out: str, *, state_dir: str | os.PathLike[str] | None,
                    options: HubOutputOptions | None = None, create: bool = True,
                    ours: frozenset[str] = frozenset()) -> HubOutput:
    """Open ``out`` (``hf://…``) for writing; raises UsageError (exit 2) for a bad target or token,
    OutputDirError (exit 4) for a repo holding files resumerge did not write, UnreachableError (exit 3).
    ``ours`` names files resumerge may have written before any manifest (a recipe's record)."""
    target = parse_hub_target(out)
    repo = open_hub_repo(target, public=bool(options and options.public), create=create)
    resume = resume_command(target.url, state_dir)
    # The head first: a commit another run makes after this read is then refused to us (412), never missed.
    head = branch_head(repo, resume=resume)
    manifest = read_remote_manifest(repo, resume=resume)
    check_repo_is_ours(repo, manifest, resume=resume, ours=ours)
    return HubOutput(repo, manifest, resume, options or HubOutputOptions(), head)


def check_max_disk(plan: Plan, max_disk: int | None) -> None:
    """Refuse (exit 2) a ``--max-disk`` smaller than the largest planned shard: it could never be staged."""
    largest = max((s.file_size for s in plan.shards), default=0)
    if max_disk is not None and max_disk < largest:
        raise UsageError(f"--max-disk {format_size(max_disk)} is smaller than the largest output shard "
                         f"({format_size(largest)})",
                         hint=f"pass --max-disk {format_size(largest, compact=True)} or more, or a smaller "
                              "--out-shard-size")

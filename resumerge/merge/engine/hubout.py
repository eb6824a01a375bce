"""OUT as a hub repo (``hf://NAMESPACE/NAME[@BRANCH]``) for a session: open it before any weight is read, create
it once the run's plan is recorded, and build its sink.

Opening checks write access (exit 2 without a usable token), reads the repo's manifest (one small request) and
refuses a repo holding files resumerge did not write (exit 4). A missing repo is not created then: the session
records the plan in the ledger first and only then creates it (:func:`create_recorded`, private unless ``public``),
so a run killed at any point of its start finds either nothing anywhere (``resume`` says to start it with
``resumerge run CONFIG hf://…``, exit 2) or a state dir holding its plan (``resume`` creates the repo and
continues). The session then runs exactly as for a local OUT; only the sink differs. The branch head read here is
the parent of the run's first commit: a commit another run makes from then on is refused to this one (exit 4).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from resumerge.config.hubtarget import parse_hub_target
from resumerge.config.locations import StateDir
from resumerge.config.settings import HubOutputOptions
from resumerge.errors import OutputDirError, ResumergeError, UsageError
from resumerge.machine.memory import format_size
from resumerge.merge.engine.hubdisk import hub_disk_need
from resumerge.merge.engine.outdir import Recording, record_plan
from resumerge.merge.plan.merge_plan import Plan
from resumerge.merge.store.hubrepo import (
    HubRepo,
    branch_head,
    check_repo_is_ours,
    create_repo,
    existing_head,
    open_hub_repo,
    read_remote_manifest,
)
from resumerge.merge.store.hubsink import HubRepoSink, StagingBudget
from resumerge.merge.store.ledger import Ledger
from resumerge.merge.store.manifest import Manifest


@dataclass(frozen=True)
class HubOutput:
    """An opened hub repo OUT: the repo, its manifest when it holds one, and the command that resumes into it."""

    repo: HubRepo
    manifest: Manifest | None
    resume: str
    options: HubOutputOptions
    head: str | None = None  # the branch head when opened, read before the manifest (None: read by the sink)
    exists: bool = True  # False: the repo (or its branch) does not exist yet; see create_recorded

    @property
    def url(self) -> str:
        return self.repo.target.url

    def sink(self, plan: Plan, run_dir: Path, planned: list[str], max_disk: int | None,
             should_stop: Callable[[], bool] = lambda: False,
             tell: Callable[[str], None] | None = None) -> HubRepoSink:
        """The sink committing ``plan``'s files, staged under ``run_dir``/staging, under ``max_disk`` bytes; its
        wait for the last commits ends early when ``should_stop`` turns true; ``tell`` shows the user what the
        commits wait for (the hub's commit quota)."""
        if not self.exists:
            raise ResumergeError(f"internal: {self.url} is written before it was created")
        check_max_disk(plan, max_disk)
        # The files staged at once (a release's together) always find their room.
        budget = None if max_disk is None else StagingBudget(max_disk, hub_disk_need(plan, max_disk).largest_file)
        return HubRepoSink(self.repo, run_dir / "staging", planned=planned, resume=self.resume,
                           batching=self.options.batching, budget=budget, head=self.head, should_stop=should_stop,
                           tell=tell)


# The ledger event that records how the run creates its repo, so that a resume creates it the same way.
CREATED = "hub-repo"


def create_recorded(hub: HubOutput, plan: Plan, config_text: str, ledger: Ledger, *, restart: bool,
                    recording: Recording) -> HubOutput:
    """Create ``hub``'s missing repo once ``ledger`` holds the run's plan, and return it opened.

    The plan (and whether the repo is public) is recorded first, so that a run killed while creating the repo, or
    before its first commit, leaves a state dir that ``resume`` continues from. Nothing recorded here claims a file
    as done: the ledger only names what is planned. A plan the ledger already holds (a resume, or the same run
    again) is kept; a different one is left to the session to refuse (or, with ``restart``, replaced).
    """
    row = ledger.run_row()
    if row is None or (restart and (row.fingerprint != plan.fingerprint or row.config_text != config_text)):
        record_plan(plan, config_text, hub.url, ledger, recording)
    recorded = ledger.last_event_data(CREATED) or {}
    public = hub.options.public or bool(recorded.get("public"))
    if recorded.get("public") != public:  # a later --public wins over the recorded private
        ledger.event(CREATED, f"creating {hub.url} ({'public' if public else 'private'})", {"public": public})
    create_repo(hub.repo, public=public, resume=hub.resume)
    head = branch_head(hub.repo, resume=hub.resume)
    manifest = read_remote_manifest(hub.repo, resume=hub.resume)
    check_repo_is_ours(hub.repo, manifest, resume=hub.resume)  # created by someone else meanwhile
    if manifest is not None:
        raise OutputDirError(f"another run wrote to {hub.url} while this one created it", path=hub.url,
                             hint=f"stop the other run, then {hub.resume}")
    return replace(hub, head=head, exists=True)


def open_hub_output(out: str, *, state: StateDir,
                    options: HubOutputOptions | None = None, create: bool = True,
                    ours: frozenset[str] = frozenset(), deferred: bool = False) -> HubOutput:
    """Open ``out`` (``hf://…``) for writing; raises UsageError (exit 2) for a bad target or token,
    OutputDirError (exit 4) for a repo holding files resumerge did not write, UnreachableError (exit 3).
    ``ours`` names files resumerge may have written before any manifest (a recipe's record). A missing repo is
    created now when ``create``; ``deferred`` opens it as missing instead (``exists`` false), for the session to
    create once its plan is recorded (:func:`create_recorded`)."""
    target = parse_hub_target(out)
    repo = open_hub_repo(target, public=bool(options and options.public), create=create and not deferred)
    resume = state.resume_command(target.url)
    # The head first: a commit another run makes after this read is then refused to us (412), never missed.
    head = existing_head(repo, resume=resume) if deferred else branch_head(repo, resume=resume)
    if head is None:
        return HubOutput(repo, None, resume, options or HubOutputOptions(), exists=False)
    manifest = read_remote_manifest(repo, resume=resume)
    check_repo_is_ours(repo, manifest, resume=resume, ours=ours)
    return HubOutput(repo, manifest, resume, options or HubOutputOptions(), head)


def check_max_disk(plan: Plan, max_disk: int | None) -> None:
    """Refuse (exit 2) a ``--max-disk`` smaller than the largest planned shard (a GGUF release: its files, written
    together): it could never be staged."""
    largest = hub_disk_need(plan, max_disk).largest_file
    if max_disk is not None and max_disk < largest:
        shard = max((s.file_size for s in plan.shards), default=0)
        what = "output shard" if largest == shard else "set of files written together (a GGUF release's)"
        raise UsageError(f"--max-disk {format_size(max_disk)} is smaller than the largest {what} "
                         f"({format_size(largest)})",
                         hint=f"pass --max-disk {format_size(largest, compact=True)} or more, or a smaller "
                              "--out-shard-size")

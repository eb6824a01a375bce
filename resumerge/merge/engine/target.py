"""OUT of one run, opened: a local folder or an ``hf://`` repo, the manifest it holds, and the command that
resumes into it.

Every kind of run goes through :meth:`Target.open` (or :meth:`Target.of_hub` for a repo opened already), so a
repo is always opened the same way — write access checked and foreign files refused before any weight is read
(:func:`resumerge.merge.engine.hubout.open_hub_output`) — and a folder is always checked the same way
(:func:`resumerge.merge.engine.outdir.check_out_dir`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.config.hubtarget import is_hub_target
from resumerge.config.locations import RunLocations
from resumerge.config.settings import RunSettings
from resumerge.merge.engine.outdir import check_out_dir, check_out_path
from resumerge.merge.plan.outguard import refuse_state_in_out
from resumerge.merge.store.manifest import Manifest
from resumerge.merge.store.manifestcheck import manifest_or_ledger

if TYPE_CHECKING:  # the hub's client stack, imported where OUT is a repo (Target.at), never for a folder
    from resumerge.merge.engine.hubout import HubOutput


@dataclass(frozen=True)
class Target:
    """Where a run writes: ``out`` (the folder, or the repo's ``hf://`` URL as a path) and, for a repo, the opened
    ``hub`` output. ``command`` is what an interruption tells the user to run; ``locations`` where the run keeps
    its state (resolved once, here); ``tolerate`` names files the folder may hold besides resumerge's own (a
    recipe's record beside its final stage)."""

    out: Path
    command: str
    locations: RunLocations
    hub: HubOutput | None = None
    tolerate: frozenset[str] = frozenset()
    # A resume reads OUT's manifest before it can plan; it is kept here rather than read (and checked) twice.
    recorded: tuple[Manifest | None] | None = None

    @classmethod
    def open(cls, out_dir: str | os.PathLike[str], settings: RunSettings, *,
             tolerate: frozenset[str] = frozenset(), command: str | None = None) -> Target:
        """Open ``out_dir``: an ``hf://`` repo is opened now (raises UsageError, OutputDirError or UnreachableError
        as :func:`~resumerge.merge.engine.hubout.open_hub_output` does); a missing one is opened as missing and created
        by the session once the plan is recorded (:func:`~resumerge.merge.engine.hubout.create_recorded`), so a resume
        creates it only from a recorded plan. A folder is only named (it is checked when
        the run has a plan)."""
        return cls.at(settings.state.run(out_dir), settings, tolerate=tolerate, command=command)

    @classmethod
    def at(cls, where: RunLocations, settings: RunSettings, *, tolerate: frozenset[str] = frozenset(),
           command: str | None = None) -> Target:
        """:meth:`open` of ``where.out``, its locations resolved already (by the API, once for the call)."""
        if is_hub_target(where.out):
            from resumerge.merge.engine.hubout import open_hub_output

            hub = open_hub_output(where.out, state=where.state, options=settings.output, deferred=True)
            return cls(Path(hub.url), command or where.resume_command, where, hub)
        refuse_state_in_out(where.out, where.state)  # before the planning mark writes there
        return cls(Path(where.out).absolute(), command or where.resume_command, where, tolerate=tolerate)

    @classmethod
    def of_hub(cls, hub: HubOutput, where: RunLocations, command: str | None = None) -> Target:
        """The target of a repo opened already (a recipe opens its repo before planning its stages), its state
        where ``where`` (the repo's locations) says."""
        return cls(Path(hub.url), command or where.resume_command, where, hub)

    @property
    def url(self) -> str | Path:
        """OUT as the run records it: the ``hf://`` URL of a repo, else the folder's absolute path."""
        return self.hub.url if self.hub is not None else self.out

    def manifest(self) -> Manifest | None:
        """OUT's manifest (None: a new or empty OUT). A folder holding files resumerge did not write is refused
        (OutputDirError, exit 4), a link or a file too (UsageError, exit 2)."""
        if self.hub is not None:
            return self.hub.manifest
        if self.recorded is not None:
            return self.recorded[0]
        return check_out_dir(self.out, tolerate=self.tolerate, ledger=self.locations.ledger)

    def read_recorded(self) -> Target:
        """This target with OUT's manifest read as a resume needs it: a folder must be one (not a link), and may
        hold other files — the ledger decides what to do with them (a damaged manifest too, where the ledger
        vouches for OUT: :func:`~resumerge.merge.store.manifestcheck.manifest_or_ledger`)."""
        if self.hub is not None or self.recorded is not None:
            return self
        check_out_path(self.out, resuming=True)
        found = manifest_or_ledger(self.out, self.locations.ledger) if self.out.is_dir() else None
        return replace(self, recorded=(found,))

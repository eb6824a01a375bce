"""What a kind of run's planning hands the session path: the plan, the inputs it was built from, the run's shared
objects for its units, and the work that goes on beside the merge.

Every kind of run (a merge config, a recipe's stage, MoE upcycling, a LoRA extraction) ends in one
:class:`Prepared` and the engine's one session path; the engine never asks which kind made it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from resumerge.errors import ResumergeError
from resumerge.merge.methods.resources import NO_RESOURCES, Resources

if TYPE_CHECKING:
    from resumerge.inputs.catalog import Inputs
    from resumerge.machine.memory import MemoryGovernor
    from resumerge.merge.plan.merge_plan import Plan


class Beside(Protocol):
    """Work of the run in a process of its own that goes on beside the merge (MoE upcycling's prompt forward
    pass, whose results only the plan's last units wait for)."""

    def hold(self, governor: MemoryGovernor) -> None:
        """Take its share of the memory budget from the run's ``governor`` until it ends."""

    def notes(self) -> tuple[str, ...]:
        """What it found that the user must hear (the plan was made before it ended): asked once the merge's
        tensors are done, shown and kept like the plan's notes (in the log, ``status`` and the model card)."""


# What a phase tells of its progress as it goes: (done, total, what a step is), e.g. (17, 30, "layer").
Progress = Callable[[int, int, str], None]


class Phase(Protocol):
    """Work of the run, in the run's own process, that its merge's units wait for (``--imatrix-texts``: the
    importance matrix a GGUF's encoding reads): the plan records every phase (its ``name`` and ``key``) before any
    starts, then the engine runs each in turn (:mod:`resumerge.merge.engine.phasing`), never asking which it is.
    A phase keeps a journal of its own, so that run again it continues where it stopped, and ends with the same
    bytes."""

    @property
    def name(self) -> str:
        """What ``status`` and ``plan`` call it ("the importance matrix pass over the merge")."""

    @property
    def key(self) -> str:
        """What it computes from, as a digest (a phase's fingerprint: the ledger records it with the plan)."""

    def admit(self, plan: Plan, max_memory: int | None) -> None:
        """Refuse (UsageError, exit 2), before anything is written, what the flags decide it cannot do: a budget
        its step does not fit in, as ``plan`` judges it (:meth:`cost`)."""

    def run(self, progress: Progress, tell: Callable[[str], None]) -> None:
        """Do the phase (nothing where its journal says it was done), telling ``progress`` after each step it made
        durable and ``tell`` what the user must hear; its budget judged already (:meth:`admit`)."""


@dataclass(frozen=True)
class Prepared:
    """A planned run: its ``plan``; the ``inputs`` it was built from (their hub files are fetched by the session;
    None when they are present already, as for a recipe's stages); the ``resources`` its units share (handed to
    them in their context); the work ``beside`` the merge, if any; and the ``kind`` of run that planned it, which
    the ledger records once with the plan (``resume`` and ``status`` ask that kind; a recipe's stages are merges);
    the ``phases`` the run makes, in order, once the plan is recorded and before the merge's units, and how their
    results ``settle`` the plan."""

    plan: Plan
    inputs: Inputs | None = None
    resources: Resources = NO_RESOURCES
    beside: Beside | None = None
    kind: str = "merge"
    phases: tuple[Phase, ...] = ()
    # The plan as its phases' results settle it (``--gguf-target-size``: the types the measured costs choose),
    # asked once they ended: None where it stays as planned (:func:`resumerge.merge.engine.phasing.settle_plan`).
    settle: Callable[[Plan], Prepared | None] | None = None

    def opened(self) -> Inputs:
        """The inputs the plan was built from (a planner always opens them; only a recipe's stage runs without)."""
        if self.inputs is None:
            raise ResumergeError("internal: this plan was prepared without its inputs")
        return self.inputs

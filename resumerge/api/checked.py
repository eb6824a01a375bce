"""``run --check``: the merge, then :func:`resumerge.api.check` of its output, in one call. The outcome carries the
check's report, so the CLI prints it and exits with its verdict's code."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from resumerge.errors import UsageError
from resumerge.merge.engine.drive import Outcome

if TYPE_CHECKING:
    from resumerge.analyses.check import CheckReport
    from resumerge.api.runkind import PathLike
    from resumerge.config.locations import StateDir
    from resumerge.config.passplace import PassPlace

# The kinds whose output is a model made from a base and parents that its record names (an upcycled MoE and a
# LoRA adapter are not compared layer by layer with their inputs).
CHECKABLE = ("merge", "recipe")


@dataclass(frozen=True, repr=False)
class CheckedOutcome(Outcome):
    """A finished run's outcome and the check of its output (``run --check``)."""

    check: CheckReport | None = None


def refuse_check(kind: str, out: PathLike) -> None:
    """Refuse ``--check`` (exit 2, before the run starts) where the output cannot be checked."""
    if kind not in CHECKABLE:
        raise UsageError(f"--check compares a merge with its base and parents; a {kind} run's output is not one",
                         hint="leave out --check")
    if str(out).startswith("hf://"):
        raise UsageError("--check reads the merged model from a local OUT, and this OUT is a hub repo",
                         hint="leave out --check, and run resumerge check on a local copy")


def checked(outcome: Outcome, *, state: StateDir, max_memory: int | None,
            executor: object = None, reporter: object = None) -> CheckedOutcome:
    """``outcome`` with the check of its output (the base and parents from its record), on the run's
    ``executor`` (see :func:`check_placement`); the run's ``reporter`` is told a line per layer of the check (its
    ``message``), as the merge's progress was."""
    from resumerge.analyses.check.job import CheckSettings
    from resumerge.analyses.check.progress import layer_lines
    from resumerge.analyses.check.run import CheckAsked, run_check
    from resumerge.config.locations import StateDir

    say = getattr(reporter, "message", None)
    settings = CheckSettings(state=state, max_memory=max_memory, placement=check_placement(executor),
                             default_state=StateDir.resolve(None))
    report = run_check(CheckAsked(outcome.out_dir), settings, layer_lines(say) if callable(say) else None)
    return CheckedOutcome(**{f.name: getattr(outcome, f.name) for f in fields(Outcome)}, check=report)


def check_placement(executor: object) -> PassPlace:
    """Where a check's forward pass runs for ``executor`` (the object ``run`` takes; None: this process): what the
    executor's :meth:`~resumerge.merge.engine.executors.PlacesPasses.place_pass` says. Raises
    :class:`~resumerge.errors.UsageError` (exit 2) for an executor that places no forward pass, and for one that
    cannot run here (Ray not installed)."""
    from resumerge.config.passplace import HERE

    if executor is None:
        return HERE
    from resumerge.merge.engine.executors import PlacesPasses

    if not isinstance(executor, PlacesPasses):
        raise UsageError(f"a check runs on an executor that places a forward pass (LocalExecutor or RayExecutor), "
                         f"not {executor!r}")
    return executor.place_pass()

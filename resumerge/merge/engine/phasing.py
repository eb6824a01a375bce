"""A run's phases (:class:`~resumerge.merge.plan.prepared.Phase`): the work its merge's units wait for, each a row
of the plan run in turn, then the merge itself, the last phase.

The phases are recorded in the ledger with the plan, before any starts, so a run killed in one is a recorded run:
``resume`` continues it (each phase from its own journal) and ``status`` names the phase and its progress from the
latest phase event. Nothing here asks which phase it runs; a run without phases records none of this (its merge is
all it does, and its ledger reads as it always did).

A run whose plan depends on what a phase found (``--gguf-target-size``: the types the importance pass's costs
choose) is planned first without it, then, once its phases ended, settled (:func:`settle_plan`): the settled plan
recorded in place of the first (nothing of the merge is written yet), and the run goes on as a resume of it
(:class:`Replanned`), so that a kill anywhere leaves a recorded run whose resume writes the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from resumerge.machine.memory import format_size, os_peak_rss
from resumerge.merge.plan.merge_plan import Plan
from resumerge.merge.plan.prepared import Phase, Prepared
from resumerge.merge.store.ledger import Ledger
from resumerge.merge.store.ledger_read import PHASE_EVENT, PHASES_EVENT


def admit_phases(phases: Sequence[Phase], plan: Plan, max_memory: int | None) -> None:
    """Each phase's refusal of what the flags decide (a budget its step does not fit in), before OUT is touched."""
    for phase in phases:
        phase.admit(plan, max_memory)


def record_phases(ledger: Ledger, phases: Sequence[Phase], plan: Plan) -> None:
    """The run's phases, the merge last, recorded in ``ledger`` (none without phases)."""
    if not phases:
        return
    names = [*(p.name for p in phases), merge_name(plan)]
    ledger.event(PHASES_EVENT, "; ".join(names),
                 {"phases": [*({"name": p.name, "key": p.key} for p in phases), {"name": names[-1]}]})


def run_phases(ledger: Ledger, phases: Sequence[Phase], plan: Plan, tell: Callable[[str], None]) -> None:
    """Run every phase in turn, its progress recorded in ``ledger`` as it goes, then record that the merge, the
    last phase, began (nothing without phases)."""
    if not phases:
        return
    of = len(phases) + 1
    for index, phase in enumerate(phases):
        _where(ledger, index, of, phase.name)

        def progress(done: int, total: int, unit: str, *, index: int = index, name: str = phase.name) -> None:
            _where(ledger, index, of, name, (done, total, unit))

        phase.run(progress, tell)
        # its end, with the process's peak so far: what ``plan``'s estimate of the phase is held to
        peak = os_peak_rss()
        ledger.event(PHASE_EVENT, f"{phase.name} (phase {index + 1} of {of}) done, peak {format_size(peak or 0)}",
                     {"index": index, "of": of, "name": phase.name, "ended": True, "peak_bytes": peak})
    _where(ledger, len(phases), of, merge_name(plan))


class Replanned(Exception):  # not an error: the session's signal to go on as a resume
    """The run's plan was settled after its phases and recorded anew: the session continues ``prepared`` as a
    resume (:func:`resumerge.merge.engine.session.run_plan`)."""

    def __init__(self, prepared: Prepared) -> None:
        super().__init__("the plan was settled after its phases")
        self.prepared = prepared


# The ledger's event recording a plan settled after the phases (what it decided, said in its text).
SETTLED_EVENT = "settled"


def settle_plan(ledger: Ledger, prepared: Prepared, record: Callable[[Prepared], None]) -> None:
    """Where ``prepared``'s plan depends on what its phases found (``prepared.settle``), its settled plan: one
    other than the recorded one is recorded by ``record`` (the ledger's run replaced; nothing of the merge written
    yet), its decision kept as an event, and :class:`Replanned` raised for the session to go on with it."""
    if prepared.settle is None:
        return
    settled = prepared.settle(prepared.plan)
    if settled is None or settled.plan.fingerprint == prepared.plan.fingerprint:
        return
    record(settled)
    ledger.set_state("running")
    for note in settled.plan.notes:
        if note.startswith("GGUF types chosen"):
            ledger.event(SETTLED_EVENT, note)
    raise Replanned(replace(settled, phases=prepared.phases, kind=prepared.kind))


def merge_name(plan: Plan) -> str:
    """What the last phase, the merge writing its files, is called."""
    return plan.container.writing


def _where(ledger: Ledger, index: int, of: int, name: str, counts: tuple[int, int, str] | None = None) -> None:
    data: dict[str, object] = {"index": index, "of": of, "name": name}
    text = f"{name} (phase {index + 1} of {of})"
    if counts is not None:
        done, total, unit = counts
        data |= {"done": done, "total": total, "unit": unit}
        text += f": {unit} {done} of {total} done"
    ledger.event(PHASE_EVENT, text, data)

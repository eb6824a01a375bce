"""The end of a run, whatever executed its shards (this process's pipeline, a Ray cluster's nodes): the notes found
while it ran, the side files (the model card, the config's copy) and the sink's last commits; or, for a run stopped
first, one last commit of what the sink already uploaded (:mod:`resumerge.merge.engine.interrupts`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from resumerge.errors import ResumergeError
from resumerge.merge.engine.interrupts import commit_uploaded
from resumerge.merge.engine.reporting import Reporter, Stopped
from resumerge.merge.plan.merge_plan import Plan
from resumerge.merge.plan.sidefiles import aux_files, render_aux

if TYPE_CHECKING:  # the journaling process's (see executor)
    from resumerge.merge.store.journal_commit import CommitJournal


def finish_run(plan: Plan, journal: CommitJournal, reporter: Reporter, done: set[str], *, finished: bool,
               interrupt: KeyboardInterrupt | None, config_text: str, should_stop: Callable[[], bool],
               late_notes: Callable[[], tuple[str, ...]] | None) -> tuple[str, ...]:
    """The end of a run whatever executed its shards: once they are ``finished``, the late notes, the side files
    and the sink's last commits (returns the late notes); otherwise :class:`Stopped` (or the ``interrupt``) after
    one last commit of what the sink already uploaded."""
    ledger = journal.ledger
    try:
        if interrupt is not None:
            raise interrupt
        if not finished:
            raise Stopped()
        late = late_notes() if late_notes is not None else ()
        for note in late:
            ledger.event("plan", note)
            reporter.message(note)
        _write_aux(replace(plan, notes=plan.notes + late) if late else plan, journal, reporter, done, config_text,
                   should_stop)
        waiting = journal.finish()
        if waiting and should_stop():
            raise Stopped()
        if waiting:
            raise ResumergeError(f"internal: the output sink never committed {', '.join(waiting)}")
        return late
    except (Stopped, KeyboardInterrupt):
        commit_uploaded(journal, reporter.message)
        raise


def _write_aux(
    plan: Plan,
    journal: CommitJournal,
    reporter: Reporter,
    done: set[str],
    config_text: str,
    should_stop: Callable[[], bool],
) -> None:
    for aux in aux_files(plan):
        if aux.name in done:
            continue
        if should_stop():
            raise Stopped()
        data = render_aux(plan, aux, config_text)
        journal.write_small(aux.name, data, point=aux.point)
        reporter.file_done(aux.name, aux.kind)

"""``resumerge evolve``'s progress on stderr, drawn as ``check``'s is in a log (:mod:`resumerge.cli.checkprogress`):
a line as the search begins or resumes, one as each generation begins, one per decoder layer of a generation's pass
(the streamed pass of its candidates, or a written candidate's pass of each task) and one per candidate scored, each
with the best objective so far and the time left the search estimates (:mod:`resumerge.runs.evolve.progress`); nothing
with ``--quiet``. A search spread over Ray nodes says its candidates as they are scored; the layers of the nodes'
passes stay in their folders' progress files."""

from __future__ import annotations

from typing import TextIO

from resumerge.cli.render import console, progress_mode
from resumerge.machine.memory.sizes import format_duration
from resumerge.runs.evolve.progress import SearchStep
from resumerge.runs.evolve.status import numbered


class EvolveProgress:
    """Told each :class:`~resumerge.runs.evolve.progress.SearchStep` of a search; prints its line (see the module
    docstring)."""

    def __init__(self, *, quiet: bool = False, stream: TextIO | None = None) -> None:
        self._console = console(stream)
        self.mode = progress_mode(self._console, quiet)
        self._phase: tuple[int, tuple[int, ...], str | None] | None = None  # the last phase said

    def __call__(self, step: SearchStep) -> None:
        if self.mode == "quiet":
            return
        line = self._line(step)
        if line is not None:
            self._console.print(f"evolve: {line}", markup=False, highlight=False, soft_wrap=True)

    def _line(self, step: SearchStep) -> str | None:
        where = f"generation {step.generation} of {step.generations}"
        if step.event == "start":
            if step.resumed:
                return (f"resuming: {step.evaluated} of {step.max_fevals} evaluations done, best objective so far "
                        f"{_number(step.best)}")
            return f"up to {step.max_fevals} evaluations, {step.generations} generation(s)"
        if step.event == "generation":
            return f"{where}: {step.size} candidate(s)"
        who = f"{where}, {numbered(list(step.candidates))} of {step.size}" if step.candidates else where
        if step.event == "scored":
            return (f"{who}: objective {_number(step.objective)}; best so far {_number(step.best)}, "
                    f"{step.evaluated} of {step.max_fevals} evaluations{_left(step)}")
        if step.event == "layer" and step.layer is not None:
            self._phase = (step.generation, step.candidates, step.phase)
            return (f"{who}: {step.phase}, layer {step.layer + 1} of {step.layers}; best so far "
                    f"{_number(step.best)}{_left(step)}")
        said = (step.generation, step.candidates, step.phase)
        # a phase is said once (a streamed pass's planning is said by its layers)
        if step.event != "phase" or step.phase in (None, "plan") or said == self._phase:
            return None
        self._phase = said
        return f"{who}: {step.phase}"


def _number(value: float | None) -> str:
    return "none yet" if value is None else f"{value:.6g}"


def _left(step: SearchStep) -> str:
    return "" if step.seconds_left is None else f", about {format_duration(step.seconds_left)} left"

"""``resumerge check``'s progress on stderr, as ``run`` shows a merge's (:func:`~resumerge.cli.render.progress_mode`):
in a terminal a bar over the steps of the forward pass (one model's decoder layer each) with the model running, the
tokens and the time left; in a log one line per layer; nothing with ``--quiet``. The time left is the pace of the
steps this process ran, so a resumed check does not count the layers its journal held as done in no time."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import MappingProxyType
from typing import TextIO

from resumerge.analyses.check.progress import Step
from resumerge.cli.render import StepBar, console, progress_mode
from resumerge.machine.memory.sizes import format_duration

_PHASES = MappingProxyType({
    "static": "the static pass: every tensor of every model compared", "heads": "the heads: NLL and KL",
    "starting": "starting",
})


class CheckProgress:
    """Told each :class:`~resumerge.analyses.check.progress.Step` of a check; draws it (see the module docstring)."""

    def __init__(self, *, quiet: bool = False, stream: TextIO | None = None, mode: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._console = console(stream)
        self.mode = mode or progress_mode(self._console, quiet)
        self._clock = clock
        self._bar: StepBar | None = None
        self._first: tuple[float, int] | None = None  # when, and at which step, this process's pass began
        self._layer: int | None = None
        self._said: set[str] = set()  # the phases named already (the static pass may come twice: folded)

    def __call__(self, step: Step) -> None:
        if self.mode == "quiet":
            return
        if step.phase == "forward" and step.layer is not None:
            self._forward(step)
        elif step.phase in _PHASES and step.phase not in self._said:
            self._stop()
            self._said.add(step.phase)
            self._console.print(f"check: {_PHASES[step.phase]}", markup=False, highlight=False)
        if step.phase == "done":
            self.close()

    def close(self) -> None:
        """Stop the bar (before the report is printed)."""
        self._stop()

    def _forward(self, step: Step) -> None:
        assert step.layer is not None
        index = step.model_index if step.model_index is not None else 0
        done, total = step.layer * step.models + index, step.layers * step.models
        if self._first is None:
            self._first = (self._clock(), done)
        running = f"{step.role} {step.path}" if step.role is not None else f"{step.models} models on Ray nodes"
        if self.mode == "live":
            if self._bar is None:
                self._bar = StepBar(self._console, "check", total, done)
            self._bar.update(done, f"layer {step.layer + 1}/{step.layers}, model {index + 1}/{step.models}: "
                                   f"{step.role or 'all'}, {step.tokens:,} tokens")
            return
        if step.layer == self._layer:
            return
        self._layer = step.layer
        start, first = self._first
        elapsed, ran = self._clock() - start, done - first
        left = f", about {format_duration(elapsed / ran * (total - done))} left" if ran > 0 and elapsed > 0 else ""
        self._console.print(f"check: layer {step.layer + 1} of {step.layers} ({step.models} models, {step.tokens:,} "
                            f"tokens each; now model {index + 1}: {running}){left}", markup=False,
                            highlight=False, soft_wrap=True)

    def _stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

"""Per-step admission of a pass by the RAM governor: each step of a pass (one model's layer, a client's heads)
is held by a reservation of the bytes found for it beforehand, so the governor sees the process's RSS, gives freed
memory back when a step would not fit, and refuses (exit 2) rather than pass the budget, as for a merge's
tensors."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from resumerge.memory import MemoryGovernor, SystemProbe


class Admission:
    """The :data:`~resumerge.forward.layerpass.Reserve` of a pass under ``budget`` bytes: step ``step`` (a key
    of ``steps``, each its bytes) is admitted by the governor; ``before(what, step)`` is told first (a client's
    progress, a trim of the heap). Use it as a context manager: the governor lives as long as the pass."""

    def __init__(self, budget: int, steps: Mapping[str, int],
                 before: Callable[[str, str], None] | None = None) -> None:
        self.steps, self.before = dict(steps), before
        self.governor = MemoryGovernor(budget, SystemProbe())

    def __call__(self, what: str, step: str) -> AbstractContextManager[object]:
        if self.before is not None:
            self.before(what, step)
        return self.governor.acquire(self.steps[step], what=what)

    def __enter__(self) -> Admission:
        self.governor.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.governor.__exit__(*exc)

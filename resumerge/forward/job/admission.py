"""Per-step admission of a pass by the RAM governor: each step of a pass (one model's layer, a client's heads)
is held by a reservation of the bytes found for it beforehand, so the governor sees the process's RSS, gives freed
memory back when a step would not fit, and refuses (exit 2) rather than pass the budget, as for a merge's
tensors. A pass on a GPU (:mod:`resumerge.forward.engine.device`) holds each step from the GPU's governor too, under its
own budget."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

from resumerge.machine.memory import MemoryGovernor, SystemProbe

if TYPE_CHECKING:
    from resumerge.forward.engine.device import GpuBudget


class Admission:
    """The :data:`~resumerge.forward.job.layerpass.Reserve` of a pass under ``budget`` bytes: step ``step`` (a key
    of ``steps``, each its bytes) is admitted by the governor; ``before(what, step)`` is told first (a client's
    progress, a trim of the heap); ``gpu``: the pass runs on a GPU, each step admitted by that device's governor
    too (:meth:`~resumerge.forward.engine.device.PassDevice.budget`). Use it as a context manager: the governors live as
    long as the pass."""

    def __init__(self, budget: int, steps: Mapping[str, int],
                 before: Callable[[str, str], None] | None = None, gpu: GpuBudget | None = None) -> None:
        self.steps, self.before, self.gpu = dict(steps), before, gpu
        self.governor = MemoryGovernor(budget, SystemProbe())
        self.on_gpu = gpu.governor() if gpu is not None else None

    def __call__(self, what: str, step: str) -> AbstractContextManager[object]:
        if self.before is not None:
            self.before(what, step)
        if self.on_gpu is None:
            return self.governor.acquire(self.steps[step], what=what)
        return self._held(what, step)

    @contextmanager
    def _held(self, what: str, step: str) -> Iterator[None]:
        with ExitStack() as held:
            held.enter_context(self.governor.acquire(self.steps[step], what=what))
            assert self.on_gpu is not None and self.gpu is not None
            held.enter_context(self.on_gpu.acquire(self.gpu.steps.get(step, 0), what=what))
            yield

    def __enter__(self) -> Admission:
        self.governor.__enter__()
        if self.on_gpu is not None:
            self.on_gpu.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.on_gpu is not None:
            self.on_gpu.__exit__(*exc)
        self.governor.__exit__(*exc)

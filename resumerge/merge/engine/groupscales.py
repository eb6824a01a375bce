"""The shared tensor-wide scale of each fused group of output projections (q/k/v, gate/up: grouped by the planner,
:mod:`resumerge.merge.plan.fusedscales`), measured before the group's first member is encoded.

A member's tensor-wide scale is computed from the largest magnitude over the whole merged group, so every member
of the group is merged once to measure it (each as its own unit merges it: the same mode, kernels' threads and
admission), and again when its turn to be encoded comes; only a magnitude is kept between. It is a pure function of
the plan, so a resumed run measures it again, to the bit, for a group whose members it still has to write (as it
computes again every shard it has not committed): nothing more is journaled, and no step holds more than the
largest member's own unit does, so the smallest budget of the plan is unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

from resumerge.inputs.codecs import SharedScale
from resumerge.merge.plan.merge_plan import Plan, TensorPlan


class GroupScales:
    """One run's measured groups: the largest magnitude of each, by its members' names (thread-safe; a group is
    measured once per run, or once per process of a run's cluster, whichever member asks first)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._found: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()

    def scaled(self, tp: TensorPlan, measure: Callable[[TensorPlan], float | None]) -> TensorPlan | None:
        """``tp`` with its group's largest magnitude given to its output codec
        (:meth:`~resumerge.inputs.codecs.SharedScale.scaled`), each member's measured by ``measure`` (its merged
        value's :meth:`~resumerge.inputs.codecs.SharedScale.amax_of`; None: stopped) unless this run measured the
        group already; ``tp`` itself when its codec shares no scale; None when ``measure`` was stopped."""
        codec = tp.out_codec
        if not isinstance(codec, SharedScale) or not codec.group:
            return tp
        with self._lock:
            amax = self._found.get(codec.group)
        if amax is None:
            amax = 0.0
            for name in codec.group:
                found = measure(self.plan.tensors[name])
                if found is None:
                    return None
                amax = max(amax, found)
            with self._lock:
                self._found[codec.group] = amax
        return replace(tp, out_codec=codec.scaled(amax))

"""Consecutive small units of one shard computed as one: one admission, one pool task, one hand-over to the writer.

At 90k tensors of a few hundred bytes each, the per-unit hand-off (the memory governor's admission, the thread
pool's submit and future, the writer's queue) cost about a third of a run's execute phase; a group pays it once for
up to :data:`GROUP_UNITS` tensors. A group changes scheduling only: its tensors are computed in order, each whole as
it would be alone, and written in order, so the bytes, the ledger and a resume are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from resumerge.merge.engine.compute import TensorCompute
from resumerge.merge.methods.registry import MethodSpec
from resumerge.merge.plan.merge_plan import ShardPlan

# The most tensors in one group: a stop request waits for the group in flight (a few milliseconds of tiny tensors
# whose inputs are at hand; longer while a hub input's bytes are still arriving).
GROUP_UNITS = 64
# The most bytes of estimates one group holds: small against any budget a merge runs under, so grouping never
# changes which units fit; a larger unit is a group of its own.
GROUP_BYTES = 4 << 20


def group_bytes(budget: int | None) -> int:
    """The most bytes of estimates one group holds under ``budget`` (None: no memory governor)."""
    return GROUP_BYTES if budget is None else max(1, min(GROUP_BYTES, budget // 16))


def has_room(units: int, held: int, estimate: int, most: int) -> bool:
    """Whether a unit of ``estimate`` bytes joins a group of ``units`` units holding ``held`` bytes of estimates, with
    at most ``most`` bytes in all (:func:`group_bytes`)."""
    return units < GROUP_UNITS and held + estimate <= most


def joins_others(method: MethodSpec, *, whole: bool, sibling: bool) -> bool:
    """Whether a unit may share its group: one computed ``whole`` whose method shares no computation between
    tensors (a unit collecting its ``sibling``'s result, and the sibling, are launched alone)."""
    return whole and not sibling and (method.whole_cost is None or method.whole_cost.shared_by <= 1)


@dataclass
class UnitGroup:
    """Consecutive whole units of ``shard``, admitted with the sum of their estimates, computed in order on one pool
    thread and handed to the writer as one item. ``alone``: it takes no other unit; ``sibling``: its one unit only
    collects its sibling's result (it computes nothing, so the engine does not count it among its working units)."""

    shard: ShardPlan
    alone: bool = False
    sibling: bool = False
    units: list[TensorCompute] = field(default_factory=list)
    estimate: int = 0

    def add(self, unit: TensorCompute, estimate: int) -> None:
        self.units.append(unit)
        self.estimate += estimate

    def takes(self, shard: ShardPlan, estimate: int, most: int) -> bool:
        """Whether a unit of ``shard`` that may share its group, of ``estimate`` bytes, joins this one with at most
        ``most`` bytes of estimates in all."""
        return not self.alone and shard is self.shard and has_room(len(self.units), self.estimate, estimate, most)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(unit.tp.name for unit in self.units)

"""The governor's arithmetic: from one probe reading and the reservations to headroom and pressure.

Usage is accounted as ``projected = max(rss, baseline + reserved)``. ``reserved`` sums the estimates of the
admitted units; ``baseline`` is what the process holds apart from them. Counting ``rss + reserved`` would
charge every unit twice once its tensors exist; counting ``rss`` alone would forget units admitted but not yet
allocated. The budget is not the only ceiling: the machine (or container) may have less left than the budget
assumes, so headroom is the smaller of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Usage", "next_baseline"]


@dataclass(frozen=True)
class Usage:
    """One reading of a memory pool, with the reservations outstanding when it was taken (all in bytes)."""

    budget: int
    rss: int
    available: int
    baseline: int
    reserved: int
    margin_fraction: float

    @property
    def projected(self) -> int:
        """What the process will hold once every admitted unit has allocated its estimate."""
        return max(self.rss, self.baseline + self.reserved)

    @property
    def pending(self) -> int:
        """Admitted bytes not yet resident: they will still come out of ``available``."""
        return self.projected - self.rss

    @property
    def headroom(self) -> int:
        """Bytes a new unit may use: the budget's room and the machine's room, each less the safety margin.

        The machine's margin is scaled to what we can reach (``rss + available``, at most the budget) so that
        a ``--max-memory`` far above the machine's memory does not swallow all of it. May be negative.
        """
        by_budget = self.budget - int(self.budget * self.margin_fraction) - self.projected
        reachable = min(self.budget, self.rss + self.available)
        by_machine = self.available - self.pending - int(reachable * self.margin_fraction)
        return min(by_budget, by_machine)

    @property
    def used_fraction(self) -> float:
        """How full the budget effectively is, between 0 and (rarely) above 1.

        Either our projected use, or the part of the budget the machine can no longer supply
        (``budget − (available − pending)``), whichever is larger: if other processes take memory, we are
        as constrained as if we had used it ourselves.
        """
        left = self.available - self.pending
        return max(self.projected, self.budget - left) / self.budget


def next_baseline(baseline: int, rss: int, reserved: int, in_flight: int) -> int:
    """Return the baseline after a reading of ``rss``.

    With nothing in flight the baseline is the RSS itself. Otherwise the in-flight units account for at most
    ``reserved`` bytes of RSS, so ``rss − reserved`` is a lower bound on everything else (a filling write
    buffer, leftovers glibc has not returned); the baseline rises to it, and never exceeds the RSS.
    """
    if in_flight == 0:
        return rss
    return min(rss, max(baseline, rss - reserved))

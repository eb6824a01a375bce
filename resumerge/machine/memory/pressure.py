"""Pressure levels: how full the budget is, and what the batch knobs are at each level.

The governor turns each memory reading into a *used fraction* of the budget and the fraction into a level:

====== ================= ==================
level  used fraction     tensors in flight
====== ================= ==================
0      below 75 %        ``max_in_flight``
1      75 % – 85 %       half of that
2      85 % – 90 %       1
3      90 % and above    1
====== ================= ==================

Admission itself stops at 95 % (the governor's 5 % safety margin), so the knobs come down while there is
still room to finish the work already admitted. Levels rise at once; they fall one step at a time, and only
after the fraction has stayed ``hysteresis`` below the level's threshold for ``raise_delay`` seconds, so a
batch that frees memory and immediately takes it again does not flap.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Knobs", "PressurePolicy", "PressureTracker"]


@dataclass(frozen=True)
class Knobs:
    """The batch sizes the engine must respect at one moment."""

    in_flight_limit: int


@dataclass(frozen=True)
class PressurePolicy:
    """Thresholds (fractions of the budget, ascending) and the damping used when pressure eases."""

    thresholds: tuple[float, float, float] = (0.75, 0.85, 0.90)
    hysteresis: float = 0.05
    raise_delay: float = 1.0

    def __post_init__(self) -> None:
        low, mid, high = self.thresholds
        if not 0 < low < mid < high <= 1:
            raise ValueError(f"thresholds must ascend within (0, 1]: {self.thresholds}")
        if self.hysteresis < 0 or self.raise_delay < 0:
            raise ValueError("hysteresis and raise_delay must not be negative")

    def level_for(self, used_fraction: float) -> int:
        """Return the level (0–3) whose band contains ``used_fraction``, with no damping."""
        return sum(1 for threshold in self.thresholds if used_fraction >= threshold)

    def knobs_for(self, level: int, max_in_flight: int) -> Knobs:
        """Return the knob values for ``level`` (see the module table); in flight never drops below 1."""
        if level <= 0:
            return Knobs(max_in_flight)
        if level == 1:
            return Knobs(max(1, max_in_flight // 2))
        return Knobs(1)


class PressureTracker:
    """Damped level: follows rises immediately, eases one level per calm ``raise_delay``. Not thread-safe."""

    def __init__(self, policy: PressurePolicy) -> None:
        self.policy = policy
        self.level = 0
        self._calm_since: float | None = None

    def update(self, used_fraction: float, now: float) -> int:
        """Feed one reading taken at ``now`` (monotonic seconds); return the level after it."""
        raw = self.policy.level_for(used_fraction)
        if raw >= self.level:
            self.level = raw
            self._calm_since = None
            return self.level
        # Lower only if the reading would stay below this level's threshold even with the hysteresis added.
        if self.policy.level_for(used_fraction + self.policy.hysteresis) >= self.level:
            self._calm_since = None
            return self.level
        if self._calm_since is None:
            self._calm_since = now
        if now - self._calm_since >= self.policy.raise_delay:
            self.level -= 1
            self._calm_since = now
        return self.level

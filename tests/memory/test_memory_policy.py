"""Pure pieces: pressure levels and damping, usage accounting, default budget and plan-time checks."""

from __future__ import annotations

import pytest

from resumerge.machine.memory import (
    FakeProbe,
    Knobs,
    PressurePolicy,
    Usage,
    default_budget,
    format_size,
    parse_size,
    smallest_budget_for,
)
from resumerge.machine.memory.accounting import next_baseline
from resumerge.machine.memory.pressure import PressureTracker

GB = 10**9
MB = 10**6


@pytest.mark.parametrize(
    ("fraction", "level"), [(0.0, 0), (0.7499, 0), (0.75, 1), (0.849, 1), (0.85, 2), (0.9, 3), (1.7, 3)]
)
def test_levels(fraction: float, level: int) -> None:
    assert PressurePolicy().level_for(fraction) == level


def test_knobs_per_level() -> None:
    policy = PressurePolicy()
    assert [policy.knobs_for(level, 4) for level in range(4)] == [
        Knobs(4),
        Knobs(2),
        Knobs(1),
        Knobs(1),
    ]
    assert policy.knobs_for(1, 1).in_flight_limit == 1  # never below one


@pytest.mark.parametrize(
    "kwargs",
    [{"thresholds": (0.9, 0.85, 0.95)}, {"thresholds": (0.0, 0.5, 0.9)}, {"hysteresis": -0.1}, {"raise_delay": -1}],
)
def test_invalid_policies(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        PressurePolicy(**kwargs)  # type: ignore[arg-type]


def test_tracker_rises_at_once_and_eases_one_step_per_calm_delay() -> None:
    tracker = PressureTracker(PressurePolicy(raise_delay=2.0))
    assert tracker.update(0.95, 0.0) == 3
    assert tracker.update(0.1, 1.0) == 3  # calm starts
    assert tracker.update(0.1, 3.0) == 2
    assert tracker.update(0.1, 4.0) == 2
    assert tracker.update(0.87, 4.5) == 2  # a blip back into level 2 resets the calm clock
    assert tracker.update(0.1, 5.0) == 2
    assert tracker.update(0.1, 7.0) == 1
    assert tracker.update(0.1, 9.0) == 0


def test_usage_accounting() -> None:
    usage = Usage(budget=1000, rss=300, available=5000, baseline=100, reserved=400, margin_fraction=0.05)
    assert usage.projected == 500
    assert usage.pending == 200
    assert usage.headroom == 950 - 500
    assert usage.used_fraction == 0.5
    tight = Usage(budget=1000, rss=300, available=250, baseline=100, reserved=400, margin_fraction=0.05)
    # The machine, not the budget, is short; its margin is 5 % of the 550 bytes we could reach.
    assert tight.headroom == 250 - 200 - 27
    assert tight.used_fraction == (1000 - 50) / 1000


def test_a_budget_far_above_the_machine_keeps_a_proportionate_margin() -> None:
    usage = Usage(budget=10**15, rss=0, available=1000 * MB, baseline=0, reserved=0, margin_fraction=0.05)
    assert usage.headroom == 950 * MB


def test_baseline_follows_rss_when_idle_and_rises_with_unreserved_growth() -> None:
    assert next_baseline(100, 250, 0, 0) == 250
    assert next_baseline(100, 250, 300, 1) == 100  # growth explained by the reservation
    assert next_baseline(100, 700, 300, 1) == 400  # more than the reservation explains
    assert next_baseline(500, 300, 300, 1) == 300  # never above rss


def test_default_budget_is_a_fraction_of_what_we_could_hold() -> None:
    assert default_budget(FakeProbe(rss=1 * GB, available=9 * GB)) == 8 * GB
    assert default_budget(FakeProbe(rss=1 * GB, available=99 * GB, limit=10 * GB)) == 8 * GB
    assert default_budget(FakeProbe(rss=1 * GB, available=9 * GB), fraction=0.5) == 5 * GB
    with pytest.raises(ValueError):
        default_budget(FakeProbe(), fraction=0)


@pytest.mark.parametrize(
    ("unit", "baseline", "expected"),
    [(0, 0, 0), (950, 0, 1000), (3_431_728_394, 0, 3_620_000_000), (1 * GB, 400 * MB, 1_480_000_000)],
)
def test_smallest_budget_rounds_up_to_a_printable_size(unit: int, baseline: int, expected: int) -> None:
    smallest = smallest_budget_for(unit, baseline_bytes=baseline)
    assert smallest == expected
    assert smallest * 0.95 >= unit + baseline
    assert parse_size(format_size(smallest, compact=True)) == smallest

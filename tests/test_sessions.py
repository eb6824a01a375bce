"""``plan --session``: a merge's estimated wall in notebook sessions, and the commits an hf:// OUT gets."""

from __future__ import annotations

import pytest

from resumerge.analyses.estimate.sessions import SessionPlan, hub_commits, parse_duration
from resumerge.config.settings import Batching
from resumerge.errors import UsageError

HOUR = 3600.0


@pytest.mark.parametrize(("text", "seconds"), [("12h", 12 * HOUR), ("90m", 5400.0), ("3600s", HOUR),
                                                ("1.5 hours", 1.5 * HOUR), ("12", 12 * HOUR)])
def test_a_session_length_is_hours_minutes_or_seconds(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0h", "twelve", "12d", "-3h"])
def test_a_bad_session_length_is_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError, match="invalid length"):
        parse_duration(text)


def test_each_session_pays_the_start_up_again() -> None:
    # DeepSeek-V3 x R1 hub to hub at 150/75 MB/s: 1.35 TB down (2.5 h), 673 GB up (2.5 h), compute-bound at 26 h.
    plan = SessionPlan(12 * HOUR, 26 * HOUR, 60.0, "network estimate")
    assert plan.sessions == 3  # 26 h of work in 11.98-hour stretches
    assert SessionPlan(12 * HOUR, 11.9 * HOUR, 60.0, "time estimate").sessions == 1
    assert SessionPlan(12 * HOUR, 24 * HOUR, 60.0, "time estimate").sessions == 3  # the second session's start-up
    assert "3 session(s) of 12.0 h for about 26.0 h" in plan.line()
    assert plan.to_json()["sessions"] == 3


def test_an_unknown_wall_or_a_session_shorter_than_the_start_up_gives_no_count() -> None:
    unknown = SessionPlan(12 * HOUR, None, 60.0, "network estimate")
    assert unknown.sessions is None and "--bandwidth" in unknown.line()
    assert SessionPlan(30.0, HOUR, 60.0, "time estimate").sessions is None


def test_commits_are_one_per_file_until_the_pacing_batches_them() -> None:
    assert hub_commits(0, HOUR) == 0
    assert hub_commits(59, HOUR) == 59  # slower than one a minute: each file its own commit
    # 673 files of 1 GB over 5 h: the burst of 20, then one a minute, and the last.
    assert hub_commits(673, 5 * HOUR) == 20 + 300 + 1
    assert hub_commits(135, 5 * HOUR) == 135  # 5 GB shards: each its own commit
    assert hub_commits(673, None) == 673
    assert hub_commits(100, HOUR, Batching(every=20, interval=60.0)) == 5

"""parse_size / format_size: mergekit's suffixes, binary units, round trips and one-line errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resumerge.errors import UsageError
from resumerge.machine.memory import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("123", 123),
        ("0", 0),
        ("1k", 1_000),
        ("1K", 1_000),
        ("1kB", 1_000),
        ("500M", 500_000_000),
        ("500mb", 500_000_000),
        ("5B", 5_000_000_000),  # mergekit's --out-shard-size: B is billion
        ("5b", 5_000_000_000),
        ("1GB", 1_000_000_000),
        ("1g", 1_000_000_000),
        ("2T", 2_000_000_000_000),
        ("2TB", 2_000_000_000_000),
        ("1KiB", 1024),
        ("1ki", 1024),
        ("3MiB", 3 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("1.5gib", 3 * 2**29),
        ("1TiB", 2**40),
        ("1.1GB", 1_100_000_000),
        (".5k", 500),
        ("2.", 2),
        (" 1 GB ", 1_000_000_000),
        ("0.0005k", 0),  # rounds down to whole bytes
        ("999 bytes", 999),
        ("1PB", 10**15),
        ("1PiB", 2**50),
    ],
)
def test_parse_size_accepts(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_parse_size_takes_ints_as_bytes() -> None:
    assert parse_size(4096) == 4096


@pytest.mark.parametrize(
    "bad", ["", " ", "abc", "GB", "1.2.3", "-5", "-1GB", "1e9", "1 XB", "1 G B", "1_000", "inf", "nan", "١٢"]
)
def test_parse_size_rejects_with_one_line(bad: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_size(bad, option="--max-memory")
    line = info.value.one_line()
    assert "\n" not in line
    assert line.startswith("--max-memory: invalid size")
    assert "GiB" in line  # the hint shows the accepted forms


@pytest.mark.parametrize("bad", [-1, True, 1.5, None])
def test_parse_size_rejects_non_sizes(bad: object) -> None:
    with pytest.raises(UsageError):
        parse_size(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 bytes"),
        (999, "999 bytes"),  # never "999 B": parse_size reads B as billion
        (1000, "1.00 kB"),
        (1_740_000_000, "1.74 GB"),
        (17_400_000_000, "17.4 GB"),
        (512_000_000, "512 MB"),
        (9_996, "10.0 kB"),
        (99_960, "100 kB"),
        (999_700_000, "1.00 GB"),
        (-5_000_000, "-5.00 MB"),
        (3 * 10**18, "3000 PB"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


def test_format_size_compact_is_pasteable() -> None:
    assert format_size(1_740_000_000, compact=True) == "1.74GB"
    assert parse_size(format_size(1_740_000_000, compact=True)) == 1_740_000_000
    assert format_size(999, compact=True) == "999"


@given(st.integers(min_value=0, max_value=10**16), st.booleans())
def test_round_trip_within_half_a_percent(n: int, compact: bool) -> None:
    back = parse_size(format_size(n, compact=compact))
    assert abs(back - n) <= n * 0.005 + 1

"""A node's fetch cache of streamed ranges (:mod:`resumerge.inputs.hub.fetchcache`): a byte is fetched from the hub
once per node, whatever ranges later reads ask for, by this process or another of the node; past its limit the
oldest pieces go."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import cast

import pytest

from resumerge.inputs.hub.fetchcache import FetchCache, private_root
from resumerge.inputs.hub.ranges import RangeClient
from resumerge.merge.engine.cluster.hubreads import NodeReads

DATA = os.urandom(1000)


class _Hub:
    """A range client over ``DATA`` that records what it was asked."""

    repo_id, commit, filename, size = "org/a", "0" * 40, "model.safetensors", len(DATA)

    def __init__(self) -> None:
        self.asked: list[tuple[int, int]] = []

    def read(self, start: int, end: int) -> bytearray:
        self.asked.append((start, end))
        return bytearray(DATA[start:end])


def test_only_the_bytes_no_piece_holds_are_fetched(tmp_path: Path) -> None:
    hub = _Hub()
    ranges = FetchCache(tmp_path / "cache", limit=10**6).reader(cast(RangeClient, hub))
    assert ranges.read(100, 200) == DATA[100:200]
    assert ranges.read(300, 400) == DATA[300:400]
    assert ranges.read(150, 350) == DATA[150:350]  # within, between and within two pieces
    assert ranges.read(0, 1000) == DATA
    assert hub.asked == [(100, 200), (300, 400), (200, 300), (0, 100), (400, 1000)]
    # Another process of the node (a cache opened on the same folder) finds the pieces: nothing is fetched.
    other = _Hub()
    assert FetchCache(tmp_path / "cache", limit=10**6).reader(cast(RangeClient, other)).read(0, 1000) == DATA
    assert other.asked == []


def test_past_its_limit_the_cache_forgets_its_oldest_pieces(tmp_path: Path) -> None:
    hub = _Hub()
    cache = FetchCache(tmp_path / "cache", limit=250)
    ranges = cache.reader(cast(RangeClient, hub))
    for start in (0, 100, 200):
        ranges.read(start, start + 100)
    assert ranges.read(100, 300) == DATA[100:300] and len(hub.asked) == 3  # the last two are kept
    assert ranges.read(0, 20) == DATA[:20]  # the first one went: fetched again
    assert hub.asked[3:] == [(0, 20)]
    assert ranges.read(500, 800) == DATA[500:800]  # larger than the limit: read, never kept
    assert not any(p.name.startswith("500-") for p in next((tmp_path / "cache").iterdir()).iterdir())
    cache.clear()
    assert not (tmp_path / "cache").exists()


def test_a_piece_that_cannot_be_kept_still_returns_its_bytes(tmp_path: Path) -> None:
    """Another worker of the node ending clears the shared folder; a read racing it (here: the cache's root is a
    file, so nothing can be kept under it) gets its fetched bytes all the same, and keeps nothing."""
    root = tmp_path / "cache"
    root.write_bytes(b"")  # the folder cannot be made
    hub = _Hub()
    ranges = FetchCache(root, limit=10**6).reader(cast(RangeClient, hub))
    assert ranges.read(10, 90) == DATA[10:90]
    assert ranges.read(10, 90) == DATA[10:90]
    assert hub.asked == [(10, 90), (10, 90)]  # nothing was kept, so it is fetched again


def test_the_cache_folder_is_one_only_this_user_may_enter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces are trusted as fetched bytes and hold private repos' bytes: the shared temp folder's cache folder is
    made 0700, and one another user could enter (or plant pieces in) is never used."""
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    root = private_root("run-node")
    assert root.parent == tmp_path / f"resumerge-fetch-{os.getuid()}"
    assert stat.S_IMODE(os.stat(root.parent).st_mode) == 0o700
    root.parent.chmod(0o755)  # as if someone had made it open first
    elsewhere = private_root("run-node")
    assert elsewhere.parent != root.parent and stat.S_IMODE(os.stat(elsewhere.parent).st_mode) == 0o700


def test_a_nodes_workers_split_its_cache_limit() -> None:
    reads = NodeReads(files=(), token=False, cache="c", limit=10_000, staged=1_000)
    assert reads.shared_by(1) == reads
    assert reads.shared_by(4).limit == (10_000 - 3 * 1_000) // 4  # each counts its own pieces; 3 more shards staged
    assert NodeReads(files=(), token=False, cache="c", limit=100, staged=1_000).shared_by(2).limit == 0

"""A hub file downloaded in the process that read its header by range starts from the bytes that read brought: they
are written to the partial file first and hashed with the rest, and only the rest is asked for (``Range: bytes=N-``).
A download whose checksum then fails is fetched again from its first byte (the prefix may be what was wrong), also
when the merge already read from it: the verified file lands in the cache and the header check, or the landing,
says what went wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from hub.conftest import REPO, Model
from hub.fakehub import FakeHub, iter_requests
from hub.test_hub_header_check import swapped
from resumerge.config.modelref import ModelRef
from resumerge.inputs.hub import HubEvent, HubUnavailableError, RepoMetadata, fetch_weights, resolve_metadata
from resumerge.inputs.hub.cache import RepoCache
from resumerge.inputs.hub.fetch import land_file
from resumerge.inputs.hub.headercheck import HubHeaderChanged, known_prefix
from resumerge.inputs.hub.landing import Landing
from resumerge.inputs.hub.records import VerifyRecords


def _gets(hub: FakeHub, shard: str) -> list[str | None]:
    return [r.range for r in iter_requests(hub, "GET") if r.path.endswith(shard)]


def _alike_shard(model: Model) -> str:
    for shard in model.shards:
        try:
            swapped(model.files[shard])
        except LookupError:
            continue
        return shard
    raise AssertionError("no shard with two tensors alike")


def test_a_download_asks_only_for_the_bytes_past_the_header_read_by_range(
        hub: FakeHub, models: tuple[Model, Model], state: Path) -> None:
    model, shard = models[0], models[0].shards[0]
    meta = resolve_metadata(ModelRef(REPO), records_dir=state)
    head = model.header_bytes(shard)
    assert known_prefix(meta.headers[shard]) == model.files[shard][:head]
    hub.reset_counters()
    paths = fetch_weights(meta, [shard], records_dir=state)
    assert paths[shard].read_bytes() == model.files[shard]
    assert hub.file_bytes() == {f"{REPO}/{shard}": len(model.files[shard]) - head}
    assert _gets(hub, shard) == [f"bytes={head}-"]


def test_a_prefix_that_is_not_the_file_s_is_dropped_and_the_file_fetched_whole(
        hub: FakeHub, models: tuple[Model, Model], state: Path) -> None:
    model = models[0]
    shard = _alike_shard(model)
    size, head = len(model.files[shard]), model.header_bytes(shard)
    hub.ranges_from[f"{REPO}/{shard}"] = swapped(model.files[shard])  # ranges served from a stale object
    meta = resolve_metadata(ModelRef(REPO), records_dir=state)
    hub.reset_counters()
    events: list[HubEvent] = []
    with pytest.raises(HubHeaderChanged):
        fetch_weights(meta, [shard], records_dir=state, on_progress=events.append)
    # The seeded attempt (the stale header, then the rest) fails the checksum; the file is fetched whole, verified,
    # and kept in the cache, and the header check names the difference.
    assert _gets(hub, shard) == [f"bytes={head}-", None]
    assert hub.file_bytes() == {f"{REPO}/{shard}": size - head + size}
    assert [e.filename for e in events if e.kind == "refetch"] == [shard]
    assert (meta.snapshot_dir / shard).read_bytes() == model.files[shard]


class _ReadAtOnce(Landing):
    """A landing whose merge reads the first bytes as soon as they are there: the seeded prefix, before a byte of
    the rest arrived (what a merge reading a GGUF's first tensors from its read-ahead does)."""

    def opened(self, fileno: int, have: int) -> None:
        super().opened(fileno, have)
        if have and not self.consumed:
            assert len(self.read(0, 8).numpy()) == 8


def _land(meta: RepoMetadata, shard: str, state: Path, landing: Landing) -> None:
    with VerifyRecords(state) as records:
        land_file(meta.settings, RepoCache(meta.settings.cache_dir, meta.repo_id), meta.commit, meta.files[shard],
                  records, lambda _: None, landing, meta.headers[shard])


def test_a_prefix_not_the_file_s_after_the_merge_read_from_it_still_names_the_header(
        hub: FakeHub, models: tuple[Model, Model], state: Path) -> None:
    model = models[0]
    shard = _alike_shard(model)
    stale = hub.ranges_from[f"{REPO}/{shard}"] = swapped(model.files[shard])
    meta = resolve_metadata(ModelRef(REPO), records_dir=state)
    landing = _ReadAtOnce(shard, len(model.files[shard]))
    with pytest.raises(HubHeaderChanged):  # not "the bytes fail the checksum": a rerun then plans from the cache
        _land(meta, shard, state, landing)
    assert landing.consumed and not landing.verified
    head = model.header_bytes(shard)
    assert bytes(landing.read(0, head).numpy()) == stale[:head] != model.files[shard][:head], \
        "the readers were given no byte of the second attempt"
    assert (meta.snapshot_dir / shard).read_bytes() == model.files[shard]
    landing.close()


def test_a_seeded_download_whose_rest_is_bad_after_the_merge_read_from_it_fails_its_landing(
        hub: FakeHub, models: tuple[Model, Model], state: Path) -> None:
    model, shard = models[0], models[0].shards[0]
    data = model.files[shard]
    hub.ranges_from[f"{REPO}/{shard}"] = data[:-1] + bytes([data[-1] ^ 0xFF])  # the header right, a tensor not
    meta = resolve_metadata(ModelRef(REPO), records_dir=state)
    landing = _ReadAtOnce(shard, len(data))
    _land(meta, shard, state, landing)  # the file is fetched whole, verified and cached
    assert (meta.snapshot_dir / shard).read_bytes() == data
    with pytest.raises(HubUnavailableError, match="fail the hub's checksum"):
        landing.checked(0.01)
    assert not landing.verified
    landing.close()

"""``--max-disk``: staged, uncommitted output stays under the budget on a merge whose output is 10× larger."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from hub.fakehub_write import HubWriter

from hubout.conftest import Merge, repo_files
from resumerge import api
from resumerge.config.locations import run_dir
from resumerge.config.settings import Batching
from resumerge.errors import UsageError
from tests.support import as_on_the_hub, sampled_sizes

SHARD = "1k"  # one tensor per shard: the largest is the 8 KiB embedding
BUDGET = 9_000


def test_max_disk_holds_on_an_output_ten_times_larger(hub: HubWriter, merge: Merge, tmp_path: Path) -> None:
    local = tmp_path / "local"
    api.run(merge.config, local, settings=api.Settings(state_dir=tmp_path / "ls",
                                                       output=api.Output(out_shard_size=SHARD)))
    output = sum(p.stat().st_size for p in local.iterdir())
    assert output >= 10 * BUDGET
    state = tmp_path / "state"
    with sampled_sizes(run_dir("hf://alice/small", state) / "staging") as peaks:
        api.run(merge.config, "hf://alice/small", settings=api.Settings(state_dir=state,
                                                                        output=api.Output(out_shard_size=SHARD),
                                                                        resources=api.Resources(max_disk=BUDGET),
                                                                        hub=api.Hub(commit_every=50,
                                                                                    commit_interval=0.05)))
    assert repo_files(hub, "alice/small") == as_on_the_hub({p.name: p.read_bytes() for p in local.iterdir()})
    print(f"output {output} bytes, staging peak {max(peaks)} bytes, budget {BUDGET}, "
          f"{hub.commits['alice/small']} commits, {len(peaks)} samples")
    assert 0 < max(peaks) <= BUDGET


def test_a_budget_below_the_largest_shard_is_refused(hub: HubWriter, merge: Merge, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="smaller than the largest output shard"):
        api.run(merge.config, "hf://alice/tiny", settings=api.Settings(state_dir=tmp_path,
                                                                       output=api.Output(out_shard_size=SHARD),
                                                                       resources=api.Resources(max_disk=1000)))


def test_commits_are_paced_under_the_hourly_limit(hub: HubWriter, monkeypatch: pytest.MonkeyPatch) -> None:
    from resumerge.config.hubtarget import parse_hub_target
    from resumerge.merge.store import hubcommits, hubretry
    from resumerge.merge.store.hubrepo import open_hub_repo

    clock = [1000.0]
    monkeypatch.setattr(hubcommits.time, "monotonic", lambda: clock[0])
    queue = hubcommits.CommitQueue(open_hub_repo(parse_hub_target("hf://alice/paced")),
                                   Batching(hourly=2), resume="resumerge resume hf://alice/paced")
    try:
        queue.set_manifest(b"1")
        queue.set_manifest(b"2")
        third = threading.Thread(target=queue.set_manifest, args=(b"3",))
        third.start()
        third.join(timeout=0.5)
        assert third.is_alive() and hub.commits["alice/paced"] == 2  # a third commit within the hour waits
        clock[0] += hubretry.WINDOW
        queue._notify()  # the window moved: wake the waiting commit
        third.join(timeout=10)
        assert not third.is_alive() and hub.commits["alice/paced"] == 3
    finally:
        queue.close()

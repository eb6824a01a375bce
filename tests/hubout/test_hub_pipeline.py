"""Hub to hub as one pipeline (issue 27): input bytes are merged as they land, shards are uploaded and committed
while later inputs still download, the repo equals a local run byte for byte, and a SIGKILL mid-pipeline resumed
on a fresh machine ends identical with no object sent twice."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from hub.fakehub import files_of
from hub.fakehub_link import Link
from hub.fakehub_write import HubWriter

from hubout.conftest import repo_files, uploads
from resumerge import api
from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.settings import Batching
from resumerge.inputs.hub import landing
from resumerge.merge.engine import cpupriority
from resumerge.merge.store import shardwriter
from resumerge.merge.store.hubretry import WINDOW, pace_wait
from tests.support import as_on_the_hub, cli_start, linear_config, write_config

# Several weight files per input (about one decoder layer each), so downloads, merge and uploads can overlap.
SPEC = ModelSpec(layers=4, hidden=64, intermediate=96, vocab=128, shard_bytes=150_000)
A, B = "org/pipe-a", "org/pipe-b"
SHARD = "100k"
HELD_TENSOR = "model.layers.2.self_attn.q_proj.weight"  # its file is neither the embeddings' nor lm_head's


# The link test's models: about 6.8 MB each in 12 weight files, through 4 MB/s down and 2 MB/s up, so the link
# floor, max(13.6 MB down, 6.8 MB up), is 3.4 s and three phases in a row would take twice that.
LINKED = ModelSpec(layers=8, hidden=128, intermediate=384, vocab=512, shard_bytes=600_000)
DOWN, UP = 4e6, 2e6
LINKED_SHARD = "800k"


@dataclass(frozen=True)
class Inputs:
    """Two models (as local folders), the config naming them as hub ids, and the files of a local run of it."""

    dirs: dict[str, Path]
    config: Path
    reference: dict[str, bytes]


def _inputs(root: Path, spec: ModelSpec, shard: str) -> Inputs:
    dirs = {A: make_model(root / "a", spec, seed=11), B: make_model(root / "b", spec, seed=12)}
    local = root / "local-out"
    api.run(write_config(root / "local.yml", linear_config(dirs[A], dirs[B])), local,
            settings=api.Settings(state_dir=root / "state", output=api.Output(out_shard_size=shard)))
    reference = {p.name: p.read_bytes() for p in sorted(local.iterdir()) if p.is_file()}
    return Inputs(dirs, write_config(root / "hub.yml", linear_config(Path(A), Path(B))), reference)


@pytest.fixture(scope="session")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    return _inputs(tmp_path_factory.mktemp("pipeline"), SPEC, SHARD)


@pytest.fixture(scope="session")
def linked(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    return _inputs(tmp_path_factory.mktemp("linked"), LINKED, LINKED_SHARD)


def _weights(files: dict[str, bytes]) -> dict[str, bytes]:
    """The shards, index and config.json: the card and mergekit_config.yml name the models as the config does."""
    return {k: v for k, v in files.items() if k.endswith((".safetensors", ".index.json", "config.json"))}


def _push_holding(hub: HubWriter, inputs: Inputs) -> tuple[str, int, threading.Event]:
    """Push the inputs and hold back the second half of ``A``'s middle weight file (the one holding
    ``HELD_TENSOR``) until the returned event is set; returns the file's key on the hub and its size."""
    _push(hub, inputs)
    index = json.loads((inputs.dirs[A] / "model.safetensors.index.json").read_text())["weight_map"]
    held = index[HELD_TENSOR]
    assert held not in (index["model.embed_tokens.weight"], index["lm_head.weight"])
    size = (inputs.dirs[A] / held).stat().st_size
    release = threading.Event()
    hub.hub.hold_after[f"{A}/{held}"] = (size // 2, release)
    return f"{A}/{held}", size, release


def _push(hub: HubWriter, inputs: Inputs) -> None:
    for repo, directory in inputs.dirs.items():
        hub.hub.push(repo, files_of(directory))


def _committed_shards(hub: HubWriter, repo: str) -> list[str]:
    try:
        return [k for k in repo_files(hub, repo) if k.endswith(".safetensors")]
    except KeyError:  # the repo does not exist yet
        return []


def _wait(condition: object, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_hub_to_hub_through_a_throttled_link_overlaps_both_directions(hub: HubWriter, linked: Inputs,
                                                                     tmp_path: Path) -> None:
    """Behind a 4 MB/s down, 2 MB/s up link, the first commit holding a shard lands before the last input byte is
    served (today's default downloaded every input first), the repo equals a local run, and the wall time stays
    within a generous bound of the link floor (a guard against a pipeline that went serial or stalls; the figures
    themselves are the bench's)."""
    _push(hub, linked)
    hub.hub.link = Link(down=DOWN, up=UP)
    hub.hub.reset_counters()
    started = time.monotonic()
    api.run(linked.config, "hf://alice/linked", settings=api.Settings(state_dir=tmp_path / "state",
                                                                      output=api.Output(out_shard_size=LINKED_SHARD)))
    wall = time.monotonic() - started
    files = repo_files(hub, "alice/linked")
    assert _weights(files) == _weights(linked.reference)
    last_in = max(t for key, t in hub.hub.served_at.items() if key.startswith((A, B)) and key.endswith(".safetensors"))
    commits = [t for repo, t in hub.hub.commit_times if repo == "alice/linked"]
    # The first commit only marks the repo as resumerge's (the manifest); the second is the first holding shards.
    assert len(commits) >= 3 and commits[1] < last_in, (commits, last_in)
    inputs_bytes = sum((d / f).stat().st_size for d in linked.dirs.values() for f in os.listdir(d)
                       if f.endswith(".safetensors"))
    floor = max(inputs_bytes / DOWN, sum(len(v) for v in files.values()) / UP)
    print(f"hub to hub: {wall:.1f} s, link floor {floor:.1f} s, first shard commit {last_in - commits[1]:.1f} s "
          "before the last input byte")
    assert wall < 4 * floor + 30, (wall, floor)
    assert all(v == 1 for v in uploads(hub, "alice/linked").values())


def test_a_merge_that_outruns_its_upload_keeps_the_commit_pacing(hub: HubWriter, linked: Inputs,
                                                                  tmp_path: Path) -> None:
    """Local inputs to an hf:// OUT through a 2 MB/s uplink: the merge ends long before its uploads do. The files
    still uploading then are paced like the run's others (the first ``burst`` commits at once, then one a minute
    at most) and the last ones go in one commit once all are uploaded; before, every file whose upload finished
    after the merge got a commit of its own (about one per file, here 60-odd against the hub's 128 an hour). The
    repo equals a local run's."""
    config = write_config(tmp_path / "local-in.yml", linear_config(linked.dirs[A], linked.dirs[B]))
    local = tmp_path / "local-out"
    api.run(config, local, settings=api.Settings(state_dir=tmp_path / "local-state",
                                                 output=api.Output(out_shard_size="100k")))
    shards = [p for p in local.iterdir() if p.name.endswith(".safetensors")]
    assert len(shards) > 2 * Batching.pipelined().burst
    hub.hub.link = Link(up=UP)
    api.run(config, "hf://alice/outrun", settings=api.Settings(state_dir=tmp_path / "state",
                                                               output=api.Output(out_shard_size="100k")))
    files = repo_files(hub, "alice/outrun")
    assert _weights(files) == _weights({p.name: p.read_bytes() for p in local.iterdir() if p.is_file()})
    # The burst, the last commit, and the two manifest-only commits (the first, which marks the repo, and "done").
    assert hub.commits["alice/outrun"] <= Batching.pipelined().burst + 3, hub.commits["alice/outrun"]


def test_shards_are_committed_while_inputs_still_download(hub: HubWriter, inputs: Inputs, tmp_path: Path) -> None:
    """The hub holds back the second half of one of ``A``'s middle weight files: by then the shards that do not
    read it are merged, uploaded and committed (the engine before issue 27 downloaded every input first, so it
    committed nothing while an input was incomplete). Released, the run ends with the repo a local run writes,
    every object PUT once."""
    held, size, release = _push_holding(hub, inputs)
    errors: list[BaseException] = []

    def merge() -> None:
        try:
            api.run(inputs.config, "hf://alice/pipe", settings=api.Settings(state_dir=tmp_path / "state",
                                                                            output=api.Output(out_shard_size=SHARD)))
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=merge)
    worker.start()
    try:
        assert _wait(lambda: _committed_shards(hub, "alice/pipe"), 20), "no shard committed while an input downloaded"
        assert hub.hub.served[held] < size
    finally:
        release.set()
        worker.join(60)
    assert not errors, errors
    files = repo_files(hub, "alice/pipe")
    assert _weights(files) == _weights(inputs.reference)
    assert all(v == 1 for v in uploads(hub, "alice/pipe").values())


def test_a_sigkill_mid_pipeline_resumes_on_a_fresh_machine(hub: HubWriter, inputs: Inputs, tmp_path: Path,
                                                           hf_env: Path) -> None:
    """Killed while shards are committed and an input still downloads; resumed with a new state dir and an empty HF
    cache: the repo ends equal to a local run (and to a hub-input run into a local folder, card included), and no
    object was PUT twice."""
    release = _push_holding(hub, inputs)[2]
    state, out = tmp_path / "state", "hf://alice/killed"
    proc = cli_start("run", inputs.config, out, "--state-dir", state, "--out-shard-size", SHARD, "--quiet")
    try:
        assert _wait(lambda: _committed_shards(hub, "alice/killed"), 60), "no shard committed before the kill"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
        release.set()
    committed = _committed_shards(hub, "alice/killed")
    assert 0 < len(committed) < sum(1 for k in inputs.reference if k.endswith(".safetensors"))
    shutil.rmtree(state)
    shutil.rmtree(hf_env, ignore_errors=True)
    api.resume(out, settings=api.Settings(state_dir=tmp_path / "fresh"))
    files = repo_files(hub, "alice/killed")
    assert _weights(files) == _weights(inputs.reference)
    assert all(v == 1 for v in uploads(hub, "alice/killed").values()), uploads(hub, "alice/killed")
    local = tmp_path / "hub-inputs-local"
    api.run(inputs.config, local, settings=api.Settings(state_dir=tmp_path / "local-state",
                                                        output=api.Output(out_shard_size=SHARD)))
    assert files == as_on_the_hub({p.name: p.read_bytes() for p in local.iterdir() if p.is_file()})


def test_plan_shows_the_default_fetch_and_the_hub_shard_size(hub: HubWriter, inputs: Inputs, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    _push(hub, inputs)
    assert main(["plan", str(inputs.config), "hf://alice/planned", "--state-dir", str(tmp_path / "s")]) == 0
    shown = capsys.readouterr().out
    assert "fetch" in shown and "into the HF cache in the order the merge reads them" in shown, shown
    assert "25.0 MB each (the default for an hf:// OUT: about 1/100 of the output" in shown, shown
    assert main(["plan", str(inputs.config), str(tmp_path / "local"), "--state-dir", str(tmp_path / "s")]) == 0
    shown = capsys.readouterr().out
    assert "1.00 GB each (the default for a local OUT)" in shown, shown
    assert main(["plan", str(inputs.config), "hf://alice/planned", "--out-shard-size", "50k", "--state-dir",
                 str(tmp_path / "s")]) == 0
    assert "shards" not in [line.split(":")[0].strip() for line in capsys.readouterr().out.splitlines()]


def test_the_default_commits_each_file_at_once_then_stays_well_under_the_hourly_quota() -> None:
    """``Batching.pipelined`` on a simulated clock: a file uploaded every 2 s for two hours. The first 20 files are
    committed as they come (a short merge commits every shard at once); after that commits are a minute apart, each
    holding what was uploaded meanwhile, so no hour holds more than 80 (the hub refuses past 128)."""
    batching = Batching.pipelined()
    recent: deque[float] = deque()
    commits: list[float] = []
    for i in range(3600):
        clock = 2.0 * i
        if pace_wait(recent, clock, len(recent) + 1, burst=batching.burst, spacing=batching.spacing) > 0:
            continue  # this file waits for the next commit
        recent.append(clock)
        commits.append(clock)
    assert commits[:20] == [2.0 * i for i in range(20)]
    assert all(b - a >= batching.spacing for a, b in pairwise(commits[19:]))
    assert max(sum(1 for u in commits if t <= u < t + WINDOW) for t in commits) <= 80


def test_the_compute_threads_yield_the_cpu_to_the_transfers_in_a_hub_run_only(
        hub: HubWriter, inputs: Inputs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A linear run that downloads and uploads lowers its merge and writer threads' priority
    (resumerge.merge.engine.cpupriority), every download keeps the run's own, and so does the process's hashing thread,
    which outlives the run (started by the yielding writer, it would hash a later local run's shards at the lower
    priority); a local run of the same config, and a TIES run to the hub (its merge may be what bounds the run),
    change no priority."""
    _push(hub, inputs)
    monkeypatch.setattr(shardwriter, "_HASHER", None)  # this test's run starts the hashing thread
    yielded: list[str] = []
    real = cpupriority.yield_to_transfers

    def spy() -> None:
        yielded.append(threading.current_thread().name)
        real()

    monkeypatch.setattr(cpupriority, "yield_to_transfers", spy)
    downloads: list[int] = []
    land = landing.land_file

    def noted(*args: Any, **kwargs: Any) -> Path:
        downloads.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return land(*args, **kwargs)

    monkeypatch.setattr(landing, "land_file", noted)
    api.run(inputs.config, "hf://alice/yields", settings=api.Settings(state_dir=tmp_path / "state",
                                                                      output=api.Output(out_shard_size=SHARD)))
    assert "resumerge-writer" in yielded and any(n.startswith("resumerge-merge") for n in yielded), yielded
    ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert downloads and set(downloads) == {ours}
    pool = shardwriter._HASHER
    assert pool is not None
    hashing = [os.getpriority(os.PRIO_PROCESS, t.native_id) for t in pool._threads if t.native_id is not None]
    pool.shutdown()
    assert hashing == [ours]
    monkeypatch.setattr(shardwriter, "_HASHER", None)
    yielded.clear()
    local = write_config(tmp_path / "local.yml", linear_config(*inputs.dirs.values()))
    api.run(local, tmp_path / "local-out", settings=api.Settings(state_dir=tmp_path / "local-state",
                                                                 output=api.Output(out_shard_size=SHARD)))
    assert yielded == []
    ties = tmp_path / "ties.yml"
    ties.write_text(f"merge_method: ties\nbase_model: {A}\nmodels:\n  - model: {B}\n"
                    "    parameters: {weight: 0.5, density: 0.5}\n")
    api.run(ties, "hf://alice/ties-keeps", settings=api.Settings(state_dir=tmp_path / "ties-state",
                                                                 output=api.Output(out_shard_size=SHARD)))
    assert yielded == [] and downloads

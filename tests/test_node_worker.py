"""A cluster node's worker (``merge/engine/cluster/worker.py``) without Ray: the shards fed to it, side by side as Ray's
threaded actor calls them, come out as the local executor writes them; a failing shard fails every waiting call
with its error; a stopped worker leaves no temp file and refuses what is fed after; a worker started warm (without
the plan) computes what was fed once begun, and fails it with the error of a begin that raised.

The Ray executor's checks on a real cluster are in ``tests/test_ray_executor.py``."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import digests, ties_of_three

from resumerge import api
from resumerge.cli.modelgen import ModelSpec
from resumerge.config.merge_config import load_config_text
from resumerge.errors import StorageError
from resumerge.merge.engine.cluster.worker import ShardStream, WorkerSetup
from resumerge.merge.engine.executor import Stopped
from resumerge.merge.engine.session import prepare
from resumerge.merge.plan.merge_plan import PlanOptions
from resumerge.merge.plan.prepared import Prepared
from resumerge.merge.plan.workorder import compute_order

SHARD = 10_000


@dataclass(frozen=True)
class Merge:
    """A TIES merge of tiny models, planned, with the local executor's bytes."""

    root: Path
    prepared: Prepared
    reference: dict[str, str]


@pytest.fixture(scope="module")
def merge(tmp_path_factory: pytest.TempPathFactory) -> Merge:
    root = tmp_path_factory.mktemp("node")
    config = ties_of_three(root, ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64))
    api.run(config, root / "local", settings=api.Settings(state_dir=root / "state",
                                                          output=api.Output(out_shard_size=SHARD)))
    prepared = prepare(load_config_text(config.read_text()), PlanOptions(out_shard_size=SHARD))
    return Merge(root, prepared, digests(root / "local"))


def _worker(merge: Merge) -> ShardStream:
    return ShardStream((merge.prepared.plan, merge.prepared.resources), WorkerSetup(threads=2))


def test_shards_fed_side_by_side_come_out_as_the_local_run_writes_them(merge: Merge, tmp_path: Path) -> None:
    worker = _worker(merge)
    names = [shard.name for shard in compute_order(merge.prepared.plan)]
    assert len(names) >= 6
    with ThreadPoolExecutor(3) as calls:  # Ray's threaded actor: the driver keeps two fed, and a stop may come
        done = list(calls.map(lambda name: worker.compute(name, str(tmp_path)), names))
    worker.stop()
    assert [d.shard for d in done] == names
    for d in done:
        written = Path(d.temp).read_bytes()
        assert hashlib.sha256(written).hexdigest() == d.sha256 == merge.reference[d.shard]
        assert d.size == len(written) and d.tensors == merge.prepared.plan.shards[
            [s.name for s in merge.prepared.plan.shards].index(d.shard)].tensors
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(Path(d.temp).name for d in done)
    with pytest.raises(Stopped):
        worker.compute(names[0], str(tmp_path))


def test_a_warm_worker_computes_once_begun_and_a_failed_begin_fails_what_was_fed(merge: Merge, tmp_path: Path) -> None:
    # Started warm (no plan nor setup yet, as a warm start places it), a worker holds what is fed until begin
    # gives it both; a begin that raises fails what was fed with its error (it never waits), and a stop ends a wait
    # for a begin that never came.
    plan, name = merge.prepared.plan, compute_order(merge.prepared.plan)[0].name
    with ThreadPoolExecutor(2) as calls:
        warm = ShardStream(None, None)
        waiting = calls.submit(warm.compute, name, str(tmp_path))
        warm.begin((plan, merge.prepared.resources), WorkerSetup(threads=2))
        done = waiting.result(timeout=60)
        warm.stop()
        assert hashlib.sha256(Path(done.temp).read_bytes()).hexdigest() == merge.reference[name]
        failing = ShardStream(None, None)
        waiting = calls.submit(failing.compute, name, str(tmp_path))
        with pytest.raises(TypeError):
            failing.begin(None, WorkerSetup(threads=2))  # type: ignore[arg-type]  # not a (plan, resources) pair
        with pytest.raises(TypeError):
            waiting.result(timeout=30)
        never = ShardStream(None, None)
        waiting = calls.submit(never.compute, name, str(tmp_path))
        never.stop()
        with pytest.raises(Stopped):
            waiting.result(timeout=30)
    assert list(tmp_path.iterdir()) == [Path(done.temp)]  # nothing of the shards that failed or waited


def test_a_failing_shard_fails_every_waiting_call_with_its_error(merge: Merge, tmp_path: Path) -> None:
    # (The driver turns it into the local run's line: tests/test_ray_executor.py checks that end to end.)
    victim = sorted((merge.root / "a").glob("*.safetensors"))[0]
    kept = victim.read_bytes()
    worker = _worker(merge)
    try:
        with victim.open("r+b") as file:
            file.truncate(len(kept) // 2)
        names = [shard.name for shard in compute_order(merge.prepared.plan)]
        with ThreadPoolExecutor(len(names)) as calls:  # every shard fed before the bad bytes are read
            waiting = [calls.submit(worker.compute, name, str(tmp_path)) for name in names]
            errors = [f.exception(timeout=60) for f in waiting]
    finally:
        victim.write_bytes(kept)
        worker.stop()
    failed = [e for e in errors if e is not None]
    assert failed and all(e is failed[0] for e in failed)  # the shards written before it are fine
    assert isinstance(failed[0], StorageError) and f"{victim.name} ended early" in str(failed[0])
    written = {f.result().temp for f, e in zip(waiting, errors) if e is None}
    assert {str(p) for p in tmp_path.glob(".*")} == written  # the failed shards left no temp file

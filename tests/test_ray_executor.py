"""``--executor ray``: a merge's shards as tasks on a real multi-node Ray cluster on this machine (a head and two
one-CPU worker nodes), against the local executor's bytes.

The checks of issue 46, in one test on one cluster (starting one costs 10-20 s, and a test module split over the suite's
two xdist workers would start two), in as few runs as they need (each Ray run starts its workers, fresh processes
importing torch: seconds): with hub inputs streamed, the output is byte-identical to a local run, both worker nodes made
shards and each read its own; a shard's real error ends the run as locally; a Ray driver SIGKILLed as it commits to a
hub OUT is resumed by the local executor, which sends none of the shards its nodes had uploaded again, and one SIGKILLed
after its third shard in a folder OUT (where its nodes write their temp files) is resumed locally, leaving none of them;
Ctrl-C stops a Ray driver as it stops a local one, and its resume on Ray has the nodes upload what they make and the
driver alone commit, its warm workers (whose memory reservations do not come up) ended and replaced; a local run
SIGKILLed mid-run is resumed on Ray, which loses a worker node mid-run (the node removal must come last); then a hub OUT
in the Xet tier under --max-disk, on the node left, by its kept worker (leased warm, though the plan sets its width),
which that run keeps two seconds.
The workers are started while the driver plans (warm) and used, not started again; a run that fails, is refused or is
killed leaves no worker and no memory reservation behind. The first run ends its workers (--keep-workers 0); the later
ones keep theirs (the default on a cluster that outlives the run): a slerp with -j 2 then -j 1 on the same processes
computes the local bytes at each -j, each node computing with that run's -j, a SIGKILLed driver's kept workers stop its
shards on their own and serve its resume, and kept workers idle for their time end, their names freed. The local halves
(a failing run, a killed run) run while the cluster starts; ``-s`` prints each phase's seconds."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from forkserver import Forked, worker_server
from hub.conftest import hf_env  # noqa: F401  (autouse: an isolated HF home, loopback only)
from hub.fakehub import FakeHub, files_of
from hub.fakehub_write import HubWriter
from hub.fakehub_xet import XetCas
from hubout.conftest import TOKEN, hub, repo_files, tier, uploads  # noqa: F401  (the stand-in hub's fixtures)
from huggingface_hub import constants
from raycluster import Cluster, RayHead, ray_cluster
from support import cli, cli_start, digests, hub_digests, ties_of_three, write_config

from resumerge import api
from resumerge.api.flagmap import executor_option
from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec
from resumerge.cli.render import show_status
from resumerge.config.hubtarget import parse_hub_target
from resumerge.config.locations import run_dir
from resumerge.errors import EXIT_INVALID, ResumergeError, UsageError
from resumerge.machine.cluster import launch
from resumerge.machine.cluster.keeper import run_digest
from resumerge.machine.cluster.kept import NAMESPACE, SPARE_SLOTS, kept_name
from resumerge.machine.cluster.launch import NODE_LABEL
from resumerge.machine.torch_import import IMPORT_RESERVE
from resumerge.merge.engine.cluster import driver
from resumerge.merge.engine.cluster.cores import Cores, node_cores
from resumerge.merge.engine.cluster.hubreads import NodeReads, NodeSources
from resumerge.merge.engine.cluster.upload import HubPlace, task_cpus, upload_shard
from resumerge.merge.engine.executor import CONCURRENCY
from resumerge.merge.engine.executors import LocalExecutor, RayExecutor
from resumerge.merge.engine.quiet import NullReporter
from resumerge.merge.plan.merge_plan import ShardPlan
from resumerge.merge.store.hubcommits import CommitQueue

# As in tests/hubout: huggingface_hub's LFS PUT passes ``data=``, which httpx deprecates (its code, not ours).
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")
SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
SHARD = "10k"
NAMING = ("README.md", "mergekit_config.yml", "resumerge-manifest.json")  # the output files that name the inputs


@dataclass(frozen=True)
class Merge:
    """A TIES merge of three tiny local models (compute-bound, the kind a cluster is for) and its local bytes; a
    slerp of two of them (a method whose bytes may depend on the thread count: the plan records it) and its local
    bytes by ``-j`` (alike here: its tensors are below torch's parallel grain)."""

    config: Path
    reference: dict[str, str]
    slerp: Path
    slerp_reference: dict[int, dict[str, str]]
    hub_reference: dict[str, str]  # the local bytes as a hub OUT holds them (its manifest records sha256)


@pytest.fixture(scope="module")
def merge(tmp_path_factory: pytest.TempPathFactory) -> Merge:
    root = tmp_path_factory.mktemp("ray")
    config = ties_of_three(root, SPEC)
    api.run(config, root / "local", settings=api.Settings(state_dir=root / "state",
                                                          output=api.Output(out_shard_size=SHARD)))
    a, b = str(root / "a"), str(root / "b")
    slerp = write_config(root / "slerp.yml", {"merge_method": "slerp", "base_model": a, "dtype": "float32",
                                              "models": [{"model": a}, {"model": b}], "parameters": {"t": 0.3}})
    references = {}
    for threads in (2, 1):
        api.run(slerp, root / f"slerp-j{threads}", settings=api.Settings(state_dir=root / "state",
                                                                         output=api.Output(out_shard_size=SHARD),
                                                                         resources=api.Resources(num_threads=threads)))
        references[threads] = digests(root / f"slerp-j{threads}")
    return Merge(config, digests(root / "local"), slerp, references, hub_digests(root / "local"))


def _largest_shard(merge: Merge) -> int:
    """The largest output shard's size: as --max-disk, one shard staged at a time."""
    return max(p.stat().st_size for p in (merge.config.parent / "local").glob("*.safetensors"))


def _node_events(out: Path | str, state: Path) -> list[dict[str, Any]]:
    db = sqlite3.connect(run_dir(out, state) / "ledger.db")
    try:
        return [json.loads(r[0]) for r in db.execute("SELECT data FROM events WHERE kind = 'node' ORDER BY id")]
    finally:
        db.close()


def _done_shards(out: Path, state: Path) -> int:
    db = sqlite3.connect(run_dir(out, state) / "ledger.db")
    try:
        return int(db.execute("SELECT COUNT(*) FROM files WHERE kind = 'shard' AND status = 'done'").fetchone()[0])
    finally:
        db.close()


@pytest.mark.slow  # the suite's longest test: its module runs first, so no worker idles at the end
def test_a_ray_cluster_merges_like_the_local_executor_whatever_fails(merge: Merge, hub: HubWriter,  # noqa: F811
                                                                      tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      ray_head: RayHead) -> None:
    pytest.importorskip("ray")
    clock = _Timeline()  # each phase's seconds, under -s
    # The local halves of two checks below run while the cluster starts (Ray starts it from the main thread only).
    pool = ThreadPoolExecutor(1)
    failing = pool.submit(_failing_run, merge, tmp_path / "failing", "local")
    killing = pool.submit(_killed_locally, merge, tmp_path / "killed-local")
    with pool, ray_cluster(ray_head) as cluster:
        local_error, killed_locally = failing.result(), killing.result()
        clock.lap("cluster up, and the local runs killed or failing beside it")
        with _no_worker_started_after_the_plan(monkeypatch):  # the warm ones serve
            # Output identical to the local executor's, both worker nodes made shards, a one-CPU node ran 1 thread
            # and 1 unit, status shows the nodes; with hub inputs streamed, each node read its own ranges. Its
            # workers (--keep-workers 0) end with it.
            _streamed_hub_inputs_are_read_by_each_node(cluster, merge, hub, tmp_path / "streamed")
            clock.lap("streamed inputs, on both nodes as locally; no worker kept")
            # The next runs on the cluster keep their workers: slerp -j 2, then -j 1, on the same processes.
            kept = _runs_on_kept_workers_compute_as_fresh_ones(cluster, merge, tmp_path / "kept")
            clock.lap("two runs on kept workers")
        # A shard's real error ends the run as locally; the failed run leaves no worker or reservation.
        _assert_same_error(local_error, _failing_run(merge, tmp_path / "failing", "ray"), tmp_path / "failing")
        _wait_for_idle_cluster()
        clock.lap("a failing run")
        _a_run_refused_before_it_computes_leaves_no_worker(merge, tmp_path / "refused")
        clock.lap("a refused run")
        # Hub OUTs in the LFS tier. A Ray driver SIGKILLed as it commits, resumed by the local executor.
        _a_killed_ray_driver_resumes_locally(cluster, merge, hub, tmp_path / "killed-ray")
        clock.lap("hub OUT (LFS): a killed Ray driver resumed locally")
        _a_killed_ray_driver_leaves_a_folder_out_that_resumes_locally(cluster, merge, tmp_path / "killed-ray-folder")
        clock.lap("folder OUT: a killed Ray driver resumed locally")
        _a_killed_ray_driver_resumes_on_its_kept_workers(cluster, merge, kept, tmp_path / "killed-ray-kept")
        clock.lap("folder OUT: a killed Ray driver resumed on its kept workers")
        # SIGINT stops a Ray driver as a local one. Its resume on Ray: the nodes upload, the driver alone commits;
        # its warm workers' reservations do not come up, so it ends them and starts its own.
        _ctrl_c_stops_a_ray_run_as_it_stops_a_local_one(cluster, merge, hub, tmp_path / "ctrl-c", monkeypatch)
        clock.lap("hub OUT (LFS): Ctrl-C, resumed on Ray past a warm reservation that timed out")
        # A killed local driver resumed on Ray, which loses a worker node mid-run.
        _a_killed_local_run_resumes_on_ray_losing_a_worker_node(cluster, merge, killed_locally)
        clock.lap("a killed local run resumed on Ray, a node lost")
        # The Xet tier, with --max-disk held per node, on the node left: hf-xet's local:// CAS, the stand-in's Xet
        # storage, is a folder that one process at a time may open (two nodes uploading at once meet its lock). Its
        # run keeps its worker two seconds: once idle that long, it ends.
        with _xet_hub(monkeypatch, tmp_path / "cas") as xet:
            _the_nodes_upload_their_shards_and_the_driver_alone_commits(merge, xet, tmp_path / "xet", monkeypatch,
                                                                        max_disk=_largest_shard(merge))
        clock.lap("hub OUT (Xet) under --max-disk, its kept worker ended once idle")
    clock.lap("cluster stopped")


class _Timeline:
    """The test's phases with their seconds, printed as each ends (seen under ``-s``): where its wall goes. Under
    RESUMERGE_TEST_CGROUP (tests/conftest.py) each phase's CPU seconds too, of every process of the run's cgroup: the
    Ray nodes' and workers' included, which no other count sees."""

    def __init__(self) -> None:
        self.began = self.last = time.monotonic()
        self.cpu = self._cpu()

    @staticmethod
    def _cpu() -> float | None:
        group = os.environ.get("RESUMERGE_TEST_CGROUP")
        return int(Path(group, "cpuacct.usage").read_text()) / 1e9 if group else None

    def lap(self, name: str) -> None:
        now, cpu = time.monotonic(), self._cpu()
        spent = "" if cpu is None or self.cpu is None else f", {cpu - self.cpu:.1f} CPU s"
        print(f"[ray timeline] {now - self.began:6.1f} s  {name}: {now - self.last:.1f} s{spent}", flush=True)
        self.last, self.cpu = now, cpu


@contextmanager
def _no_worker_started_after_the_plan(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The runs inside use the workers started while they planned: the driver starts none once it has planned."""
    started: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        workers = placed(*args, **kwargs)
        started.append(len(workers))
        return workers

    placed = driver.place
    with monkeypatch.context() as patch:
        patch.setattr(driver, "place", counted)
        yield
    assert started == []


class _Refusing(NullReporter):
    """A reporter that raises as the run starts computing: after the warm workers started, before the executor took
    them."""

    def start(self, *, total_tensors: int, done_tensors: int, total_bytes: int, done_bytes: int) -> None:
        raise UsageError("refused at the start")


def _a_run_refused_before_it_computes_leaves_no_worker(merge: Merge, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="refused at the start"):
        api.run(merge.config, tmp_path / "out", settings=api.Settings(state_dir=tmp_path / "state",
                                                                      executor=RayExecutor(),
                                                                      output=api.Output(out_shard_size=SHARD)),
                                                                      progress=_Refusing())
    _wait_for_idle_cluster()  # the API call ended its warm workers


def _killed_locally(merge: Merge, tmp_path: Path) -> tuple[Path, Path]:
    """OUT and state dir of a local run whose process died at once (SIGKILL) after the ledger recorded its third
    shard."""
    out, state = tmp_path / "out", tmp_path / "state"
    ran = cli("run", merge.config, out, "--state-dir", state, "--out-shard-size", SHARD,
              env={"RESUMERGE_KILL_AT": "after_ledger_commit:3"})
    assert ran.returncode == -9, ran.stderr
    assert _done_shards(out, state) == 3
    return out, state


def _a_killed_local_run_resumes_on_ray_losing_a_worker_node(cluster: tuple[Cluster, Any], merge: Merge,
                                                            killed: tuple[Path, Path]) -> None:
    # The resume on Ray of a killed local run (``killed``) loses a worker node mid-run (the last check that needs
    # two: one node is left): that costs only the lost node's shards.
    out, state = killed
    lost = cluster[0].workers[1]
    remover = _RemovingNode(cluster[1], lost)
    outcome = api.resume(out, settings=api.Settings(state_dir=state, executor=RayExecutor()), progress=remover)
    assert remover.removed_after > 1  # removed mid-run
    assert digests(out) == merge.reference
    assert outcome.resumed_files == 3  # every recorded shard kept, only the rest made again
    events = _node_events(out, state)
    shards = sum(1 for n in merge.reference if n.endswith(".safetensors"))
    assert len(events) == len({e["shard"] for e in events}) == shards - 3  # each shard not recorded, made once
    # The lost node made at most the shard it was fed first and the two it was fed when it was removed (the driver
    # keeps two fed to each worker); everything after, and whatever it was computing, the node that is left made.
    left = (cluster[0].node_ids() - {lost.node_id[:8]}).pop()
    assert sum(1 for e in events if e["node"] == left) >= len(events) - 3


class _Damaging(NullReporter):
    """A reporter that truncates an input shard as the run starts computing: an error the tasks find late."""

    def __init__(self, victim: Path) -> None:
        self.victim = victim

    def start(self, *, total_tensors: int, done_tensors: int, total_bytes: int, done_bytes: int) -> None:
        with self.victim.open("r+b") as file:
            file.truncate(self.victim.stat().st_size // 2)


def _failing_run(merge: Merge, tmp_path: Path, executor: str) -> ResumergeError:
    """The error of a run with ``executor`` over copies of the models, one of whose input shards is truncated as the
    run starts computing."""
    models = tmp_path / executor
    shutil.copytree(merge.config.parent, models, ignore=shutil.ignore_patterns("local", "state"))
    config = models / merge.config.name
    config.write_text(merge.config.read_text().replace(str(merge.config.parent), str(models)))
    victim = sorted((models / "a").glob("*.safetensors"))[0]
    with pytest.raises(ResumergeError) as caught:
        api.run(config, tmp_path / f"out-{executor}", settings=api.Settings(state_dir=tmp_path / f"state-{executor}",
                                                                            executor=executor_option(executor),
                                                                            output=api.Output(out_shard_size=SHARD)),
                                                                            progress=_Damaging(victim))
    return caught.value


def _assert_same_error(local: ResumergeError, ray: ResumergeError, tmp_path: Path) -> None:
    """A task that fails ends the run as the local executor does: the same error, exit code and line."""
    assert type(ray) is type(local) and ray.exit_code == local.exit_code
    assert ray.one_line() == local.one_line().replace(str(tmp_path / "local"), str(tmp_path / "ray"))


def test_without_ray_the_ray_executor_is_a_usage_error(merge: Merge, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError, as where it is not installed
    out = str(tmp_path / "out")
    for command in (["run", str(merge.config), out], ["resume", out], ["plan", str(merge.config), out]):
        assert main([*command, "--executor", "ray"]) == EXIT_INVALID, command
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "pip install -c constraints.txt -e '.[ray]'" in err[0], err
        assert "resumerge[ray]" not in err[0]  # no package index has resumerge: that command cannot work
    assert not (tmp_path / "out").exists()


def _streamed_hub_inputs_are_read_by_each_node(cluster: tuple[Cluster, Any], merge: Merge, writer: HubWriter,
                                               tmp_path: Path) -> None:
    # Every input streamed from the stand-in hub: each worker node reads its own shards' ranges (with its own
    # token), and the driver checks and records their digests in its ledger as a local run records its own. The
    # run's bytes are the local executor's, and both worker nodes made shards, each on one thread.
    tmp_path.mkdir()
    root, text = merge.config.parent, merge.config.read_text()
    for name in ("base", "a", "b"):
        writer.hub.push(f"org/{name}", files_of(root / name))
        text = text.replace(str(root / name), f"org/{name}")
    config, out, state = tmp_path / "streamed.yml", tmp_path / "out", tmp_path / "state"
    config.write_text(text)
    writer.hub.requests.clear()
    outcome = api.run(config, out, settings=api.Settings(state_dir=state, executor=RayExecutor(keep_workers=0),
                                                         output=api.Output(out_shard_size=SHARD),
                                                         resources=api.Resources(stream_inputs=True)))
    _wait_for_idle_cluster()
    assert _kept() == {}  # --keep-workers 0: the run's workers ended with it
    assert not _alive_pids(out, state)
    # The local run's bytes (of the same models read from disk: only the files naming the models differ).
    assert {n: d for n, d in digests(out).items() if n not in NAMING} == \
        {n: d for n, d in merge.reference.items() if n not in NAMING}
    _both_worker_nodes_made_shards(cluster, merge, out, state, outcome)
    # The stand-in saw each node's range reads (a node names itself in its user agent): both nodes read, no node
    # fetched a byte twice, and together they fetched exactly the bytes the merge needs (no read-ahead of another
    # node's tensors), as the driver's figures say.
    reads: dict[str, list[tuple[str, int, int]]] = {}
    for request in writer.hub.requests:
        if request.method == "GET" and request.range and "resumerge-node/" in request.agent:
            first, _, last = request.range.removeprefix("bytes=").partition("-")
            node = request.agent.split("resumerge-node/")[1][:8]
            reads.setdefault(node, []).append((request.path, int(first), int(last) + 1))
    assert set(reads) == cluster[0].node_ids()
    for ranges in reads.values():
        ranges.sort()
        assert all(a[0] != b[0] or a[2] <= b[1] for a, b in itertools.pairwise(ranges)), "a byte fetched twice"
    streamed = api.status(out, settings=api.Settings(state_dir=state)).streamed
    assert streamed is not None
    assert sum(e - s for ranges in reads.values() for _, s, e in ranges) == streamed["fetched"] == streamed["needed"]
    # Every range the nodes read is in the driver's ledger with the sha256 of the bytes on the hub.
    db = sqlite3.connect(run_dir(out, state) / "ledger.db")
    recorded = db.execute("SELECT model, file, start, \"end\", sha256 FROM stream_reads").fetchall()
    db.close()
    assert len(recorded) >= len(merge.reference)
    for model, file, start, end, sha256 in recorded:
        with (root / model.removeprefix("org/") / file).open("rb") as data:
            data.seek(start)
            assert hashlib.sha256(data.read(end - start)).hexdigest() == sha256


def _both_worker_nodes_made_shards(cluster: tuple[Cluster, Any], merge: Merge, out: Path, state: Path,
                                   outcome: Any) -> None:
    shards = [n for n in merge.reference if n.endswith(".safetensors")]
    assert len(shards) >= 6 and outcome.resumed_files == 0
    events = _node_events(out, state)
    assert sorted(e["shard"] for e in events) == sorted(shards)  # one event per shard, journaled by the driver
    assert {e["node"] for e in events} == cluster[0].node_ids()  # the head (0 CPUs) made none
    # A one-CPU node's worker computes on one thread, one unit at a time (the driver's default count is this
    # machine's cores; TIES's bytes do not depend on it).
    assert {(e["threads"], e["units"]) for e in events} == {(1, 1)}
    report = api.status(out, settings=api.Settings(state_dir=state))
    assert [line.split(":")[0] for line in report.nodes] == sorted(f"node {n}" for n in cluster[0].node_ids())
    assert all(line.endswith("/s") for line in report.nodes)
    shown = io.StringIO()
    show_status(report, shown, width=120)
    assert sum(1 for line in shown.getvalue().splitlines() if line.startswith("node ")) == 2


def _runs_on_kept_workers_compute_as_fresh_ones(cluster: tuple[Cluster, Any], merge: Merge,
                                                tmp_path: Path) -> set[int]:
    """A run that keeps its workers (the default on a cluster that outlives it), then a second one with other
    threads, of a method whose bytes may depend on them (slerp): each the local executor's bytes at its ``-j``, on
    both nodes, the second on the first's processes (reused, not started), each node's events saying it computed
    with that run's ``-j`` (the check that catches a thread count leaking from one run into the next: the tiny
    tensors' bytes are alike at either ``-j``). Returns their pids."""
    pids: list[set[int]] = []
    said = _Said()
    for threads in (2, 1):
        out, state = tmp_path / f"j{threads}", tmp_path / f"state-j{threads}"
        outcome = api.run(merge.slerp, out, settings=api.Settings(state_dir=state, executor=RayExecutor(),
                                                                  output=api.Output(out_shard_size=SHARD),
                                                                  resources=api.Resources(num_threads=threads)),
                                                                  progress=said,
                          )
        assert digests(out) == merge.slerp_reference[threads] and outcome.resumed_files == 0
        events = _node_events(out, state)
        assert {e["node"] for e in events} == cluster[0].node_ids() and {e["threads"] for e in events} == {threads}
        pids.append({e["pid"] for e in events})
    assert pids[0] == pids[1] and len(pids[0]) == 2
    assert [m for m in said.messages if m.startswith("Ray workers")] == [
        "Ray workers: 0 kept from a run before, 2 started for this one",
        "Ray workers: 2 kept from a run before, 0 started for this one"]
    kept = _kept()
    assert len(kept) == 2
    _wait_for_idle_cluster()  # released: no CPU held, no reservation left
    return pids[0]


class _Said(NullReporter):
    """A reporter that keeps the engine's notes."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def message(self, text: str) -> None:
        self.messages.append(text)


def _alive_pids(out: Path | str, state: Path) -> set[int]:
    """The processes that made ``out``'s shards and still run, within a few seconds."""
    deadline = time.monotonic() + 10
    while (alive := {p for p in {e["pid"] for e in _node_events(out, state)} if _running(p)}) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kept() -> dict[str, Any]:
    """The kept workers of this code on the cluster's live nodes, by name (every slot a run may ask)."""
    import ray

    code, found = run_digest(ray), {}
    for node in ray.nodes():
        if node["Alive"]:
            for slot in range(int(node["Resources"].get("CPU", 0)) + SPARE_SLOTS):
                name = kept_name(code, node["NodeID"], slot)
                try:
                    found[name] = ray.get_actor(name, namespace=NAMESPACE)
                except ValueError:
                    continue
    return found


def _leased(actor: Any) -> bool:
    """Whether a live run holds the kept worker: it refuses a lease (which, granted, is released at once)."""
    import ray

    code = run_digest(ray)
    box = [ray.put(code)]
    try:
        served = ray.get(actor.lease.remote(box, code, 60.0), timeout=30)
    except ray.exceptions.RayActorError:  # ending
        return False
    if served is None:
        return True
    ray.get(actor.release.remote(box), timeout=30)
    return False


@contextmanager
def _xet_hub(monkeypatch: pytest.MonkeyPatch, cas: Path) -> Iterator[HubWriter]:
    """A second stand-in hub, in the Xet tier (its ``local://`` CAS): the driver's client uploads through Xet, and
    so the nodes do (they take the driver's tier; their environment says LFS)."""
    fake = FakeHub()
    writer = HubWriter.attach(fake)
    writer.add_token(TOKEN, "alice", orgs=("team",))
    writer.cas = XetCas(cas)
    with monkeypatch.context() as patch, fake:
        patch.setattr(constants, "HF_HUB_DISABLE_XET", False)
        patch.setenv("HF_ENDPOINT", fake.url)
        yield writer


def _a_killed_ray_driver_resumes_locally(cluster: tuple[Cluster, Any], merge: Merge, writer: HubWriter,
                                         tmp_path: Path) -> None:
    # A hub OUT (LFS): the Ray driver SIGKILLed as it makes its first batch commit, when its nodes have uploaded
    # shards that no commit names yet; the local executor's resume finds them there (the same sha256) and sends none
    # again.
    state = tmp_path / "state"
    ran = cli("run", merge.config, "hf://alice/ray", "--state-dir", state, "--out-shard-size", SHARD, "--commit-every",
              "4", "--commit-interval", "3600", "--executor", "ray", "--ray-address", cluster[0].address,
              env={"RESUMERGE_KILL_AT": "hub_before_commit:1"})
    assert ran.returncode == -9, ran.stderr
    _wait_for_idle_cluster()  # Ray ends the dead driver's tasks: none may upload while it resumes
    assert not any(n.endswith(".safetensors") for n in repo_files(writer, "alice/ray"))
    outcome = api.resume("hf://alice/ray", settings=api.Settings(state_dir=state, executor=LocalExecutor(),
                                                                 hub=api.Hub(commit_every=4, commit_interval=3600)))
    assert outcome.target == "hf://alice/ray"
    _hub_output_checked(merge, writer, "alice/ray", state, nodes=None)


def _a_killed_ray_driver_leaves_a_folder_out_that_resumes_locally(cluster: tuple[Cluster, Any], merge: Merge,
                                                                  tmp_path: Path) -> None:
    # A folder OUT: the nodes write their temp files in OUT itself. The Ray driver SIGKILLed after the ledger
    # records its third shard; the local executor's resume keeps the three, makes the rest, and leaves none of the
    # dead run's temp files behind (every file in OUT is the local run's).
    out, state = tmp_path / "out", tmp_path / "state"
    ran = cli("run", merge.config, out, "--state-dir", state, "--out-shard-size", SHARD, "--executor", "ray",
              "--ray-address", cluster[0].address, env={"RESUMERGE_KILL_AT": "after_ledger_commit:3"})
    assert ran.returncode == -9, ran.stderr
    assert _done_shards(out, state) == 3
    _wait_for_idle_cluster()  # Ray ends the dead driver's tasks: none may write into OUT while it resumes
    outcome = api.resume(out, settings=api.Settings(state_dir=state, executor=LocalExecutor()))
    assert digests(out) == merge.reference
    assert outcome.resumed_files == 3  # every recorded shard kept, only the rest made again
    # The killed driver's last shard lost its node event (journaled after the ledger row the kill followed).
    assert len({e["shard"] for e in _node_events(out, state)}) == 2


def _a_killed_ray_driver_resumes_on_its_kept_workers(cluster: tuple[Cluster, Any], merge: Merge, kept: set[int],
                                                     tmp_path: Path) -> None:
    # The Ray driver SIGKILLed mid-run on kept workers: each worker stops the dead run's shards on its own (its
    # watchdog reads the lease's token, whose owner died), then serves the resume (the same processes), whose
    # output is the local run's with none of the dead run's temp files left in OUT.
    out, state = tmp_path / "out", tmp_path / "state"
    ran = cli("run", merge.config, out, "--state-dir", state, "--out-shard-size", SHARD, "--executor", "ray",
              "--ray-address", cluster[0].address, env={"RESUMERGE_KILL_AT": "after_ledger_commit:3"})
    assert ran.returncode == -9, ran.stderr
    assert {e["pid"] for e in _node_events(out, state)} <= kept
    _wait_for_idle_cluster()  # the leases taken back: the dead run's pipelines stopped, without a new run
    outcome = api.resume(out, settings=api.Settings(state_dir=state, executor=RayExecutor()))
    assert digests(out) == merge.reference  # every file in OUT is the local run's: no temp file left
    assert outcome.resumed_files == 3
    assert {e["pid"] for e in _node_events(out, state)} == kept  # the killed run's workers served the resume


def _kept_workers_end_once_idle_for_their_time(out: Path | str, state: Path) -> None:
    # The run into ``out`` kept its workers two seconds: once idle that long, each ends itself, its name freed and its
    # process gone.
    deadline = time.monotonic() + 30
    while _kept():
        assert time.monotonic() < deadline, "a kept worker outlived its idle time"
        time.sleep(0.1)
    assert not _alive_pids(out, state)


def _the_nodes_upload_their_shards_and_the_driver_alone_commits(merge: Merge, writer: HubWriter, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 max_disk: int) -> None:
    # Its node's kept worker serves it (started warm, as a run with no --max-disk), though the plan sets how wide a
    # node's workers are: the driver starts none. The run keeps it two seconds idle, then it ends.
    state = tmp_path / "state"
    with _the_driver_uploads_no_shard(monkeypatch), _no_worker_started_after_the_plan(monkeypatch):
        outcome = api.run(merge.config, "hf://alice/ray", api.Settings(
            state_dir=state, executor=RayExecutor(keep_workers=2.0), output=api.Output(out_shard_size=SHARD),
            hub=api.Hub(commit_every=4, commit_interval=3600), resources=api.Resources(max_disk=max_disk)))
    assert _kept()
    assert outcome.target == "hf://alice/ray"
    _hub_output_checked(merge, writer, "alice/ray", state, nodes=1, max_disk=max_disk)
    _kept_workers_end_once_idle_for_their_time("hf://alice/ray", state)


@contextmanager
def _the_driver_uploads_no_shard(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Inside, this process (the driver) uploads no shard: the nodes upload theirs."""
    staged = CommitQueue._upload

    def driver_upload(queue: CommitQueue, entry: Any) -> None:
        assert not entry.name.endswith(".safetensors"), f"the driver uploaded {entry.name}"
        staged(queue, entry)

    with monkeypatch.context() as patch:
        patch.setattr(CommitQueue, "_upload", driver_upload)
        yield


def _hub_output_checked(merge: Merge, writer: HubWriter, repo: str, state: Path, *, nodes: int | None,
                        max_disk: int | None = None) -> None:
    """The hub OUT ``repo`` holds the local run's bytes, each shard sent once, committed by the driver alone; its
    shards made on ``nodes`` nodes (None: not counted); nothing left staged."""
    files = repo_files(writer, repo)
    assert {n: hashlib.sha256(b).hexdigest() for n, b in files.items()} == merge.hub_reference
    shards = [n for n in merge.reference if n.endswith(".safetensors")]
    assert uploads(writer, repo) == {merge.reference[n]: 1 for n in shards}  # each sent once
    # Every commit of the repo is one the driver's ledger journaled (the tasks never commit).
    db = sqlite3.connect(run_dir(f"hf://{repo}", state) / "ledger.db")
    commits = {json.loads(r[0])["commit"] for r in db.execute("SELECT data FROM events WHERE kind = 'commit'")}
    db.close()
    assert commits and commits <= set(writer.hub.repos[repo].commits)
    if max_disk is None:  # many files per commit (under --max-disk the small files go one by one, as locally)
        assert writer.commits[repo] < len(shards)
    if nodes is not None:
        assert len({e["node"] for e in _node_events(f"hf://{repo}", state)}) == nodes
    assert not any((run_dir(f"hf://{repo}", state) / "staging").iterdir())  # nothing kept staged


def test_shards_are_fed_largest_first_where_their_inputs_have_landed() -> None:
    """Without a cluster: a lost worker's re-issued shard first, then the largest landed one (the first in compute
    order among equals), then, when none has landed, the first in compute order (its download lands first)."""
    sizes = {"a": 10, "b": 30, "c": 20, "d": 30, "e": 40}
    pending = deque((ShardPlan(name, (), size), 0) for name, size in sizes.items())
    landed = {"a", "b", "c", "d"}  # e's inputs are still downloading
    asked: list[str] = []

    def has_landed(shard: ShardPlan) -> bool:
        asked.append(shard.name)
        return shard.name in landed

    lost = ShardPlan("lost", (), 1)
    pending.appendleft((lost, 1))
    order = [driver.next_shard(pending, has_landed)[0].name for _ in range(3)]
    # Only a shard larger than the best so far is asked (c and d not, the first time).
    assert order == ["lost", "b", "d"] and asked == ["a", "b", "e", "a", "c", "d", "e"]
    landed.clear()
    assert [driver.next_shard(pending, has_landed)[0].name for _ in range(3)] == ["a", "c", "e"] and not pending


def test_a_stopped_driver_collects_every_result_already_made() -> None:
    """Without a cluster: a poll takes the first answer; once the run is stopped, the others already made too (a
    second ready result would otherwise be thrown away as the workers stop)."""
    made, pending = ["first", "second", "third"], ["later"]
    polls: list[float] = []

    class Answers:
        def wait(self, refs: list[str], num_returns: int, timeout: float) -> tuple[list[str], list[str]]:
            polls.append(timeout)
            ready = [r for r in refs if r in made][:num_returns]
            return ready, [r for r in refs if r not in ready]

    ray: Any = Answers()
    assert driver.answered(ray, made + pending, lambda: False) == (["first"], False)
    assert driver.answered(ray, made + pending, lambda: True) == (made, True)
    assert polls == [driver.POLL_SECONDS, driver.POLL_SECONDS, 0]


def test_max_disk_bounds_the_shards_a_node_stages_at_once() -> None:
    # A task holds its shard on its node until uploaded; Ray places tasks by CPUs, so a task declares enough CPUs
    # that no node runs more tasks at once than --max-disk holds shards (the largest node still takes one).
    assert task_cpus(1, [8, 4], None, 100) == 1
    assert task_cpus(1, [8, 4], 250, 100) == 4  # two shards: two tasks on the 8-CPU node, one on the 4-CPU one
    assert task_cpus(1, [8], 100, 100) == 8
    assert task_cpus(6, [8], 800, 100) == 6  # the thread count is the floor


def test_kept_warm_workers_serve_a_wider_run_and_the_ones_left_over_are_spare() -> None:
    """Without a cluster: a kept worker declares no CPU, so a run whose workers are wider than the warm start's (a hub
    OUT under --max-disk) takes the first of each node's as many as it needs there, as wide as it needs them; workers
    that are not kept declared their CPUs as they started and are left to the adoption as they are."""
    nodes = [{"NodeID": node_id, "Alive": True, "Resources": {"CPU": cpus}} for node_id, cpus in (("a" * 16, 8),
                                                                                                    ("b" * 16, 2))]
    kept = [launch.Worker(f"{node[0]}{slot}", node[:8], node, 1, token=b"lease") for node in ("a" * 16, "b" * 16)
            for slot in range(int(next(n["Resources"]["CPU"] for n in nodes if n["NodeID"] == node)))]
    taken, spare = launch.fit(list(kept), nodes, 4)
    assert [(w.actor, w.width) for w in taken] == [("a0", 4), ("a1", 4), ("b0", 2)]
    assert [w.actor for w in spare] == ["a2", "a3", "a4", "a5", "a6", "a7", "b1"]
    fresh = [launch.Worker("f0", "a" * 8, "a" * 16, 1), launch.Worker("f1", "b" * 8, "b" * 16, 1)]
    assert launch.fit(fresh, nodes, 4) == (fresh, []) and [w.width for w in fresh] == [1, 1]
    gone = [launch.Worker("c0", "c" * 8, "c" * 16, 1, token=b"lease")]  # its node left the cluster
    assert launch.fit(gone, nodes, 1) == ([], gone)


def test_a_worker_computes_with_the_cpus_it_declares_unless_the_bytes_depend_on_the_thread_count() -> None:
    def busy(cores: Cores) -> int:  # threads at work: units of one thread each where they fill torch's threads
        return cores.units if cores.threads <= cores.units else cores.units * cores.threads

    assert node_cores(16, 1, thread_dependent=False) == Cores(1, 1)  # a one-CPU node: one thread, one unit
    assert node_cores(16, 8, thread_dependent=False) == Cores(4, 2)  # not 2 units of 16 threads on 8 CPUs
    for recorded, cpus in itertools.product(range(1, 17), range(1, 65)):
        assert cpus - 1 <= busy(node_cores(recorded, cpus, thread_dependent=False)) <= cpus, (recorded, cpus)
        # The bytes of slerp & co. depend on torch's threads and on whether the units fill them (serial kernels):
        # both stay the local run's, whatever the node.
        kept = node_cores(recorded, cpus, thread_dependent=True)
        assert kept.threads == recorded and (kept.threads <= kept.units) == (recorded <= CONCURRENCY)
        if recorded <= cpus:
            assert busy(kept) <= cpus, (recorded, cpus)
    assert node_cores(1, 1, thread_dependent=True) == Cores(1, 1)


def test_a_node_without_a_token_refuses_to_upload_in_one_line(tmp_path: Path) -> None:
    place = HubPlace(parse_hub_target("hf://alice/ray"), "http://127.0.0.1:9", False, "resumerge resume hf://alice/ray")
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(b"x")
    with pytest.raises(UsageError) as refused:  # hf_env: no HF_TOKEN, no saved login
        upload_shard(place, shard, shard.name, hashlib.sha256(b"x").hexdigest())
    assert refused.value.exit_code == EXIT_INVALID and "HF_TOKEN" in refused.value.one_line()


def test_a_node_without_a_token_refuses_to_read_the_hub_inputs_in_one_line(merge: Merge) -> None:
    # The driver read the streamed inputs with a token: a node needs its own (it is never sent with a task).
    reads = NodeReads((), token=True, cache="test", limit=0)
    with pytest.raises(UsageError) as refused:  # hf_env: no HF_TOKEN, no saved login
        NodeSources(api.plan_merge(merge.config), reads, None, "0123abcd")
    assert refused.value.exit_code == EXIT_INVALID
    assert "0123abcd" in refused.value.one_line() and "HF_TOKEN" in refused.value.one_line()


def _ctrl_c_stops_a_ray_run_as_it_stops_a_local_one(cluster: tuple[Cluster, Any], merge: Merge, writer: HubWriter,
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real driver process, whose batches never fill: only the interrupt's last commit commits shards. Forked from
    # the worker's fork server (support.cli_start: a fresh interpreter imported torch again, ~3 CPU s): the stall
    # below holds the uploads from the third on until the driver says it stops, whenever its SIGINT lands.
    state, stopping = tmp_path / "state", threading.Event()
    (worker_server().folder / "stderr").unlink(missing_ok=True)  # the last command's: see _stderr_lines
    proc = cli_start("run", merge.config, "hf://alice/stopped", "--state-dir", state, "--out-shard-size", SHARD,
                     "--commit-every", "100", "--commit-interval", "3600", "--executor", "ray", "--ray-address",
                     cluster[0].address, capture=True)
    said: list[str] = []

    def read_stderr() -> None:
        for line in _stderr_lines(proc):
            said.append(line)
            # Printed by the driver's SIGINT handler, which sets its stop flag: from its loop's next turn on (which
            # still collects the results already ready) it collects no shard, so the uploads held until now may
            # finish (their workers then stop at once).
            if "SIGINT: stopping" in line:
                stopping.set()

    uploads: list[int] = []  # the uploads the nodes started

    def stall(number: int) -> None:  # a node uploads the third shard: Ctrl-C, and hold it (and any later)
        uploads.append(number)
        if number == 3:
            proc.send_signal(signal.SIGINT)
        if number >= 3:
            stopping.wait(60)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    writer.on_upload = stall
    try:
        proc.wait(timeout=90)
    finally:
        stopping.set()
        writer.on_upload = None
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # The pipe (a fresh interpreter's) or the file (a forked one's) ends with the driver: the reader is done
        # with it before it is closed (closed under a reader still reading, its thread would raise, and that
        # warning would hide this test's own failure).
        reader.join()
        if isinstance(proc, subprocess.Popen) and proc.stderr is not None:
            proc.stderr.close()
    err = "".join(said)
    # As locally (tests/hubout/test_hub_writers.py): the uploaded shards committed, the resume command, exit 3.
    assert proc.returncode == 3, err
    assert "resumerge resume hf://alice/stopped" in err and "Traceback" not in err and "Unhandled" not in err, err
    committed = repo_files(writer, "alice/stopped")
    shards = sorted(n for n in committed if n.endswith(".safetensors"))
    # The shards the driver collected before it honoured the interrupt, each recorded done: at least one (both
    # nodes upload at once, so the second upload's result may still be on its way when the third's start
    # interrupts), at most one per upload started (the uploads held from the third on are let go once the driver
    # says it stops, and a stopping driver still collects every result already made: driver.answered). Exactly
    # which cannot be told: the stand-in hub sees an upload's start, not when its result reaches the driver.
    db = sqlite3.connect(run_dir("hf://alice/stopped", state) / "ledger.db")
    done = sorted(r[0] for r in db.execute("SELECT name FROM files WHERE kind = 'shard' AND status = 'done'"))
    db.close()
    assert shards == done and 1 <= len(shards) <= max(uploads), (shards, done, uploads, err)
    assert all(hashlib.sha256(committed[n]).hexdigest() == merge.reference[n] for n in shards)
    _wait_for_idle_cluster()  # the stopped driver's workers ended, or were released, with it
    # The resume: each node uploads the shards it makes (what the stopped run's nodes uploaded is on the hub
    # already: not sent again), the driver alone commits, in batches.
    with _warm_reservation_never_ready(cluster[0], monkeypatch) as adopted, _the_driver_uploads_no_shard(monkeypatch):
        outcome = api.resume("hf://alice/stopped", settings=api.Settings(state_dir=state, executor=RayExecutor(),
                                                                         hub=api.Hub(commit_every=4,
                                                                                     commit_interval=3600)))
    assert adopted == [False]
    assert outcome.resumed_files >= len(shards)
    _hub_output_checked(merge, writer, "alice/stopped", state, nodes=2)
    _wait_for_idle_cluster()  # the warm workers' reservations were removed with them, and the run's own workers


def _stderr_lines(proc: Forked | subprocess.Popen[str]) -> Iterator[str]:
    """``proc``'s stderr line by line as it writes them, until it has ended: a fresh interpreter's pipe, or the file
    a forked command writes (tests/forkserver.py), read as it grows. The forked child makes that file anew (the
    caller removed the one the server's command before wrote): it is read once it is there."""
    if isinstance(proc, subprocess.Popen):
        assert proc.stderr is not None
        yield from proc.stderr
        return
    assert proc.files is not None
    while not proc.files[1].exists():
        if proc.poll() is not None:
            return
        time.sleep(0.01)
    with proc.files[1].open(encoding="utf-8", errors="replace") as err:
        part = ""
        while True:
            ended = proc.poll() is not None  # read after: what it wrote before it ended is read below
            part += err.read()
            *lines, part = part.split("\n")
            for line in lines:
                yield line + "\n"
            if ended:
                if part:
                    yield part
                return
            time.sleep(0.05)


@contextmanager
def _warm_reservation_never_ready(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """A run inside whose warm workers' memory reservations do not come up within the wait (shortened): one worker
    node's memory is held but for a warm worker's imports until the run gave up on its warm workers. The list
    yielded gets what each adoption returned; the run then started its own workers (one per worker node), once."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    node_id = cluster.workers[0].node_id
    has = next(n["Resources"] for n in ray.nodes() if n["NodeID"] == node_id)
    holder = placement_group([{"memory": has["memory"] - min(IMPORT_RESERVE, has["memory"])}],
                             bundle_label_selector=[{NODE_LABEL: node_id}])
    assert ray.get(holder.ready(), timeout=30)
    adopted: list[bool] = []
    started: list[int] = []
    adopt, place = driver.adopt, driver.place

    def adopting(*args: Any, **kwargs: Any) -> bool:
        adopted.append(adopt(*args, **kwargs))
        remove_placement_group(holder)  # the workers the run starts now may take the node's memory
        return adopted[-1]

    def placing(*args: Any, **kwargs: Any) -> Any:
        workers = place(*args, **kwargs)
        started.append(len(workers))
        return workers

    try:
        with monkeypatch.context() as patch:
            patch.setattr(launch, "RESERVE_SECONDS", 0.5)
            patch.setattr(driver, "adopt", adopting)
            patch.setattr(driver, "place", placing)
            yield adopted
    finally:
        if not adopted:
            remove_placement_group(holder)
    assert started == [2]


class _RemovingNode(NullReporter):
    """A reporter that removes a worker node (all its processes die, as on a lost VM) when the driver publishes the
    run's first shard: the other shards are then in flight or queued, some of them on that node."""

    def __init__(self, ray_cluster: Any, node: Any) -> None:
        self.ray_cluster, self.node, self.removed_after = ray_cluster, node, 0

    def file_done(self, name: str, kind: str) -> None:
        self.removed_after += 1
        if self.removed_after == 1:
            self.ray_cluster.remove_node(self.node)


def _wait_for_idle_cluster() -> None:
    """Wait until no worker of an ended (failed, refused, killed) run holds a CPU or memory, none of its memory
    reservations (placement groups) is left, and no run holds a kept worker (which holds only its imports'
    memory)."""
    import ray

    deadline = time.monotonic() + 60
    while True:
        kept = _kept()
        leased = [name for name, actor in kept.items() if _leased(actor)]
        free, total = ray.available_resources(), ray.cluster_resources()
        held = {"CPU": 0, "memory": len(kept) * IMPORT_RESERVE}
        reserved = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        if not reserved and not leased and all(free.get(kind, 0) >= total.get(kind, 0) - held[kind]
                                               for kind in ("CPU", "memory")):
            return
        assert time.monotonic() < deadline, \
            f"an ended run's workers kept running: {free}, {total}, {reserved}, leased {leased}"
        time.sleep(0.1)

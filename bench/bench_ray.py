"""The Ray executor's cost and gain (issue 46), on Ray clusters started on this machine.

Usage: ``python bench/bench_ray.py [CASE] --models DIR [--runs N] [--work DIR]``, where DIR holds the bench
models ``a``, ``b`` and ``c`` (``/work/benchwork/models-940646400``: three ~941 MB fp32 Llama-style models) and
CASE is

- ``overhead``: ``resumerge run`` of a linear merge of ``a`` and ``b`` with the local executor, then with
  ``--executor ray`` on one Ray node with the machine's CPUs, cold and warm (below; goal: at most 1.15x the local
  wall);
- ``nodes``: a TIES merge of ``a``, ``b``, ``c`` (compute-bound) with ``--executor ray -j 1`` on two one-CPU
  worker nodes, then on one, each cold and warm (goal: two nodes at most 0.6x one node's wall, cold against cold and
  warm against warm). Each node emulates a machine with a core
  of its own: its raylet, and so its workers, is pinned to one core (two nodes: two cores; one node: one core), the
  head and the driver are not (the driver's CPU is given apart). But the two cores share one memory bus and cache,
  which two machines would not: a merge computing on one core slows the other's (TIES on this VM: 20-30 %). So a
  control series follows, warm: the one node again while its neighbour core runs the same merge locally, over and
  over (:func:`twin`), as each of two nodes has the other beside it; two nodes against it is the executor's own
  scaling with that sharing taken out;
- ``bignodes``: ``nodes`` with more work per node, so that each node's fixed start (about 4.5 s: its worker's
  process, Ray's and the engine's imports, torch) weighs less against its shards: the same TIES merge of ``a``,
  ``b``, ``c`` with the models' layers stacked ``--copies`` times (mergekit ``slices``: each output layer the TIES
  of the three models' same layer; 2 copies: about 1.9x the work of ``nodes``, the embeddings and head merged once);
- ``hubnodes``: the linear merge of ``a`` and ``b`` hub to hub (``--stream-inputs`` into an ``hf://`` OUT) through
  the stand-in hub of ``tests/hub``, its link throttled per connection (``--hub-down`` and ``--hub-up`` MB/s each:
  a node reads by 4 range connections and uploads by one), with ``--executor ray -j 1`` on two one-CPU worker
  nodes, then on one: each node reads its shards' ranges from the hub and uploads its shards itself (goal: two nodes
  at most 0.6x one node's wall, the link being what a second node doubles). The default rates make the 941 MB
  models take minutes; RESULTS.md's runs use two 198 MB models (``ModelSpec(layers=3, hidden=1024,
  intermediate=2816, vocab=8000, heads=16, kv_heads=8)`` of ``resumerge.cli.modelgen``, seeds 1 and 2) and
  ``--out-shard-size 20M``;
- ``all`` (the default): the four, one after the other.

Output shards of ``--out-shard-size`` (100M: about twelve shards fed to the nodes' workers). Every run is a fresh
``resumerge run`` process (a new Ray job) into a fresh OUT and state dir; the cluster is started once per
configuration and not timed. Every Ray series comes twice: **cold**, each
run with ``--keep-workers 0`` (no worker kept from a run before: its workers import torch afresh, as a first run on
a cluster does), then **warm**, each run on the workers a priming run (not timed) kept (``--keep-workers``'s
default: the next runs on a team's cluster). Each run's line gives its wall, the
CPU seconds of every process of the run (the driver and, for Ray, the cluster's processes and workers: this
process's descendants, sampled every 0.2 s; the driver's own beside; and by the cores each process was allowed on:
a pinned node's on its core), the load average before and after it, and for Ray where its wall went (the ledger's
timeline); the outputs of each case are compared byte for byte. Ends with the ratios of the medians against the
goals (wall and CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
from bench_linear import CONFIG as LINEAR  # the same linear merge of a and b

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests")]

from hub.fakehub import FakeHub, sparse_files_of  # noqa: E402
from hub.fakehub_link import Link  # noqa: E402
from hub.fakehub_write import HubWriter  # noqa: E402

MB = 10**6
TOKEN = "bench-token"

TIES = """merge_method: ties
base_model: {a}
models:
  - model: {b}
    parameters: {{weight: 0.6, density: 0.5}}
  - model: {c}
    parameters: {{weight: 0.4, density: 0.5}}
dtype: float32
"""


def ties_stacked(names: dict[str, Path], copies: int) -> str:
    """``TIES`` over the models' layers stacked ``copies`` times: a slice per copy, each of every layer."""
    layers = json.loads((names["a"] / "config.json").read_text())["num_hidden_layers"]
    sources = (f"      - model: {names['a']}\n        layer_range: [0, {layers}]\n"
               f"      - model: {names['b']}\n        layer_range: [0, {layers}]\n"
               "        parameters: {weight: 0.6, density: 0.5}\n"
               f"      - model: {names['c']}\n        layer_range: [0, {layers}]\n"
               "        parameters: {weight: 0.4, density: 0.5}\n")
    return (f"merge_method: ties\nbase_model: {names['a']}\nslices:\n"
            + "".join(f"  - sources:\n{sources}" for _ in range(copies)) + "dtype: float32\n")


@contextmanager
def cluster(head_cpus: int, workers: int, *, pin: bool = False) -> Iterator[str]:
    """A Ray cluster on this machine: a head with ``head_cpus`` CPUs and ``workers`` one-CPU nodes; its address.
    ``pin``: each worker node is a machine with a core of its own, the first node on this process's first allowed
    core, the next on the next: its raylet is started pinned to that core (CPU affinity), so every process it
    starts (its workers) inherits the pin. The head and the driver stay where they are."""
    import ray
    from ray.cluster_utils import Cluster

    cores = sorted(os.sched_getaffinity(0))
    if pin and workers > len(cores):
        raise SystemExit(f"{workers} pinned nodes need {workers} cores; this process may use {len(cores)}")
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus})
    for index in range(workers):
        with on_cores({cores[index]} if pin else set(cores)):
            made.add_node(num_cpus=1)
    made.wait_for_nodes()
    ray.init(address=made.address, log_to_driver=False)
    try:
        yield made.address
    finally:
        ray.shutdown()
        made.shutdown()


@contextmanager
def on_cores(cores: set[int]) -> Iterator[None]:
    """The calling thread (and every process it starts meanwhile) allowed on ``cores`` only."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass(frozen=True)
class Run:
    """One timed ``resumerge run``: wall and CPU seconds (all, and the driver's own), the load average before and
    after, the output's digest, the CPU seconds by the cores the processes were allowed on
    (:meth:`CpuSampler.by_cores`), and where its wall went (:func:`phases`)."""

    wall: float
    cpu: float
    driver: float
    load: tuple[float, float]
    digest: str
    by_cores: str
    phases: str


class CpuSampler:
    """CPU seconds (user and system) of this process's descendants while it runs, sampled every 0.2 s: a process's
    last sample counts, so one that ends between samples loses at most 0.2 s (Ray's worker processes are not this
    process's children: their rusage never reaches it)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, float], float] = {}
        self.cores: dict[tuple[int, float], str] = {}  # the cores each process may run on
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> CpuSampler:
        self.base = self._snapshot()  # what the cluster's processes spent before the run
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        self._record()

    def seconds(self, pid: int | None = None) -> float:
        """The CPU seconds of the run's processes, or of process ``pid`` alone."""
        return sum(cpu - self.base.get(key, 0.0) for key, cpu in self.seen.items() if pid in (None, key[0]))

    def by_cores(self) -> str:
        """The run's CPU seconds by the cores its processes were allowed on (a pinned node's processes, its raylet
        and workers, on its core; the head's and the driver's on all): ``0: 9.1 s, 0,1: 3.2 s``."""
        spent: dict[str, float] = {}
        for key, cpu in self.seen.items():
            cores = self.cores.get(key, "?")
            spent[cores] = spent.get(cores, 0.0) + cpu - self.base.get(key, 0.0)
        return ", ".join(f"{cores}: {cpu:.1f} s" for cores, cpu in sorted(spent.items(), key=lambda i: len(i[0])))

    def _snapshot(self) -> dict[tuple[int, float], float]:
        found = {}
        for proc in psutil.Process().children(recursive=True):
            try:
                times = proc.cpu_times()
                key = (proc.pid, proc.create_time())
                found[key] = times.user + times.system
                if key not in self.cores:
                    self.cores[key] = ",".join(map(str, proc.cpu_affinity()))
            except psutil.Error:
                continue
        return found

    def _record(self) -> None:
        for key, cpu in self._snapshot().items():
            self.seen[key] = max(cpu, self.seen.get(key, 0.0))

    def _sample(self) -> None:
        while not self.done.wait(0.2):
            self._record()


def run(config: Path, work: Path, label: str, *args: str, hub: HubWriter | None = None) -> Run:
    """One fresh ``resumerge run``, timed (into ``hf://bench/LABEL`` on ``hub`` when given, dropped after)."""
    out, state = work / f"out-{label}", work / f"state-{label}"
    target = f"hf://bench/{label}" if hub is not None else str(out)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)
    load = os.getloadavg()[0]
    started, started_at = time.monotonic(), time.time()
    with CpuSampler() as cpu:
        driver = subprocess.Popen([sys.executable, "-m", "resumerge", "run", str(config), target, "--state-dir",
                                   str(state), "--quiet", *args])
        if driver.wait():
            raise subprocess.CalledProcessError(driver.returncode, driver.args)
    wall = time.monotonic() - started
    digest = hashlib.sha256()
    if hub is not None:
        for name, data in sorted(hub.head_files(f"bench/{label}").items()):
            digest.update(name.encode() + data)
        hub.hub.drop(f"bench/{label}")
    else:
        for path in sorted(out.iterdir()):
            if path.is_file():
                digest.update(path.name.encode() + path.read_bytes())
        shutil.rmtree(out)
    by_cores = cpu.by_cores()
    return Run(wall, cpu.seconds(), cpu.seconds(driver.pid), (load, os.getloadavg()[0]), digest.hexdigest()[:16],
               by_cores, phases(state, started_at, wall))


def phases(state: Path, started_at: float, wall: float) -> str:
    """Where a Ray run's wall went, from its ledger: the driver's start (imports, plan, joining the cluster) until
    the ledger is made; then until the first shard is journaled (the workers' start and their first shards); the
    other shards; the end (side files, the workers stopped). Each node's shards, and its rate over them (its
    bytes over its tasks' seconds: the writer's span of each shard). Empty for a local run (no ``node`` events)."""
    ledger = next(state.rglob("ledger.db"))
    db = sqlite3.connect(ledger)
    try:
        made = float(db.execute("SELECT MIN(created_at) FROM run").fetchone()[0])
        events = db.execute("SELECT at, data FROM events WHERE kind = 'node' ORDER BY id").fetchall()
    finally:
        db.close()
    if not events:
        return ""
    first, last = events[0][0], events[-1][0]
    nodes: dict[str, list[int]] = {}
    for _, data in events:
        row = json.loads(data)
        tally = nodes.setdefault(row["node"], [0, 0, 0])
        tally[0] += 1
        tally[1] += row["bytes"]
        tally[2] += int(row["seconds"] * 1000)
    per_node = ", ".join(f"{shards} on {node} ({nbytes / max(ms, 1) / 1000:.0f} MB/s)"
                         for node, (shards, nbytes, ms) in sorted(nodes.items()))
    return (f"start to plan {made - started_at:.1f} s, to first shard {first - made:.1f} s, "
            f"{len(events) - 1} more {last - first:.1f} s, end {started_at + wall - last:.1f} s; shards {per_node}")


def cold_and_warm(config: Path, work: Path, label: str, runs: int, *args: str,
                  hub: HubWriter | None = None) -> tuple[list[Run], list[Run]]:
    """``runs`` Ray runs that keep no worker (cold), a priming run that keeps them (not timed), then ``runs`` runs
    on the kept workers (warm), on the cluster ``args`` name (into ``hub`` when given)."""
    cold = [run(config, work, label, *args, "--keep-workers", "0", hub=hub) for _ in range(runs)]
    run(config, work, label, *args, hub=hub)
    warm = [run(config, work, label, *args, hub=hub) for _ in range(runs)]
    return cold, warm


def overhead(names: dict[str, Path], work: Path, runs: int, shards: tuple[str, ...]) -> list[list[Run]]:
    """Local runs, then Ray runs on one node with the machine's CPUs, cold and warm."""
    config = work / "linear.yml"
    config.write_text(LINEAR.format(**names))
    cpus = os.cpu_count() or 1
    local = [run(config, work, "local", *shards) for _ in range(runs)]
    with cluster(cpus, 0) as address:
        cold, warm = cold_and_warm(config, work, "ray", runs, *shards, "--executor", "ray", "--ray-address", address)
    return [local, cold, warm]


def nodes(names: dict[str, Path], work: Path, runs: int, shards: tuple[str, ...], copies: int = 0) -> list[list[Run]]:
    """Ray runs on two one-CPU worker nodes, each pinned to a core of its own, then on one (pinned to one core), each
    cold and warm; of the TIES merge, or (``copies``) of its layers stacked that many times."""
    config = work / ("ties.yml" if not copies else f"ties-stacked-{copies}.yml")
    config.write_text(TIES.format(**names) if not copies else ties_stacked(names, copies))
    ray = ("--executor", "ray", "-j", "1")
    with cluster(0, 2, pin=True) as address:
        two = cold_and_warm(config, work, "two", runs, *shards, *ray, "--ray-address", address)
    with cluster(0, 1, pin=True) as address:
        one = cold_and_warm(config, work, "one", runs, *shards, *ray, "--ray-address", address)
        other = sorted(os.sched_getaffinity(0))[1:2]
        beside = []
        for _ in range(runs if other else 0):
            with twin(config, work, other[0], *shards):
                beside.append(run(config, work, "one-beside", *shards, *ray, "--ray-address", address))
    return [*two, *one, beside]


@contextmanager
def twin(config: Path, work: Path, core: int, *args: str) -> Iterator[None]:
    """The same merge run locally with one thread, over and over, on ``core`` (the core the one-node series leaves
    to the head and the driver) while the body runs: what the second node's work costs the first one on this
    machine, where the emulated nodes share one memory bus and cache (on separate machines they would not)."""
    stop = threading.Event()

    def again() -> None:
        while not stop.is_set():
            out, state = work / "out-twin", work / "state-twin"
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(state, ignore_errors=True)
            proc = subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-m", "resumerge", "run", str(config),
                                     str(out), "--state-dir", str(state), "--quiet", "-j", "1", *args])
            while proc.poll() is None:
                if stop.wait(0.1):
                    proc.kill()
                    proc.wait()

    thread = threading.Thread(target=again, daemon=True)
    thread.start()
    try:
        time.sleep(3.0)  # past the twin's own start and plan: it computes when the timed run begins
        yield
    finally:
        stop.set()
        thread.join()


def hubnodes(names: dict[str, Path], work: Path, runs: int, shards: tuple[str, ...], down: float,
             up: float) -> list[list[Run]]:
    """Ray runs hub to hub through the stand-in hub throttled per connection, on two one-CPU worker nodes, then on
    one. The nodes take the stand-in's address and a token from this process's environment (set before the clusters
    start), as real nodes would from theirs; uploads go through the stand-in's LFS API (its link paces them)."""
    fake = FakeHub(link=Link(down=down * MB, up=up * MB, per_connection=True))
    writer = HubWriter.attach(fake)
    writer.add_token(TOKEN, "bench")
    for key in ("a", "b"):
        fake.push(f"bench/{key}", sparse_files_of(names[key], hashed_below=1 << 62))
    config = work / "hub-linear.yml"
    config.write_text(LINEAR.format(a="bench/a", b="bench/b"))
    ray = ("--executor", "ray", "-j", "1", "--stream-inputs")
    with fake:
        os.environ.update({"HF_ENDPOINT": fake.url, "HF_TOKEN": TOKEN, "HF_HOME": str(work / "hf"),
                           "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
        with cluster(0, 2) as address:
            two = cold_and_warm(config, work, "hub-two", runs, *shards, *ray, "--ray-address", address, hub=writer)
        with cluster(0, 1) as address:
            one = cold_and_warm(config, work, "hub-one", runs, *shards, *ray, "--ray-address", address, hub=writer)
    return [*two, *one]


NODES = ("ray, two one-CPU nodes, cold", "ray, two one-CPU nodes, warm", "ray, one one-CPU node, cold",
         "ray, one one-CPU node, warm")
NODE_RATIOS = (("two nodes / one node, cold", 0, 2), ("two nodes / one node, warm", 1, 3))
# The control: one node whose core's neighbour does the same work, as each of two nodes' does (nodes, bignodes).
BESIDE = "ray, one one-CPU node, its neighbour core running the same merge, warm"
BESIDE_RATIO = ("two nodes / one node beside a twin (this machine's shared memory taken out), warm", 1, 4)
# case -> (how it runs, the labels of its series, the ratios (what, series over series), the goal)
CASES = {
    "overhead": (overhead, ("local", "ray, one node of all CPUs, cold", "ray, one node of all CPUs, warm"),
                 (("ray / local, cold", 1, 0), ("ray / local, warm", 2, 0)), 1.15),
    "nodes": (nodes, (*NODES, BESIDE), (*NODE_RATIOS, BESIDE_RATIO), 0.6),
    "bignodes": (nodes, (*NODES, BESIDE), (*NODE_RATIOS, BESIDE_RATIO), 0.6),
    "hubnodes": (hubnodes, tuple(label.replace("ray, ", "ray hub to hub, ") for label in NODES), NODE_RATIOS, 0.6),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=(*CASES, "all"), nargs="?", default="all")
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-ray"))
    parser.add_argument("--out-shard-size", default="100M",
                        help="output shards (a shard is a unit of work: 1B would make the bench output one shard)")
    parser.add_argument("--hub-down", type=float, default=1.0, help="hubnodes: MB/s per connection, down (4 per node)")
    parser.add_argument("--hub-up", type=float, default=8.0, help="hubnodes: MB/s per connection, up (1 per node)")
    parser.add_argument("--copies", type=int, default=2, help="bignodes: how many times the layers are stacked")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    names = {k: args.models / k for k in "abc"}
    shards = ("--out-shard-size", args.out_shard_size)
    verdicts = []
    for case in CASES if args.case == "all" else (args.case,):
        measure, labels, ratios, goal = CASES[case]
        extra = {"hubnodes": (args.hub_down, args.hub_up), "bignodes": (args.copies,)}.get(case, ())
        series = measure(names, args.work, args.runs, shards, *extra)
        for label, runs in zip(labels, series):
            for r in runs:
                print(f"{case}: {label}: {r.wall:.1f} s wall, {r.cpu:.1f} s CPU (driver {r.driver:.1f} s), load "
                      f"{r.load[0]:.1f} -> {r.load[1]:.1f}, output {r.digest}\n    CPU by cores {r.by_cores}"
                      + (f"\n    {r.phases}" if r.phases else ""), flush=True)
        assert len({r.digest for runs in series for r in runs}) == 1, f"{case}: the outputs differ"
        # Each ratio is the cheaper-wanted series over the other: ray over local, two nodes over one.
        for what, first, second in ratios:
            wall = statistics.median(r.wall for r in series[first]) / statistics.median(r.wall for r in series[second])
            cpu = statistics.median(r.cpu for r in series[first]) / statistics.median(r.cpu for r in series[second])
            verdicts.append(f"{case}: {what} {wall:.2f}x wall (goal <= {goal}x: "
                            f"{'met' if wall <= goal else 'missed'}), {cpu:.2f}x CPU seconds")
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The Ray executor's cost and gain (issue 46), on Ray clusters started on this machine.

Usage: ``python bench/bench_ray.py CASE --models DIR [--runs N] [--work DIR]``, where DIR holds the bench models
``a``, ``b`` and ``c`` (``/work/benchwork/models-940646400``: three ~941 MB fp32 Llama-style models) and CASE is

- ``overhead``: ``resumerge run`` of a linear merge of ``a`` and ``b`` with the local executor, then with
  ``--executor ray`` on one Ray node with the machine's CPUs (goal: at most 1.15x the local wall);
- ``nodes``: a TIES merge of ``a``, ``b``, ``c`` (compute-bound) with ``--executor ray -j 1`` on two one-CPU
  worker nodes, then on one (goal: two nodes at most 0.6x one node's wall).

Output shards of ``--out-shard-size`` (100M: about ten tasks). Every run is a fresh ``resumerge run`` process (a
new Ray job: its workers import torch afresh, as a user's run would) into a fresh OUT and state dir; the cluster is
started once per configuration and not timed. The outputs of each case are compared byte for byte. Prints one
line per run and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench_linear import CONFIG as LINEAR  # the same linear merge of a and b

TIES = """merge_method: ties
base_model: {a}
models:
  - model: {b}
    parameters: {{weight: 0.6, density: 0.5}}
  - model: {c}
    parameters: {{weight: 0.4, density: 0.5}}
dtype: float32
"""


@contextmanager
def cluster(head_cpus: int, workers: int) -> Iterator[str]:
    """A Ray cluster on this machine: a head with ``head_cpus`` CPUs and ``workers`` one-CPU nodes; its address."""
    import ray
    from ray.cluster_utils import Cluster

    made = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus})
    for _ in range(workers):
        made.add_node(num_cpus=1)
    made.wait_for_nodes()
    ray.init(address=made.address, log_to_driver=False)
    try:
        yield made.address
    finally:
        ray.shutdown()
        made.shutdown()


def run(config: Path, work: Path, label: str, *args: str) -> tuple[float, str]:
    """One fresh ``resumerge run``; (wall seconds, a digest of every output file)."""
    out, state = work / f"out-{label}", work / f"state-{label}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "resumerge", "run", str(config), str(out), "--state-dir", str(state),
                    "--quiet", *args], check=True)
    wall = time.monotonic() - started
    digest = hashlib.sha256()
    for path in sorted(out.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    shutil.rmtree(out)
    return wall, digest.hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=("overhead", "nodes"))
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-ray"))
    parser.add_argument("--out-shard-size", default="100M",
                        help="output shards (a shard is a task: 1B would make the bench output one task)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    names = {k: args.models / k for k in "abc"}
    load = os.getloadavg()[0]
    shards = ("--out-shard-size", args.out_shard_size)
    if args.case == "overhead":
        config = args.work / "linear.yml"
        config.write_text(LINEAR.format(**names))
        cpus = os.cpu_count() or 1
        first = [run(config, args.work, "local", *shards) for _ in range(args.runs)]
        with cluster(cpus, 0) as address:
            second = [run(config, args.work, "ray", *shards, "--executor", "ray", "--ray-address", address)
                      for _ in range(args.runs)]
        labels = ("local", f"ray, one node of {cpus} CPUs")
    else:
        config = args.work / "ties.yml"
        config.write_text(TIES.format(**names))
        with cluster(0, 2) as address:
            first = [run(config, args.work, "two", *shards, "--executor", "ray", "--ray-address", address,
                         "-j", "1") for _ in range(args.runs)]
        with cluster(0, 1) as address:
            second = [run(config, args.work, "one", *shards, "--executor", "ray", "--ray-address", address,
                          "-j", "1") for _ in range(args.runs)]
        labels = ("ray, two one-CPU nodes", "ray, one one-CPU node")
    for label, runs in zip(labels, (first, second)):
        for wall, digest in runs:
            print(f"{label}: {wall:.1f} s, output {digest}")
    assert len({d for _, d in first + second}) == 1, "the outputs differ"
    a, b = statistics.median(w for w, _ in first), statistics.median(w for w, _ in second)
    ratio = b / a if args.case == "overhead" else a / b
    what = "ray / local" if args.case == "overhead" else "two nodes / one node"
    print(f"{what}: {ratio:.2f}x (load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

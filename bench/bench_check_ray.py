"""``resumerge check`` in this process against ``check --executor ray`` on a local Ray cluster, same models.

Usage::

    python bench/bench_check_ray.py [--parents 1] [--nodes 3] [--cpus-per-node 1] [--runs 2] [--work DIR]
                                    [--no-base] [--alone] [--longer N]

The models are bench/bench_check.py's: SmolLM2-135M-Instruct in float32 as the base, ``--parents`` nudged
copies and their mean as the merge (2 + parents models). A Ray cluster is started on this machine
(``ray.cluster_utils.Cluster``: a head without CPUs and ``--nodes`` worker nodes of ``--cpus-per-node`` CPUs), then,
alternating, ``--runs`` times each: ``resumerge check MERGE --base BASE --parent P... --prompts TEXTS --json`` in a
fresh state dir, locally and with ``--executor ray --ray-address`` (each a fresh CLI process; the Ray one starts
its actors, one per model, each importing torch, and transformers only for a family the forward engine's native
modules do not build). Prints each run's wall time and whether the two reports' figures agree (to 1e-6: the local
check's torch threads are the machine's, each actor's its node's CPUs).

``--no-base``: the merge checked against its parents only (``--parents 1 --nodes 2``: two models, one a node).
``--alone``: also the merge checked alone (its layers run once each) and the same check in this process, both on one
thread (``OMP_NUM_THREADS=1``): in a check the merge's layers run twice (on its own hidden states and on the
reference's), the reference's once, so on one-CPU nodes the Ray pass should take the merge's share (two runs a layer)
while the one-thread local check takes every model's, one after another: the issue's "a check takes about one
model's pass" (on 2 cores, measurable for two models on two one-CPU nodes).

On one machine the "nodes" share its cores: the figure says what the Ray path costs (actor start, hidden states
through the object store), not what separate machines would give.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from bench_check import TEXTS, _make  # noqa: E402


def _check(argv: list[str], env: dict[str, str], state: Path) -> tuple[float, float, dict[str, object]]:
    """The check's wall seconds, the seconds from its first layer on (the progress file's ``forward`` phase, read
    every 50 ms: the layers and the heads, without the start, the static pass and the actors' start), and its
    report."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    forward = None
    while process.poll() is None:
        if forward is None:
            for path in state.glob("checks/*/progress.json"):
                try:
                    if json.loads(path.read_text()).get("phase") == "forward":
                        forward = time.perf_counter()
                except ValueError:
                    pass
        time.sleep(0.05)
    out, err = process.communicate()
    wall = time.perf_counter() - start
    if process.returncode not in (0, 5, 6):
        raise SystemExit(f"check failed ({process.returncode}): {err[-2000:]}")
    doc: dict[str, object] = json.loads(out)
    return wall, time.perf_counter() - (forward or start), doc


def _close(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a if k not in ("chart", "card"))
    return a == b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parents", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--cpus-per-node", type=int, default=1)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--no-base", action="store_true", help="check the merge against its parents only")
    parser.add_argument("--alone", action="store_true", help="also the merge alone on one thread")
    parser.add_argument("--longer", type=int, default=1, help="each text repeated this many times (more tokens: "
                        "more work a layer against the per-layer round trips)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "resumerge-bench-check")
    args = parser.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    base, parents, merge = _make(args.work, args.parents)
    texts = args.work / "texts-ray.txt"
    texts.write_text("\n".join(" ".join([t.replace("\n", " ")] * args.longer) for t in TEXTS) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=args.cpus_per_node)
        cluster.wait_for_nodes()
        for run in range(args.runs):
            walls, passes, docs = {}, {}, {}
            others = ([] if args.no_base else ["--base", str(base)]) + [
                a for p in parents for a in ("--parent", str(p))]
            ways = [("local", others, env), ("ray", [*others, "--executor", "ray", "--ray-address", cluster.address],
                                             env)]
            if args.alone:
                ways += [("alone", [], {**env, "OMP_NUM_THREADS": "1"}),
                         ("local1", others, {**env, "OMP_NUM_THREADS": "1"})]
            for where, extra, how in ways:
                state = Path(tempfile.mkdtemp(prefix="check-state-"))
                argv = [sys.executable, "-m", "resumerge", "check", str(merge), "--prompts", str(texts), "--json",
                        "--state-dir", str(state), *extra]
                walls[where], passes[where], docs[where] = _check(argv, how, state)
            same = _close(docs["local"], docs["ray"])
            print(f"run {run}: local {walls['local']:.1f} s (layers and heads {passes['local']:.1f} s), ray "
                  f"({args.nodes} nodes x {args.cpus_per_node} CPU) {walls['ray']:.1f} s (layers and heads "
                  f"{passes['ray']:.1f} s), wall ratio {walls['ray'] / walls['local']:.2f}, figures agree to 1e-6: "
                  f"{same}, verdict {docs['ray']['verdict']}"
                  + (f"; the merge alone on one thread {walls['alone']:.1f} s (layers and heads "
                     f"{passes['alone']:.1f} s); the check on one thread here {walls['local1']:.1f} s (layers and "
                     f"heads {passes['local1']:.1f} s)" if args.alone else ""))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()

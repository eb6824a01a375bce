"""The MoE hidden-state gates' actor on Ray: how long the placed prompt pass waits for its actor, a fresh one
(``keep`` 0, as before) against a node's kept worker hosting it (``keep``: the executor's ``--keep-workers``), on
one cluster, alternated.

Usage::

    python bench/bench_moe_ray_actor.py MODEL [--pairs 4] [--workers 2]

Starts a Ray cluster on this machine as the tests do (tests/raycluster.py: a head without CPUs, one-CPU worker
nodes), this process its driver; then, alternating, enters and leaves the pass's placement of MODEL's layers
(as :func:`resumerge.forward.placing.rayactor.placing` places it: the actor placed, started, its model opened) with
``keep`` 0 (what the MoE pass does) and 600 s (a node's kept worker, as check's passes lease), timing the entry
(what the pass waits for before its first layer) and the exit. The first kept entry makes the node's kept worker;
the later ones find it idle, as a second MoE run on a user's cluster would. Prints one JSON
line per entry, the means, and ``os.getloadavg()``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from resumerge.config.locations import StateDir
    from resumerge.forward.opening.opened import open_for_pass
    from resumerge.forward.placing.onray import ray_places
    from resumerge.forward.placing.rayactor import ray_models
    from resumerge.machine.torch_import import IMPORT_RESERVE

    fast = {"health_check_period_ms": 500, "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 0,
            "prestart_worker_first_driver": False, "enable_worker_prestart": False}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "_system_config": fast, "no_monitor": True, "include_log_monitor": False,
        "include_dashboard": False})
    try:
        for _ in range(args.workers):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        with tempfile.TemporaryDirectory(prefix="bench-moe-ray-") as state:
            base = open_for_pass(str(args.model), "base_model", StateDir.resolve(state))
            layers = int(base.opened.config["num_hidden_layers"])
            rows = []
            for pair in range(args.pairs):
                for keep in (0.0, 600.0) if pair % 2 == 0 else (600.0, 0.0):
                    load = os.getloadavg()
                    start = time.perf_counter()
                    # as resumerge.forward.placing.rayactor.placing places the pass, with the kept workers' keep
                    where = ray_places(cluster.address, [IMPORT_RESERVE + (64 << 20)], what="prompt forward pass")
                    with ray_models([base], where, layers, dtype=torch.bfloat16, what="prompt forward pass",
                                    beside=True, keep=keep):
                        entered = time.perf_counter() - start
                    left = time.perf_counter() - start - entered
                    row = {"pair": pair + 1, "keep": keep, "enter": round(entered, 2), "leave": round(left, 2),
                           "load": [round(x, 1) for x in load]}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            for keep in (0.0, 600.0):
                got = [r for r in rows if r["keep"] == keep and r["pair"] > 1]  # the first kept one makes it
                print(f"keep {keep:5.0f}: enter {sum(r['enter'] for r in got) / len(got):.2f} s, leave "
                      f"{sum(r['leave'] for r in got) / len(got):.2f} s (mean of pairs 2-{args.pairs})")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()

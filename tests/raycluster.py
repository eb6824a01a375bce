"""A real multi-node Ray cluster on this machine for the tests that need one (tests/test_ray_executor.py, the
check's tests/check/test_ray_check.py): a head without CPUs and one-CPU worker nodes, this process its driver."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Cluster:
    """The test's Ray cluster: its address and its worker nodes."""

    address: str
    workers: tuple[Any, ...]

    def node_ids(self) -> set[str]:
        """The worker nodes' ids as the ledger's ``node`` events (and a check's ``status``) name them."""
        return {node.node_id[:8] for node in self.workers}


@contextmanager
def ray_cluster(workers: int = 2, memory: int | None = None) -> Iterator[tuple[Cluster, Any]]:
    """A head without CPUs and ``workers`` one-CPU worker nodes (each declaring ``memory`` bytes to Ray where
    given; Ray's default: 70% of the machine's available memory), this process connected to it as the driver."""
    import ray
    from ray.cluster_utils import Cluster as RayCluster

    # A node whose raylet died is declared dead within about 1.5 s (Ray's default is 15 s).
    fast = {"health_check_period_ms": 500, "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 0}
    started = RayCluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": fast})
    try:
        sized = {} if memory is None else {"memory": memory}
        nodes = tuple(started.add_node(num_cpus=1, **sized) for _ in range(workers))
        started.wait_for_nodes()
        if ray.is_initialized():  # a test before, in this worker, left its driver connected (as a notebook's stays)
            ray.shutdown()
        ray.init(address=started.address, log_to_driver=False)
        yield Cluster(started.address, nodes), started
    finally:
        ray.shutdown()
        started.shutdown()

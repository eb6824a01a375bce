"""A real multi-node Ray cluster on this machine for the tests that need one (tests/test_ray_executor.py, the
check's tests/check/test_ray_check.py, ...): a head without CPUs and one-CPU worker nodes, this process its driver.

Starting a head costs 10-20 s, so a test process starts one (:class:`RayHead`, the ``ray_head`` fixture of
tests/conftest.py) and every Ray test it runs joins it; each test gets worker nodes of its own, started as it asks
for them and removed as it ends. So a test sees only its own nodes with CPUs (Ray places on those only), no actor,
kept worker or memory reservation a test before left (each lived on a node that is gone, or ended with that test's
driver), and its nodes' processes start with its environment (the stand-in hub's address, a token), as a machine's
``ray start`` gives its node the machine's."""

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


class RayHead:
    """This test process's Ray head (a ``ray.cluster_utils.Cluster`` without worker nodes), started on first use
    and stopped by :meth:`stop` (tests/conftest.py stops it once the next test needs none, and as the session
    ends)."""

    def __init__(self) -> None:
        self._started: Any = None

    def started(self) -> Any:
        """The head's ``Cluster``, started now where none runs."""
        if self._started is None:
            from ray.cluster_utils import Cluster as RayCluster

            # A node whose raylet died is declared dead within about 1.5 s (Ray's default is 15 s).
            fast = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                    "health_check_initial_delay_ms": 0}
            self._started = RayCluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": fast})
        return self._started

    def stop(self) -> None:
        """Stop the head's processes, if it runs."""
        if self._started is not None:
            started, self._started = self._started, None
            started.shutdown()


@contextmanager
def ray_cluster(head: RayHead, workers: int = 2, memory: int | None = None) -> Iterator[tuple[Cluster, Any]]:
    """``head`` with ``workers`` one-CPU worker nodes of this test's own (each declaring ``memory`` bytes to Ray
    where given; Ray's default: 70% of the machine's available memory), this process connected to it as the
    driver. Yields the test's cluster and the ``ray.cluster_utils.Cluster`` (to remove a node mid-run); on the
    way out the driver disconnects and the worker nodes left are removed, the head seeing them gone."""
    import ray

    started = head.started()
    nodes: list[Any] = []
    try:
        sized = {} if memory is None else {"memory": memory}
        for _ in range(workers):  # started side by side: each node's raylet and agents mostly wait as they start
            nodes.append(started.add_node(wait=False, num_cpus=1, **sized))
        started.wait_for_nodes()
        if ray.is_initialized():  # a test before, in this worker, left its driver connected (as a notebook's stays)
            ray.shutdown()
        ray.init(address=started.address, log_to_driver=False)
        yield Cluster(started.address, tuple(nodes)), started
    finally:
        ray.shutdown()
        for node in nodes:
            if node in started.worker_nodes:  # not removed by the test itself
                started.remove_node(node)
        started.wait_for_nodes()  # the head knows them dead: the next test's driver lists none of them alive

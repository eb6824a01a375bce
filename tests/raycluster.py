"""A real multi-node Ray cluster on this machine for the tests that need one (tests/test_ray_executor.py, the
check's tests/check/test_ray_check.py, ...): a head without CPUs and one-CPU worker nodes, this process its driver.

Starting a head costs 10-20 s, so a test process starts one (:class:`RayHead`, the ``ray_head`` fixture of
tests/conftest.py) and every Ray test it runs joins it; each test gets worker nodes of its own, started as it asks
for them and removed as it ends. So a test sees only its own nodes with CPUs (Ray places on those only), no actor,
kept worker or memory reservation a test before left (each lived on a node that is gone, or ended with that test's
driver), and its nodes' processes start with its environment (the stand-in hub's address, a token), as a machine's
``ray start`` gives its node the machine's.

A test whose nodes need nothing of its own environment (local models, paths given explicitly) may ask for ``spare``
nodes: the nodes it leaves are kept for the next such test (each node costs a raylet and two agent processes, about
2 s of CPU and seconds of wall to start and stop), which takes them once they are idle again (no CPU or memory held
but the idle kept workers' own: the actors of the test before ended with its driver; else it starts fresh ones). So
the kept workers a spare test's passes left host the next one's, as they would a second pass on a user's cluster. A
test that asks otherwise, or for fewer, has the spare nodes it does not take removed first, so every test still sees
only its own nodes. A test that fails leaves no spare node. Spare nodes serve only a test whose settings they were
started with (:func:`node_settings`: the hub's, huggingface_hub's, transformers' and resumerge's variables, the
per-test folders aside): their processes keep the environment they started with, so a test that needs its own (the
stand-in hub's, with ``HF_HUB_OFFLINE`` unset) took nodes whose kept workers still ran offline, and failed only after
the tests that left them. A module whose Ray tests ask for spare nodes says so
(``RAY_SPARE_NODES = True``): tests/conftest.py runs those modules one after the other, before the other Ray
modules, so that the nodes one leaves serve the next."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# The environment variables that set what a node's processes do (the hub's endpoint, offline mode, a token, a kill
# point), by prefix; the per-test folders among them (``HF_HOME``, ``RESUMERGE_STATE_DIR``...) change nothing a test
# that takes spare nodes reads, and differ for every test.
_SETTINGS = ("HF_", "HUGGING_FACE_", "HUGGINGFACE_", "TRANSFORMERS_", "RESUMERGE_")
_FOLDERS = ("_HOME", "_CACHE", "_PATH", "_DIR")


def node_settings(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The settings in ``environ`` that a node started with it gives its processes (see :data:`_SETTINGS`)."""
    return tuple(sorted((name, value) for name, value in environ.items()
                        if name.startswith(_SETTINGS) and not name.endswith(_FOLDERS)))


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
        self._spare: list[Any] = []  # worker nodes a ``spare`` test left, for the next one
        self._spare_memory: int | None = None  # the memory they declare (None: Ray's default)
        self._spare_settings: tuple[tuple[str, str], ...] = ()  # the environment's settings they started with

    def started(self) -> Any:
        """The head's ``Cluster``, started now where none runs."""
        if self._started is None:
            from ray.cluster_utils import Cluster as RayCluster

            # A node whose raylet died is declared dead within about 1.5 s (Ray's default is 15 s). No idle worker
            # process is started ahead on a node as each test's driver connects (each imports Ray, half a second of
            # CPU, and most were never used: every actor here imports torch in a worker of its own job).
            fast = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                    "health_check_initial_delay_ms": 0, "prestart_worker_first_driver": False,
                    "enable_worker_prestart": False}
            # Neither the autoscaler's monitor, the log monitor (the drivers read no worker's log: log_to_driver is
            # off) nor the dashboard's modules: processes that cost CPU all along and serve no test.
            self._started = RayCluster(initialize_head=True, head_node_args={
                "num_cpus": 0, "_system_config": fast, "no_monitor": True, "include_log_monitor": False,
                "include_dashboard": False})
        return self._started

    def take_spare(self, wanted: int, memory: int | None, settings: tuple[tuple[str, str], ...]) -> list[Any]:
        """Up to ``wanted`` of the spare nodes (declaring ``memory``, started with ``settings``), the others
        removed."""
        taken: list[Any] = []
        if self._spare and self._spare_memory == memory and self._spare_settings == settings:
            taken, self._spare = self._spare[:wanted], self._spare[wanted:]
        self.drop_spare()
        return taken

    def keep_spare(self, nodes: list[Any], memory: int | None, settings: tuple[tuple[str, str], ...]) -> None:
        """Keep ``nodes`` (declaring ``memory``, started with ``settings``) for the next test that asks for spare
        nodes with the same."""
        self.drop_spare()
        self._spare, self._spare_memory, self._spare_settings = list(nodes), memory, settings

    def drop_spare(self) -> None:
        """Remove the spare nodes."""
        spare, self._spare = self._spare, []
        if spare and self._started is not None:
            for node in spare:
                if node in self._started.worker_nodes:
                    self._started.remove_node(node)
            self._started.wait_for_nodes()

    def stop(self) -> None:
        """Stop the head's processes, if it runs."""
        if self._started is not None:
            started, self._started, self._spare = self._started, None, []
            started.shutdown()


@contextmanager
def ray_cluster(head: RayHead, workers: int = 2, memory: int | None = None,
                spare: bool = False) -> Iterator[tuple[Cluster, Any]]:
    """``head`` with ``workers`` one-CPU worker nodes of this test's own (each declaring ``memory`` bytes to Ray
    where given; Ray's default: 70% of the machine's available memory), this process connected to it as the
    driver. Yields the test's cluster and the ``ray.cluster_utils.Cluster`` (to remove a node mid-run); on the
    way out the driver disconnects and the worker nodes left are removed, the head seeing them gone. With ``spare``
    (see the module's docstring), the nodes come first from those a ``spare`` test before left, idle, and the ones
    left are kept for the next (one started with this test's settings: :func:`node_settings`)."""
    import ray

    started = head.started()
    # Every node this test uses runs with these: the spare ones it takes were started with them, fresh ones now.
    settings = node_settings(os.environ)
    nodes: list[Any] = head.take_spare(workers, memory, settings) if spare else []
    if not spare:
        head.drop_spare()
    reused, passed = len(nodes), False
    try:
        sized = {} if memory is None else {"memory": memory}
        for _ in range(workers - reused):  # started side by side: each node's raylet and agents mostly wait
            nodes.append(started.add_node(wait=False, num_cpus=1, **sized))
        started.wait_for_nodes()
        if ray.is_initialized():  # a test before, in this worker, left its driver connected (as a notebook's stays)
            ray.shutdown()
        ray.init(address=started.address, log_to_driver=False)
        if reused and not _idle(ray):  # an actor of the test before outlived its driver: fresh nodes instead
            for node in nodes:
                started.remove_node(node)
            nodes = [started.add_node(wait=False, num_cpus=1, **sized) for _ in range(workers)]
            started.wait_for_nodes()
        yield Cluster(started.address, tuple(nodes)), started
        passed = True
    finally:
        ray.shutdown()
        left = [node for node in nodes if node in started.worker_nodes]  # not removed by the test itself
        if spare and passed:
            head.keep_spare(left, memory, settings)
        else:
            for node in left:
                started.remove_node(node)
        started.wait_for_nodes()  # the head knows them dead: the next test's driver lists none of them alive


def _idle(ray: Any, seconds: float = 20.0) -> bool:
    """Whether, within ``seconds``, no CPU or memory of the cluster is held but the memory of the idle kept workers
    the tests before left (each declares its imports', and no CPU: resumerge.machine.cluster.kept): the actors and
    reservations of the test before, which ended with its driver, gone from the spare nodes."""
    deadline = time.monotonic() + seconds
    kept = _kept_memory(ray)
    while True:
        free, total = ray.available_resources(), ray.cluster_resources()
        if free.get("CPU", 0) >= total.get("CPU", 0) and free.get("memory", 0) + kept >= total.get("memory", 0):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _kept_memory(ray: Any) -> float:
    """The memory the kept workers of this code on the cluster's live nodes declare (each its imports')."""
    from resumerge.machine.cluster.keeper import run_digest
    from resumerge.machine.cluster.kept import NAMESPACE, SPARE_SLOTS, kept_name
    from resumerge.machine.cluster.launch import declared
    from resumerge.machine.torch_import import IMPORT_RESERVE

    code, held = run_digest(ray), 0.0
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        for slot in range(int(node["Resources"].get("CPU", 0)) + 2 * SPARE_SLOTS + 2):
            try:
                ray.get_actor(kept_name(code, node["NodeID"], slot), namespace=NAMESPACE)
            except ValueError:
                continue
            held += declared(IMPORT_RESERVE, node["Resources"])
    return held

"""tests/raycluster.py's spare worker nodes (no Ray needed: a stand-in for ``ray.cluster_utils.Cluster``): a node's
processes keep the environment they started with, so the nodes one test left serve the next only where its settings
are theirs. Before, a hub test on Ray (tests/hub/test_hub_ray_measure.py) took the nodes the check's and the passes'
tests left, started with ``HF_HUB_OFFLINE=1``: its nodes' hub reads failed, after those tests only."""

from __future__ import annotations

from typing import Any

from raycluster import RayHead, node_settings


class _Started:
    """The head's cluster, as much of it as :class:`RayHead` uses."""

    def __init__(self, nodes: list[str]) -> None:
        self.worker_nodes = list(nodes)

    def remove_node(self, node: Any) -> None:
        self.worker_nodes.remove(node)

    def wait_for_nodes(self) -> None:
        pass


def _head(nodes: list[str]) -> RayHead:
    head = RayHead()
    head._started = _Started(nodes)
    return head


def test_spare_nodes_serve_only_a_test_of_the_settings_they_started_with() -> None:
    offline = node_settings({"HF_HUB_OFFLINE": "1", "HF_HOME": "/t/a/hf", "PATH": "/bin"})
    online = node_settings({"HF_ENDPOINT": "http://127.0.0.1:4321", "HF_HOME": "/t/b/hf", "PATH": "/bin"})
    head = _head(["n1", "n2"])
    head.keep_spare(["n1", "n2"], None, offline)
    assert head.take_spare(2, None, online) == []  # started offline: not the hub test's
    assert head._started.worker_nodes == []  # removed, not left running for nobody


def test_spare_nodes_serve_the_next_test_of_the_same_settings_whatever_its_own_folders() -> None:
    head = _head(["n1", "n2", "n3"])
    head.keep_spare(["n1", "n2", "n3"], None, node_settings({"HF_HUB_OFFLINE": "1", "HF_HOME": "/t/a/hf",
                                                            "RESUMERGE_STATE_DIR": "/t/a/state"}))
    later = node_settings({"HF_HUB_OFFLINE": "1", "HF_HOME": "/t/b/hf", "RESUMERGE_STATE_DIR": "/t/b/state"})
    assert head.take_spare(2, None, later) == ["n1", "n2"]
    assert head._started.worker_nodes == ["n1", "n2"]  # the one not taken removed


def test_a_node_s_settings_are_the_hub_s_and_resumerge_s_variables_but_their_folders() -> None:
    assert node_settings({"HF_HUB_OFFLINE": "1", "HF_TOKEN": "t", "HF_HOME": "/h", "HF_HUB_CACHE": "/c",
                          "HF_TOKEN_PATH": "/p", "RESUMERGE_KILL_AT": "after_fsync", "RESUMERGE_STATE_DIR": "/s",
                          "TRANSFORMERS_OFFLINE": "1", "PATH": "/bin", "PYTEST_CURRENT_TEST": "x"}) == (
        ("HF_HUB_OFFLINE", "1"), ("HF_TOKEN", "t"), ("RESUMERGE_KILL_AT", "after_fsync"),
        ("TRANSFORMERS_OFFLINE", "1"))

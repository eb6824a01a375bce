"""Where ``check --executor ray`` places each model's actor, from the nodes Ray lists (no cluster: the placement is
arithmetic on ``ray.nodes()``): round-robin over the nodes with CPUs, most first, each node given only the actors
its declared memory holds; a cluster that cannot hold every actor at once is refused in one line (exit 2)."""

from __future__ import annotations

import pytest

from resumerge.errors import UsageError
from resumerge.forward.placing.onray import Place, places

GB = 1 << 30


def _node(name: str, cpus: float, memory: float, alive: bool = True) -> dict[str, object]:
    return {"NodeID": name, "Alive": alive, "Resources": {"CPU": cpus, "memory": memory}}


def test_each_model_on_a_node_of_its_own_where_memory_allows() -> None:
    nodes = [_node("a", 2, 8 * GB), _node("b", 4, 8 * GB), _node("c", 1, 8 * GB), _node("d", 8, 8 * GB, alive=False)]
    assert places(nodes, [3 * GB] * 3) == [Place("b", 4.0, 3 * GB), Place("a", 2.0, 3 * GB), Place("c", 1.0, 3 * GB)]
    # Four models on nodes of 1 CPU: round-robin, the node with two shares half a CPU each.
    two = [_node("a", 1, 8 * GB), _node("b", 1, 8 * GB)]
    assert places(two, [GB] * 3) == [Place("a", 0.5, GB), Place("b", 1.0, GB), Place("a", 0.5, GB)]
    # The second node holds one actor only: the third model goes where there is room, not where its turn is.
    assert places([_node("a", 1, 8 * GB), _node("b", 1, 5 * GB)], [3 * GB] * 3) == [
        Place("a", 0.5, 3 * GB), Place("b", 1.0, 3 * GB), Place("a", 0.5, 3 * GB)]


def test_a_cluster_that_cannot_hold_the_actors_is_refused_in_one_line() -> None:
    with pytest.raises(UsageError) as none:
        places([_node("a", 4, 2 * GB), _node("b", 1, 2.5 * GB)], [3 * GB, 3 * GB])
    assert none.value.exit_code == 2
    assert "needs 3.22 GB" in none.value.one_line() and "(the most: 2.68 GB)" in none.value.one_line()
    assert "\n" not in none.value.one_line()
    with pytest.raises(UsageError, match="hold 2 of the check's 3 models' actors at once"):
        places([_node("a", 4, 4 * GB), _node("b", 1, 4 * GB)], [3 * GB] * 3)
    with pytest.raises(UsageError, match="no node with CPUs"):
        places([_node("a", 0, 64 * GB)], [GB])

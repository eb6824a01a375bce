"""Which nodes made a run's shards: the ledger's ``node`` events, summed per node for ``status`` and the driver.

A run whose shards are computed on a cluster (``--executor ray``) keeps one ``node`` event per shard (data:
``node``, ``shard``, ``bytes``, ``seconds``, and ``threads`` and ``units``: torch's threads and the units at once its
worker computed with); a local run keeps none. A node's rate is its bytes over the seconds
its tasks took, so it says how fast that node works, whatever the others do.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

NODE_EVENT = "node"

# (node, shards, bytes, seconds its tasks took)
NodeTally = tuple[str, int, int, float]


def node_line(tally: NodeTally, size: Callable[[int], str]) -> str:
    """``node 5b35c442: 12 shards, 48.0 MB at 9.1 MB/s``, sizes written by ``size``."""
    node, shards, nbytes, seconds = tally
    rate = f" at {size(int(nbytes / seconds))}/s" if seconds > 0 else ""
    return f"node {node}: {shards} shard{'s' if shards != 1 else ''}, {size(nbytes)}{rate}"


def node_tallies(conn: sqlite3.Connection) -> tuple[NodeTally, ...]:
    """The shards, bytes and task seconds of each node in the ledger open on ``conn``, by node name (none for a
    local run)."""
    rows = conn.execute("SELECT json_extract(data, '$.node'), COUNT(*), SUM(json_extract(data, '$.bytes')), "
                        "SUM(json_extract(data, '$.seconds')) FROM events WHERE kind = ? GROUP BY 1 ORDER BY 1",
                        (NODE_EVENT,)).fetchall()
    return tuple((str(node), int(shards), int(nbytes or 0), float(seconds or 0))
                 for node, shards, nbytes, seconds in rows)

"""Every executor, one row each (:data:`EXECUTORS`), and where one places a forward pass (``check``, ``measure``,
``eval``, ``evolve``'s generations, the MoE gates): :meth:`~resumerge.merge.engine.executors.PlacesPasses.place_pass`
gives a :class:`PassPlace`, a small frozen value whose ``name`` is the executor's (``local``, ``ray``) and keys its
row, which names the pass's site (:mod:`resumerge.forward.placing.sites`, which this package may not import): where
every difference between executors' passes lives. :data:`HERE`: every model in this process, one after another (the
local executor, and the default). A new executor is its class and one row here."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class PassPlace:
    """Where a forward pass's models run: on the executor named ``name``; on a Ray cluster (``ray``), the one at
    ``address`` (None: ``RAY_ADDRESS``, else a Ray started here), an actor per model hosted by the nodes' kept
    workers that wait idle ``keep`` seconds once the pass ends (0: fresh actors, ended with it), ``stream`` the
    class, by name (``"module:Class"``), a kept worker made for the pass computes a later merge's shards with, as the
    executor names it (empty: no kept worker, fresh actors)."""

    name: str = "local"
    address: str | None = None
    keep: float = 0.0
    stream: str = ""


HERE = PassPlace()


@dataclass(frozen=True)
class ExecutorRow:
    """One ``--executor NAME``: ``makes`` its class (``module:Class``, imported when a command names it, made from
    the settings it has a field for: ``address`` from ``--ray-address``, ``keep_workers`` from ``--keep-workers``;
    None: this process, the default, which takes none), ``site`` the class its passes run under (``module:Class``,
    made from the :class:`PassPlace` the executor gives: ``InProcess`` this process, ``OnCluster`` a Ray cluster)."""

    makes: str | None
    site: str


_SITES = "resumerge.forward.placing.sites"
# --executor NAME -> its row (in the order --help lists them)
EXECUTORS: Mapping[str, ExecutorRow] = MappingProxyType({
    "local": ExecutorRow(None, f"{_SITES}:InProcess"),
    "ray": ExecutorRow("resumerge.merge.engine.executors:RayExecutor", f"{_SITES}:OnCluster"),
})


def named(path: str) -> Any:
    """What ``module:name`` names (an executor's class, a site's, an analysis's, a command's runner), its module
    imported on first use."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)

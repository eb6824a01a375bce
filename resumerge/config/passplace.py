"""Where an executor places a forward pass (``check``, ``measure``, ``eval``, ``evolve``'s generations, the MoE
gates): :meth:`~resumerge.merge.engine.executors.PlacesPasses.place_pass` gives a :class:`PassPlace`, one small
frozen value whose ``name`` is the executor's (``local``, ``ray``) and keys the pass's site, where every difference
between executors lives (:data:`resumerge.forward.placing.sites.SITES`, which this package may not import: one row per
executor). :data:`HERE`: every model in this process, one after another (the local executor, and the default)."""

from __future__ import annotations

from dataclasses import dataclass


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

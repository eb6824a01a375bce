"""The workers resumerge keeps on a Ray cluster's nodes, and what they host: a node's worker actor
(:mod:`.actor`, made with the class of the stream it computes with, which whoever starts it names: the merge's
shard stream), how the workers start on their nodes and end (:mod:`.launch`), kept for the next run and leased
(:mod:`.kept`, watched in the worker by :mod:`.keeper`), and a forward pass's objects hosted in them or in a fresh
actor of their own (:mod:`.hosting`; the worker's side, :mod:`.hostcalls`). The merge's driver
(:mod:`resumerge.merge.engine.cluster`) and the forward passes (:mod:`resumerge.forward.placing.onray`) both use it; it
imports nothing of either.

May import: errors, config, machine.
"""

__all__ = [
    "actor",
    "hostcalls",
    "hosting",
    "keeper",
    "kept",
    "launch",
]

"""``measure --executor ray``: each model's measured pass in a Ray actor of its own, the models side by side.

The executor object places the pass (:class:`~resumerge.merge.engine.executors.PlacesPasses`), as it places a check's
(:mod:`resumerge.forward.placing.sites`: :meth:`~resumerge.forward.placing.sites.Seats.each`): each model a placement of
its own on the forward engine's one actor (:func:`~resumerge.forward.placing.rayactor.ray_each`,
:class:`~resumerge.forward.placing.modelnode.ModelNode`), placed one per node where the cluster has the nodes and
declaring the memory of its pass (:func:`actor_bytes`), so that a cluster that cannot hold them is refused before any
weight is read (exit 2); each opens its model from its path (which every node must see; a hub model read by range from
the node, its ranges' sha256 held to the driver's journal after each layer, as a check's nodes' are) and computes with
its node's share of CPUs. The driver (this process) runs each model's journaled layer pass in a thread of its own
(:func:`~resumerge.analyses.measure.grams.measure_model`): per layer the actor runs the layer on the hidden states it
holds (sent only where it holds none: the pass's first layer, a resumed one, a replacement actor) with its linears'
inputs recorded by its copy of the measurement's watch (:class:`~resumerge.analyses.measure.grams.GramWatch`) and
returns the outputs and the Grams, which the driver writes and journals exactly as a local measurement does, so the
bytes are the same and a measurement started on Ray resumes locally, and the other way round. A lost node's model
gets a new actor where a node has room (as a check's do); where none has, the measurement stops as unreachable
(exit 3): run again, it resumes at the layers journaled. RegMean++'s merged pass merges every model's layer in one
place and is not placed on Ray (refused, exit 2).
"""

from __future__ import annotations

from collections.abc import Sequence

from resumerge.machine.torch_import import IMPORT_RESERVE


def actor_bytes(peaks: Sequence[int]) -> list[int]:
    """The memory each model's actor declares: torch's imports (as a merge's Ray workers and a check's actors
    declare) and its pass at its largest step (``peaks``: the figures the local measurement's budget is found
    from, its hidden states in and out, a layer in float32 and its sums)."""
    return [IMPORT_RESERVE + peak for peak in peaks]

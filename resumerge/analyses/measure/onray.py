"""``measure --executor ray``: each model's measured pass in a Ray actor of its own, the models side by side.

The executor object places the pass (:class:`~resumerge.merge.engine.executors.PlacesPasses`), as it places a check's
(:mod:`resumerge.forward.sites`; this module's :class:`NodeRuns` is the measurement's :class:`~.passes.Runs` there):
each model a placement of its own on the forward engine's one actor (:func:`~resumerge.forward.rayactor.ray_each`,
:class:`~resumerge.forward.rayactor.ModelNode`), placed one per node where the cluster has the nodes and declaring
the memory of its pass (:func:`actor_bytes`), so that a cluster that cannot hold them is refused before any weight is
read (exit 2); each opens its model from its path (which every node must see; a hub model read by range from the
node, its ranges' sha256 held to the driver's journal after each layer, as a check's nodes' are) and computes with
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

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from resumerge.analyses.measure.passes import Measuring, side_by_side
from resumerge.forward.opened import PassModel
from resumerge.torch_import import IMPORT_RESERVE

if TYPE_CHECKING:
    from resumerge.forward.hubreads import PassReads
    from resumerge.forward.layerpass import Reserve
    from resumerge.forward.onray import Place, Read
    from resumerge.forward.sites import PassSite
    from resumerge.inputs.grams import MeasuredModel


def actor_bytes(peaks: Sequence[int]) -> list[int]:
    """The memory each model's actor declares: torch's imports (as a merge's Ray workers and a check's actors
    declare) and its pass at its largest step (``peaks``: the figures the local measurement's budget is found
    from, its hidden states in and out, a layer in float32 and its sums)."""
    return [IMPORT_RESERVE + peak for peak in peaks]


@dataclass(frozen=True)
class NodeRuns:
    """Each model's pass in an actor of its own where ``placed`` says (``state``: the state dir a node opens a
    model under, None the default; ``keep``: a kept worker's idle seconds,
    :func:`~resumerge.forward.onray.kept_hosts`), the models side by side, a thread of this process driving each
    (``layers``: each model's decoder layers; ``site``: where the executor placed them,
    :class:`~resumerge.forward.sites.OnCluster`)."""

    site: PassSite
    layers: Sequence[int]
    placed: Sequence[Place]
    state: str | None
    keep: float

    def fit(self, models: list[PassModel], found: list[tuple[str, int, int, int]], held: int,
            max_memory: int | None) -> tuple[list[int], int, int, int]:
        """This process holds no layer, only every model's hidden states in and out at once (the passes run side
        by side)."""
        from resumerge.memory import SystemProbe, budget_fitting

        states = sum(peak - step for _, _, peak, step in found)
        budget = budget_fitting("measuring on Ray", states, max_memory, SystemProbe(), held=held)
        return [layers for _, layers, _, _ in found], budget, 0, 0

    def bind(self, reads: PassReads, models: list[PassModel], fresh: bool) -> list[PassModel]:
        return self.site.bind(reads, models, fresh)

    def measured(self, measuring: Measuring, reserve: Reserve, device: str) -> list[MeasuredModel]:
        """Each model measured on its actor; what a node read of a hub file held to the journal and read here too,
        for its file's proof (the layers run elsewhere: ``reserve`` and ``device`` are the nodes')."""
        from resumerge.analyses.measure.grams import GramWatch, tokens_of
        from resumerge.forward.rayactor import ActorTerms, ray_each

        m = measuring
        lock = threading.Lock()  # each model's thread tells its node's reads

        def on_reads(index: int, found: list[Read]) -> None:
            with lock:
                m.reads.elsewhere(m.models[index], found, prove=True)

        watches = [GramWatch(tokens_of(m.batches)) for _ in m.models]
        terms = [ActorTerms(self.state, what="measure", keep=self.keep, watch=watch) for watch in watches]
        with ray_each(m.models, self.placed, self.layers, on_reads, terms) as placements:
            return side_by_side(placements, watches, m)

"""``measure --executor ray``: each model's measured pass in a Ray actor of its own, the models side by side.

The executor object places the pass (:class:`~resumerge.merge.engine.executors.PlacesPasses`), as it places a check's
(:mod:`resumerge.forward.sites`; this module's :class:`NodeRuns` is the measurement's :class:`~.passes.Runs` there):
an actor per model (:class:`MeasureNode`), placed one per node where the cluster has the nodes and declaring the
memory of its pass (:func:`actor_bytes`), so that a cluster that cannot hold them is refused before any weight is
read (exit 2); each opens its model from its path (which every node must see; a hub model read by range from the
node, its ranges' sha256 held to the driver's journal after each layer, as a check's nodes' are) and computes with
its node's share of CPUs. The driver (this process) runs each model's journaled layer pass in a thread of its own
(:func:`~resumerge.analyses.measure.grams.measure_model`, on an :class:`OnNode`): per layer the actor runs the layer
on the hidden states it holds (sent only where it holds none: the pass's first layer, a resumed one) with its
linears' inputs recorded and returns the outputs and the Grams, which the driver writes and journals exactly as a
local measurement does, so the bytes are the same and a measurement started on Ray resumes locally, and the other
way round. A lost node stops the measurement as unreachable (exit 3): run again, it resumes at the layers journaled.
RegMean++'s merged pass merges every model's layer in one place and is not placed on Ray (refused, exit 2).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from resumerge.analyses.measure.grams import Recorded, Streamed
from resumerge.analyses.measure.passes import Measuring, side_by_side, stream_of
from resumerge.errors import ResumergeError, UnreachableError
from resumerge.forward.onray import Place, Read, driver_token, end_actors, kept_hosts, logged, on_node, sent
from resumerge.forward.opened import PassModel
from resumerge.torch_import import IMPORT_RESERVE, torch

if TYPE_CHECKING:
    from resumerge.forward.batches import Batch
    from resumerge.forward.hubreads import PassReads
    from resumerge.forward.layerpass import Reserve
    from resumerge.forward.sites import PassSite
    from resumerge.inputs.grams import MeasuredModel

_RESUME_HINT = "check the cluster's nodes, then run the measurement again: it resumes at the layers journaled"


def actor_bytes(peaks: Sequence[int]) -> list[int]:
    """The memory each model's actor declares: torch's imports (as a merge's Ray workers and a check's actors
    declare) and its pass at its largest step (``peaks``: the figures the local measurement's budget is found
    from, its hidden states in and out, a layer in float32 and its sums)."""
    return [IMPORT_RESERVE + peak for peak in peaks]


@dataclass(frozen=True)
class NodeRuns:
    """Each model's pass in an actor of its own where ``placed`` says (``state``: the state dir a node opens a
    model under, None the default; ``keep``: a kept worker's idle seconds, :func:`on_nodes`), the models side by
    side, a thread of this process driving each (``layers``: each model's decoder layers; ``site``: where the
    executor placed them, :class:`~resumerge.forward.sites.OnCluster`)."""

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
        m = measuring
        reads = m.reads

        def on_reads(index: int, found: list[Read]) -> None:
            reads.elsewhere(m.models[index], found, prove=True)

        with on_nodes(m.models, m.keys, self.layers, self.placed, on_reads, self.state, self.keep) as runners:
            return side_by_side(runners, m.models, m.keys, m.batches, m.folder, m.workdir, m.on_progress)


class MeasureNode:
    """One model's measured pass as a Ray actor runs it: its stream (made in the actor's process, from the model as
    this node opens it), torch on ``threads`` threads, and the hidden states its last layer gave."""

    def __init__(self, model: PassModel, key: str, threads: int, token: bool = False,
                 state: str | None = None) -> None:
        torch.set_num_threads(max(1, threads))
        self.failed: ResumergeError | None = None
        self.read_log: list[Read] = []
        self.hidden: list[torch.Tensor] = []
        try:
            self.runner = Streamed(stream_of(logged(on_node(model, token, state), self.read_log), key))
        except ResumergeError as exc:  # said by :meth:`node` (an actor whose constructor raises says only "died")
            self.failed = exc

    def node(self) -> str:
        """The node this actor runs on; raises the error that kept it from opening its model."""
        from resumerge.merge.engine.cluster.connect import this_node

        if self.failed is not None:
            raise self.failed
        return this_node()

    def reads(self) -> list[Read]:
        """The ranges of the model's hub files read here since last asked, for the driver's journal."""
        found, self.read_log[:] = list(self.read_log), []
        return found

    def enter(self, batches: list[Batch]) -> list[torch.Tensor]:
        self.hidden = []
        return self.runner.enter(batches)

    def layer(self, index: int, hidden: list[torch.Tensor] | None, tokens: int
              ) -> tuple[Recorded, dict[str, torch.Tensor]]:
        """Layer ``index`` on ``hidden`` (None: the outputs of the layer this actor ran last), recorded; with it,
        what the layers up to ``index`` hand later ones (:mod:`resumerge.forward.handed`), for the driver's
        journal."""
        with torch.no_grad():
            found = self.runner.layer(index, self.hidden if hidden is None else hidden, tokens)
        self.hidden = found[0]
        return found, self.runner.carried(index)

    def restore(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Put back what :meth:`layer` handed the driver (a resumed pass)."""
        self.runner.restore(tensors)

    def close(self) -> None:
        self.runner.stream.close()


class OnNode:
    """A model's :class:`~resumerge.analyses.measure.grams.Runner` on its actor, driven from this process."""

    def __init__(self, ray: Any, actor: Any, layers: int, what: str,
                 on_reads: Callable[[list[Read]], None] | None) -> None:
        self.ray, self.actor, self._layers, self._what, self.on_reads = ray, actor, layers, what, on_reads
        self.held: int | None = None  # the layer whose outputs the actor holds
        self.handed: dict[str, torch.Tensor] = {}  # what the actor's layers hand on, sent with its last layer

    @property
    def layers(self) -> int:
        return self._layers

    @property
    def what(self) -> str:
        return self._what

    def enter(self, batches: list[Batch]) -> list[torch.Tensor]:
        self.held = None
        found: list[torch.Tensor] = self._get(self.actor.enter.remote(batches))
        return found

    def layer(self, index: int, hidden: list[torch.Tensor], tokens: int) -> Recorded:
        held = self.held == index - 1
        found: Recorded
        found, self.handed = self._get(self.actor.layer.remote(index, None if held else hidden, tokens))
        self.held = index
        return found

    def carried(self, index: int) -> dict[str, torch.Tensor]:
        return self.handed

    def restore(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.handed = dict(tensors)
        if tensors:
            self._get(self.actor.restore.remote(dict(tensors)))

    def _get(self, ref: Any) -> Any:
        try:
            found = self.ray.get(ref)
            if self.on_reads is not None:
                reads = self.ray.get(self.actor.reads.remote())
                if reads:
                    self.on_reads(reads)
            return found
        except self.ray.exceptions.RayTaskError as exc:  # the actor's own error, said as a local measure says it
            if isinstance(exc.cause, ResumergeError):
                raise exc.cause from None
            raise
        except self.ray.exceptions.RayError as exc:  # the actor died, or its node
            raise UnreachableError(f"the Ray node measuring {self._what} was lost ({type(exc).__name__})",
                                   hint=_RESUME_HINT) from None


@contextmanager
def on_nodes(models: Sequence[PassModel], keys: Sequence[str], layers: Sequence[int], placed: Sequence[Place],
             on_reads: Callable[[int, list[Read]], None], state: str | None = None,
             keep: float = 0.0) -> Iterator[list[OnNode]]:
    """Each model's actor (where ``placed`` says, :func:`~resumerge.forward.onray.ray_places`), started and
    its model opened, as an :class:`OnNode` each; ``on_reads(m, reads)`` is told what model ``m``'s node read of
    its hub files (called from the model's thread: held by a lock here). The actors end with the block; with
    ``keep`` seconds, those a node's kept worker hosts (:func:`~resumerge.forward.onray.kept_hosts`) are released
    to it, idle for the next run or pass."""
    from resumerge.merge.engine.cluster.connect import require_ray
    from resumerge.merge.engine.cluster.launch import pinned

    ray = require_ray()
    token = any(model.remote for model in models) and driver_token()
    lock = threading.Lock()

    def reads_of(m: int) -> Callable[[list[Read]], None]:
        def told(found: list[Read]) -> None:
            with lock:
                on_reads(m, found)

        return told

    def started(model: PassModel, key: str, place: Place, host: Any) -> Any:
        args = (sent(model), key, max(1, int(place.cpus)), token, state)
        if host is not None:
            host.host(MeasureNode, *args)
            return host
        return ray.remote(MeasureNode).options(num_cpus=place.cpus, memory=place.memory, max_restarts=0,
                                               scheduling_strategy=pinned(place.node_id)).remote(*args)

    hosts = kept_hosts(ray, placed, keep)
    actors = [started(model, key, place, host) for model, key, place, host in zip(models, keys, placed, hosts)]
    try:
        runners = [OnNode(ray, actor, n, model.path, reads_of(m) if model.remote else None)
                   for m, (actor, n, model) in enumerate(zip(actors, layers, models))]
        for runner in runners:
            runner._get(runner.actor.node.remote())
        yield runners
    finally:
        end_actors(ray, actors, hosts)

"""A check's forward pass on a Ray cluster (``--executor ray``): each model's pass on a node of its own, so a check
of a giant merge against its parents takes about the time of one model's pass.

The models are independent until the comparison: an actor per model (:class:`ModelNode`), placed one per node
where the cluster has the nodes (models shared round-robin where it has fewer), opens its model from its path
(which every node must see, as for a merge on Ray; a hub model is read by range from the node) and computes with
the CPUs of its node's share. The driver (this process) holds every model's hidden states, as a local check does:
per layer it sends the reference's input to the layer (the base's, else the first parent's) to every actor at once
(one object in Ray's store), each actor runs its layer on its own hidden states (it keeps its last output) and on
that input, and returns both; the driver computes the layer's figures with the local pass's own functions and
journals it exactly as a local check does (:func:`~resumerge.check.passes.run_pass` drives both), so a check
started on Ray resumes locally, and the other way round. The heads too: the merge's and the base's actors return
their log-probabilities as objects in Ray's store (never fetched by the driver), each other actor compares its own
with them and returns its per-position figures.

Each actor holds one layer of its model and its hidden states; nothing of the driver's memory budget is spent on
layers. A node lost mid-pass ends the check as unreachable (exit 3): run it again, it resumes at the layer
journaled last. Ray is joined through :mod:`resumerge.engine.cluster.connect` (the merge executor's own).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from resumerge.check.heads import HeadTotals
from resumerge.check.models import Checked
from resumerge.check.passes import ModelHead, compared, logprobs, model_layer, streams_of, totals
from resumerge.errors import ResumergeError, UnreachableError
from resumerge.forward.stream import LayerCall
from resumerge.torch_import import torch

if TYPE_CHECKING:  # torch loads on first use (the annotations are strings)
    Hidden = list[torch.Tensor]
Batches = Sequence[Sequence[Sequence[int]]]


class ModelNode:
    """One model of a check as a Ray actor runs it: its :class:`~resumerge.forward.stream.ModelStream` (made in
    the actor's process), torch on ``threads`` threads, its layers' calls and its last hidden states."""

    def __init__(self, model: Checked, threads: int) -> None:
        torch.set_num_threads(max(1, threads))
        self.failed: ResumergeError | None = None
        try:
            self.stream = streams_of([_here(model)])[0]
        except ResumergeError as exc:  # said by :meth:`node` (an actor whose constructor raises says only "died")
            self.failed = exc
        self.entering: list[tuple[torch.Tensor, list[LayerCall]]] = []
        self.calls: list[list[LayerCall]] = []
        self.hidden: Hidden = []
        self.lp: Hidden = []

    def node(self) -> str:
        """The node this actor runs on (its short id, as ``status`` shows it); raises the error that kept it from
        opening its model."""
        from resumerge.engine.cluster.connect import this_node

        if self.failed is not None:
            raise self.failed
        return this_node()

    def enter(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Hidden:
        """The hidden states entering the first decoder layer, per batch (the layers' calls kept)."""
        with torch.no_grad():
            self.entering = self.stream.inputs(batches)
        self.calls = [c for _, c in self.entering]
        return [h for h, _ in self.entering]

    def runs_batched(self) -> bool:
        """See :func:`~resumerge.check.passes._runs_batched`."""
        from resumerge.check.passes import _runs_batched

        with torch.no_grad():
            return _runs_batched(self.stream, self.entering)

    def layer(self, index: int, own: Hidden | None, same: Hidden | None) -> tuple[Hidden, Hidden | None]:
        """Layer ``index`` on this model's hidden states (``own`` where given, else its last output) and on
        ``same``; see :func:`~resumerge.check.passes.model_layer`."""
        with torch.no_grad():
            out, theirs = model_layer(self.stream, index, own if own is not None else self.hidden, self.calls, same)
        self.hidden = out
        return out, theirs

    def head(self, batches: Batches, share: bool, own: Hidden | None = None) -> Hidden | None:
        """This model's log-probabilities from its last hidden states (``own`` where given: a check resumed after
        its last layer), kept for :meth:`compare`, and returned where ``share`` (the merge's and the base's, which
        the others compare theirs with)."""
        if own is not None:
            self.hidden = own
        with torch.no_grad():
            self.lp = logprobs(self.stream, self.hidden, batches)
        return self.lp if share else None

    def compare(self, merged: Hidden | None, base: Hidden | None, batches: Batches) -> ModelHead:
        """See :func:`~resumerge.check.passes.compared` (of this model's log-probabilities)."""
        with torch.no_grad():
            return compared(self.lp, merged, base, batches)

    def close(self) -> None:
        self.stream.close()


def _here(model: Checked) -> Checked:
    """``model`` as this node opens it: as the driver opened it where its folder is here, else (a hub model whose
    cache snapshot is the driver's) its small files fetched into this node's cache, its weights read by range."""
    if model.opened.directory.is_dir():
        return model
    from dataclasses import replace

    from resumerge.check.models import open_checked
    from resumerge.config.locations import StateDir

    return replace(open_checked(model.path, model.role, StateDir.resolve()), role=model.role, weight=model.weight)


class RayModels:
    """The pass's models on a Ray cluster (see the module's docstring); ``on_layer(index, nodes)`` is told before
    each layer, with the node each model runs on."""

    def __init__(self, ray: Any, actors: list[Any], nodes: list[str], layers: int,
                 on_layer: Callable[[int, list[str]], None] | None = None) -> None:
        self.ray, self.actors, self.nodes, self.layers, self.on_layer = ray, actors, nodes, layers, on_layer
        self.seeded = False

    def _get(self, refs: Any) -> Any:
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayTaskError as exc:  # the actor's own error, said as a local check says it
            if isinstance(exc.cause, ResumergeError):
                raise exc.cause from None
            raise
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.ObjectLostError) as exc:
            raise UnreachableError(f"a Ray node of the check was lost ({type(exc).__name__})",
                                   hint="run the check again: it resumes at the last layer journaled") from None

    def enter(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Hidden]:
        self.seeded = False
        found: list[Hidden] = self._get([a.enter.remote(batches) for a in self.actors])
        return found

    def runs_batched(self) -> bool:
        return bool(self._get(self.actors[0].runs_batched.remote()))

    def layer(self, index: int, hidden: list[Hidden], reference: int | None) -> tuple[list[Hidden], list[Hidden]]:
        if self.on_layer is not None:
            self.on_layer(index, self.nodes)
        same = self.ray.put(hidden[reference]) if reference is not None else None
        refs = [actor.layer.remote(index, None if self.seeded else hidden[m], None if m == reference else same)
                for m, actor in enumerate(self.actors)]
        done: list[tuple[Hidden, Hidden | None]] = self._get(refs)
        self.seeded = True
        return [out for out, _ in done], [out if theirs is None else theirs for out, theirs in done]

    def heads(self, hidden: list[Hidden], batches: Batches, base: int | None) -> HeadTotals:
        lps = [actor.head.remote(batches, m in (0, base), None if self.seeded else hidden[m])
               for m, actor in enumerate(self.actors)]
        merged, base_lp = lps[0], lps[base] if base is not None else None
        refs = [self.actors[0].compare.remote(None, None, batches)]
        refs += [actor.compare.remote(merged, base_lp if base is not None and m > base else None, batches)
                 for m, actor in enumerate(self.actors) if m > 0]
        found: list[ModelHead] = self._get(refs)
        return totals(found, sum(len(s) - 1 for batch in batches for s in batch))


@contextmanager
def ray_models(models: Sequence[Checked], address: str | None, layers: int,
               on_layer: Callable[[int, list[str]], None] | None = None) -> Any:
    """The check's models as actors of the Ray cluster at ``address`` (None: ``RAY_ADDRESS``, else a Ray started
    on this machine), one per node where there are nodes enough; they end with the block. Raises
    :class:`~resumerge.errors.UsageError` without Ray, :class:`~resumerge.errors.UnreachableError` where the
    cluster cannot be joined."""
    from resumerge.engine.cluster.connect import join

    ray = join(address)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    places = _places(ray, len(models))
    remote = ray.remote(ModelNode)
    actors = [remote.options(num_cpus=cpus, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        node, soft=False)).remote(model, int(cpus)) for model, (node, cpus) in zip(models, places)]
    try:
        running = RayModels(ray, actors, [], layers, on_layer)
        running.nodes = running._get([a.node.remote() for a in actors])
        yield running
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)


def _places(ray: Any, models: int) -> list[tuple[str, float]]:
    """For each model, the node its actor runs on and the CPUs it declares: the alive nodes with CPUs, most CPUs
    first, one model each, round-robin where there are fewer nodes than models; each model takes its share of its
    node's CPUs (whole CPUs where the node has them, at least a hundredth)."""
    nodes = sorted(((float(n["Resources"].get("CPU", 0)), n["NodeID"]) for n in ray.nodes()
                    if n.get("Alive") and n["Resources"].get("CPU", 0) > 0), key=lambda n: (-n[0], n[1]))
    if not nodes:
        from resumerge.errors import UsageError

        raise UsageError("the Ray cluster has no node with CPUs to run a check on",
                         hint="add a node with CPUs, or run the check without --executor ray")
    chosen = [nodes[m % len(nodes)] for m in range(models)]
    shares = {node: sum(1 for _, n in chosen if n == node) for _, node in nodes}
    return [(node, max(0.01, float(int(cpus // shares[node])) or round(cpus / shares[node], 2)))
            for cpus, node in chosen]


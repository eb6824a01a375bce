"""One model of a forward pass as its node runs it (``--executor ray``; a check's, a measurement's, eval's, the MoE
gates'): the actor's side of :mod:`resumerge.forward.placing.rayactor`, whose driver side
(:class:`~resumerge.forward.placing.rayactor.RayModels`) places it and calls it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

from resumerge.errors import ResumergeError
from resumerge.forward.compared.heads import shared
from resumerge.forward.compared.passes import ModelHead, compared, logprobs, model_layer, streams_of
from resumerge.forward.engine import handed
from resumerge.forward.engine.standins import LayerCall
from resumerge.forward.job.placement import NodeWatch, model_entered
from resumerge.forward.opening.opened import PassModel
from resumerge.forward.placing.onray import Read, logged, on_node
from resumerge.forward.text.vocabs import SharedVocab
from resumerge.inputs.kernels import kernel_threads
from resumerge.machine.torch_import import torch

if TYPE_CHECKING:  # torch loads on first use (the annotations are strings)
    Hidden = list[torch.Tensor]
Batches = Sequence[Sequence[Sequence[int]]]

__all__ = ["ModelNode"]


class ModelNode:
    """One model of a pass (a check's, a measurement's, eval's, the MoE gates') as its node runs it, hosted by a
    kept worker or a fresh actor of the same host (:func:`~resumerge.forward.placing.onray.on_place`): its
    :class:`~resumerge.forward.engine.stream.ModelStream` (made in the actor's process), torch on ``threads`` threads in
    every call (the pass's count), its layers' calls and its last hidden states. ``token``: the driver reads the hub
    with a token, so a hub model's node needs its own (a token never travels with the work). ``dtype``: what the
    pass computes in (a check's float32; the MoE gates' bfloat16), ``what`` the pass as the model's errors name it;
    ``watch``: what the pass computes of each layer here, on the node (``measure``'s Grams:
    :class:`~resumerge.forward.job.placement.NodeWatch`), returned with the layer."""

    def __init__(self, model: PassModel, threads: int, token: bool = False, state: str | None = None,
                 dtype: torch.dtype | None = None, what: str = "check", watch: NodeWatch | None = None) -> None:
        # Applied to each call, on the thread that runs it (a kept worker runs its calls on threads of its own,
        # which a process-wide count set here would not reach once they computed), and to nothing else.
        self.threads = max(1, threads)
        self.watch = watch
        self.failed: ResumergeError | None = None
        self.read_log: list[Read] = []  # the ranges of hub files read here since the driver last asked (reads())
        try:
            with kernel_threads(self.threads):
                self.stream = streams_of([logged(on_node(model, token, state), self.read_log)],
                                         dtype=torch.float32 if dtype is None else dtype, what=f"resumerge {what}")[0]
        except ResumergeError as exc:  # said by :meth:`node` (an actor whose constructor raises says only "died")
            self.failed = exc
        self.entering: list[tuple[torch.Tensor, list[LayerCall]]] = []
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.calls: list[list[LayerCall]] = []
        self.hidden: Hidden = []
        self.lp: Hidden = []
        self.first = False  # the first layer holds the weights :meth:`runs_batched` read, for the pass's first layer

    def reads(self) -> list[Read]:
        """The ranges of the model's hub files this actor read since last asked, as (file, start, end, sha256): the
        driver holds them to the check's journal, as it holds its own reads."""
        found, self.read_log[:] = list(self.read_log), []
        return found

    def node(self) -> str:
        """The node this actor runs on (its short id, as ``status`` shows it); raises the error that kept it from
        opening its model."""
        from resumerge.machine.rayconnect import this_node

        if self.failed is not None:
            raise self.failed
        return this_node()

    def enter(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Hidden, frozenset[int]]:
        """The hidden states entering the first decoder layer, per batch (the layers' calls kept), and the layers
        whose input the forward computes from earlier outputs in some batch (:meth:`entered`: the driver asks for
        those layers only)."""
        self._drop_first()
        with torch.no_grad(), kernel_threads(self.threads):
            self.entering = self.stream.inputs(batches)
        self.batches = batches
        self.calls = [c for _, c in self.entering]
        computed = frozenset(index for calls in self.calls for index, call in enumerate(calls)
                             if getattr(call, "entering", None) is not None)
        return [h for h, _ in self.entering], computed

    def runs_batched(self) -> bool:
        """See :func:`~resumerge.forward.job.placement.runs_batched`. Where the first layer runs the batches, it keeps
        the weights read for this until the pass's first layer runs (it holds a layer, as that step does): read once,
        which for a hub model is the bytes fetched once."""
        from resumerge.forward.compared.passes import batched_on

        self._drop_first()
        first = self.stream.layers_list[0]
        with torch.no_grad(), kernel_threads(self.threads):
            layer = self.stream.load(first)
            try:
                self.first = batched_on(self.stream, layer, self.entering, self.batches)
            finally:
                if not self.first:
                    self.stream.unload(first)
        return self.first

    def before(self) -> int:
        """See :meth:`~resumerge.forward.job.placement.Placement.before`."""
        return self.stream.tail.positions_before()

    def layer(self, index: int, own: Hidden | None, same: Hidden | None
              ) -> tuple[Hidden, Hidden | None, dict[str, torch.Tensor], object]:
        """Layer ``index`` on this model's hidden states (``own`` where given, else its last output) and on
        ``same``; see :func:`~resumerge.forward.compared.passes.model_layer`. With them, what the layers up to
        ``index`` hand later ones (:mod:`resumerge.forward.engine.handed`, named as model 0's), for the driver's
        journal, and what the actor's watch found of the layer (None: it has none)."""
        kept = self.first and index == 0
        if not kept:
            self._drop_first()
        self.first = False
        watch = self.watch
        module = self.stream.layers_list[index]
        with torch.no_grad(), kernel_threads(self.threads):
            with watch.watching(self.stream, 0, module) if watch is not None else nullcontext():
                out, theirs = model_layer(self.stream, index, own if own is not None else self.hidden, self.calls,
                                          same, loaded=kept)
            if watch is not None:
                watch.end_layer()
        self.hidden = out
        if watch is None:
            return out, theirs, handed.carried([self.calls], index), None
        return out, theirs, handed.carried([self.calls], index), watch.taken(0)

    def entered(self, index: int, own: Hidden | None) -> Hidden:
        """This model's input to its layer ``index`` as its forward gives it (see
        :func:`~resumerge.forward.job.placement.model_entered`), on its hidden states (``own`` where given, else its
        last output): asked for a layer :meth:`enter` named only."""
        with torch.no_grad(), kernel_threads(self.threads):
            return model_entered(self.stream, index, own if own is not None else self.hidden, self.calls)

    def restore(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Put back what :meth:`layer` handed the driver (named as model 0's): a resumed pass, a new actor."""
        handed.restore([self.calls], tensors)

    def _drop_first(self) -> None:
        """The first layer's weights kept by :meth:`runs_batched`, dropped (a pass resumed past its first layer, or
        one that enters its batches again)."""
        if self.first:
            self.stream.unload(self.stream.layers_list[0])
            self.first = False

    def head(self, batches: Batches, share: bool, own: Hidden | None = None, vocab: SharedVocab | None = None,
             m: int = 0) -> Hidden | None:
        """This model's log-probabilities from its last hidden states (``own`` where given: a check resumed after
        its last layer), kept for :meth:`compare`, and returned where ``share`` (the merge's and the base's, which
        the others compare theirs with; over the shared tokens where the vocabularies differ: ``vocab``, this the
        check's model ``m``)."""
        self._drop_first()
        if own is not None:
            self.hidden = own
        with torch.no_grad(), kernel_threads(self.threads):
            self.lp = logprobs(self.stream, self.hidden, batches)
            return [shared(vocab, m, lp) for lp in self.lp] if share else None

    def compare(self, merged: Hidden | None, base: Hidden | None, batches: Batches, vocab: SharedVocab | None = None,
                m: int = 0) -> ModelHead:
        """See :func:`~resumerge.forward.compared.passes.compared` (of this model's log-probabilities; model ``m`` of
        the check, ``vocab`` how its vocabularies meet)."""
        with torch.no_grad(), kernel_threads(self.threads):
            return compared(self.lp, merged, base, batches, vocab, m)

    def close(self) -> None:
        self.stream.close()

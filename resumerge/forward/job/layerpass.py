"""The one journaled layer pass: every forward pass resumerge runs (``check``, ``measure``, the MoE hidden-state
gates, and any new client) goes through :meth:`LayerPass.run`, which restarts from the pass's journal, loops over
the decoder layers, hands each to the client's :class:`Step`, saves the hidden states leaving it with what the
step keeps beside them (:class:`~resumerge.forward.job.journal.Journal`: temp file, fsync, rename, then the older
file deleted), reaches the pass's kill point, and ends with the step's ``finish``. See :mod:`resumerge.forward`
for the whole protocol (batches, admission, placement, the lock)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from resumerge.forward.job.journal import Journal, Restart
from resumerge.forward.text.batches import Hidden
from resumerge.machine.killpoints import reach
from resumerge.machine.torch_import import torch

Result = TypeVar("Result")
# Holds the memory of one step of a pass while it runs: (what, step) -> a context manager (the RAM governor's
# reservation: :class:`resumerge.forward.job.admission.Admission`).
Reserve = Callable[[str, str], AbstractContextManager[object]]


def unreserved(what: str, step: str) -> AbstractContextManager[object]:
    """No admission: a pass whose caller holds no governor (a test, a Ray actor whose node declared its memory)."""
    return nullcontext()


class Step(Generic[Result]):
    """A client's part of a pass: what runs on each decoder layer (and what it observes there), what is journaled
    beside the hidden states, and what is done after the last layer. A client overrides :meth:`layer` and
    :meth:`finish`, and the others where it keeps something of its own."""

    def restore(self, restart: Restart) -> None:
        """What this step kept beside the hidden states in the journal's last file, put back (a resumed pass)."""

    def stopped(self) -> bool:
        """Whether the pass stops here (before its next layer, or before :meth:`finish`), giving None."""
        return False

    def layer(self, index: int, hidden: Hidden) -> Hidden:
        """Decoder layer ``index`` run on ``hidden`` (per model, per batch), observed as the client needs; the
        hidden states leaving it (what the next layer is given, and what is journaled)."""
        raise NotImplementedError

    def kept(self, index: int) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
        """What is journaled beside layer ``index``'s hidden states: tensors and safetensors metadata."""
        return {}, None

    def finish(self, hidden: Hidden) -> Result:
        """What the pass gives once every layer ran: from the last layer's hidden states."""
        raise NotImplementedError


class Carries(Protocol):
    """Where the pass's layers hand later layers what they return beside the hidden states
    (:class:`~resumerge.forward.job.placement.Streams`): journaled with each layer, put back on a resume."""

    def carried(self, index: int) -> dict[str, torch.Tensor]: ...

    def restore(self, tensors: Mapping[str, torch.Tensor]) -> None: ...


@dataclass(frozen=True)
class LayerPass:
    """A pass of ``layers`` decoder layers journaled in ``journal``; ``point``: the kill point reached after each
    layer's file is durable (:mod:`resumerge.machine.killpoints`; ``run_pid`` where the process to kill is another);
    ``carries``: whoever holds the layers' calls, whose values handed on to later layers beside the hidden states
    (GLM-5's top-k indices) the pass journals with them and puts back on a resume. Every client names it (None
    only where no layer runs a model's own calls): a pass that forgot it would stop, resumed, at the first layer
    taking a value it no longer holds."""

    journal: Journal
    layers: int
    point: str
    carries: Carries | None
    run_pid: int | None = None
    # Told the index of each layer once its file is durable (and of the last one a resume finds journaled): a
    # run's phase progress (resumerge.merge.engine.phasing).
    on_saved: Callable[[int], None] | None = None

    def run(self, step: Step[Result], entering: Hidden, batches: int) -> Result | None:
        """Run ``step`` over the layers from where the journal left off (``entering``: each model's hidden states
        entering its first layer, per batch, ``batches`` of them) and return its :meth:`~Step.finish` (None where
        the step stopped the pass)."""
        point = self.point
        restart = self.journal.restart(len(entering), batches)
        hidden = entering if restart.hidden is None else _where(restart.hidden, entering)
        step.restore(restart)
        if restart.layer and self.on_saved is not None:
            self.on_saved(restart.layer - 1)
        if self.carries is not None:
            self.carries.restore(restart.tensors)
        with torch.no_grad():
            for index in range(restart.layer, self.layers):
                if step.stopped():
                    return None
                hidden = step.layer(index, hidden)
                tensors, metadata = step.kept(index)
                if self.carries is not None:
                    tensors = {**tensors, **self.carries.carried(index)}
                self.journal.save(index, hidden, tensors, metadata)
                if self.on_saved is not None:
                    self.on_saved(index)
                reach(point, run_pid=self.run_pid)  # tests kill the pass here: it resumes after this layer
            if step.stopped():
                return None
            return step.finish(hidden)


def _where(journaled: Hidden, entering: Hidden) -> Hidden:
    """The ``journaled`` hidden states (host tensors) on the device the pass's hidden states live on (``entering``'s:
    a GPU's where the layers run there, :mod:`resumerge.forward.engine.device`), so a resumed layer compares like with
    like; as they are on the host."""
    device = next((h.device for model in entering for h in model), None)
    if device is None or device.type == "cpu":
        return journaled
    return [[h.to(device) for h in model] for model in journaled]

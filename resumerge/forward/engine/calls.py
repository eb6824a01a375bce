"""The order of a forward's decoder-layer calls: the unit of a layer-by-layer pass.

Most forwards call each decoder layer once, in the list's order. Some call layers several times (Dory loops its middle
layers, an Inkling 2 Loop model its core layers): a pass's steps are then the forward's calls, a layer called twice two
steps, each run, journaled and resumed from as any other (:class:`~resumerge.forward.job.layerpass.LayerPass`). The
order is read from the forward itself, run once with its layers stood in for and no weight read
(:meth:`~resumerge.forward.engine.tail.Tail.probe`); each capture of a batch's calls
(:meth:`~resumerge.forward.engine.stream.ModelStream.inputs`) must find the same order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from resumerge.forward.engine.tail import Tail
from resumerge.machine.torch_import import torch


def call_order(tail: Tail, layers: int) -> list[int]:
    """The index of the decoder layer each of the forward's layer calls calls, in its order (``tail``: the forward's
    probe; ``layers`` of them): each once, in the list's order, where the probe cannot run or does not call every
    layer (a capture then says why it cannot follow the forward)."""
    tail.reshapes(torch.device("cpu"))  # (runs the probe once; a forward it cannot run is not asked again)
    order = list(tail.order)
    return order if sorted(set(order)) == list(range(layers)) else list(range(layers))


def steps_of(stack: Sequence[torch.nn.Module], order: Sequence[int]) -> list[torch.nn.Module]:
    """The module each step of a pass runs: ``stack``'s layers in the forward's call ``order``."""
    return [stack[i] for i in order]


def in_order(order: Sequence[int], expected: Sequence[int], stubs: Sequence[Any]
             ) -> tuple[list[Any], list[Any], list[Any], list[Any]] | None:
    """What the layers' stand-ins ``stubs`` recorded (each its calls, extra-output slots, outputs and hidden states
    given), call by call in the forward's ``order`` (the stand-in each call called); None where that is not the
    ``expected`` order, or the calls were given hidden states of different shapes (the forward runs its layers
    otherwise than the capture hands them: another output arity is tried)."""
    if list(order) != list(expected):
        return None
    taken = [0] * len(stubs)
    calls, made, outs, seen = [], [], [], []
    for i in order:
        j, taken[i] = taken[i], taken[i] + 1
        stub = stubs[i]
        calls.append(stub.calls[j])
        made.append(stub.made[j])
        outs.append(stub.outs[j])
        seen.append(stub.seen[j])
    if not seen or not all(s.shape == seen[0].shape for s in seen):
        return None
    return calls, made, outs, seen


def looped(order: Sequence[int]) -> bool:
    """Whether a forward of call ``order`` calls a layer more than once, or out of the list's order."""
    return list(order) != list(range(len(order)))

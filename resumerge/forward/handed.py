"""What a decoder layer hands a later layer beside the hidden states (GLM-5's layers return their top-k indices,
and the next layer, where it shares the indexer, takes them as ``prev_topk_indices``).

The model's own forward, run once with stand-ins for its layers (:meth:`~resumerge.forward.stream.ModelStream.
inputs`), shows it: each stand-in returns, beside the hidden states, a :class:`Slot` for each extra output the
forward unpacks, and a later layer's recorded call that holds one takes that output. A call of a layer with extra
outputs is a :class:`HandingCall` holding its slots: when the layer runs, its extra outputs are put in them, and a
later call's slots are replaced by their values (:func:`given`). What a later layer still takes after layer ``i``
(:func:`live`) is journaled beside the hidden states (:func:`carried`, :func:`restore`), so that a resumed pass
hands it on too; what none takes any more is dropped. That is the one layer pass's job
(:class:`~resumerge.forward.layerpass.LayerPass`'s ``carries``), whoever holds the calls: :class:`Held` for calls
held in this process, a placement's own for calls held by a Ray actor (which sends its model's values with each
layer's outputs, named by :func:`as_model`, and takes them back by :func:`of_model`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from resumerge.errors import ModelInputError
from resumerge.machine.torch_import import torch

# How a carried value is named in a pass's journal: model m's, batch s's, layer i's extra output q.
CARRIED = "carried.{m}.{s}.{i}.{q}"


# A slot's value before its layer ran (or once no later layer takes it): None is a value a layer returns (RWKV's
# state, without a cache)
NOT_RUN: Any = type("NotRun", (), {"__repr__": lambda self: "NOT_RUN"})()


class Slot:
    """One extra output of one layer's call: its value once the layer ran (:data:`NOT_RUN` before)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Any = NOT_RUN


class HandingCall(tuple):  # type: ignore[type-arg]
    """A layer's call (positional arguments after the hidden states, keywords) whose layer returns extra outputs:
    ``slots`` receive them, in the order the layer returns them."""

    slots: tuple[Slot, ...]

    def __new__(cls, call: tuple[tuple[Any, ...], dict[str, Any]], slots: tuple[Slot, ...]) -> HandingCall:
        made = super().__new__(cls, call)
        made.slots = slots
        return made

    def __reduce__(self) -> Any:
        return (HandingCall, (tuple(self), self.slots))


def slots_of(call: Any) -> tuple[Slot, ...]:
    """The slots a layer's ``call`` puts its extra outputs in (none for a layer that returns none)."""
    return call.slots if isinstance(call, HandingCall) else ()


def takes(call: Any) -> list[Slot]:
    """The slots of earlier layers' outputs ``call`` takes."""
    args, kwargs = call
    return [v for v in (*args, *kwargs.values()) if isinstance(v, Slot)]


def given(call: Any, layer: int | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``call`` with each slot it takes replaced by its value; raises :class:`ModelInputError` for one without a
    value (an earlier layer that has not run in this process)."""
    args, kwargs = call
    if not takes(call):
        return args, kwargs

    def value(v: Any) -> Any:
        if not isinstance(v, Slot):
            return v
        if v.value is NOT_RUN:
            raise ModelInputError(f"decoder layer {layer if layer is not None else '?'} takes what an earlier layer "
                                  "returned beside its hidden states, which this pass no longer holds",
                                  hint="run the pass again from its first layer (remove its journal)")
        return v.value

    return tuple(value(a) for a in args), {k: value(v) for k, v in kwargs.items()}


def live(calls: Sequence[Any], after: int) -> list[tuple[int, int, Slot]]:
    """(layer, output, slot) of the extra outputs of layers up to ``after`` that a later layer of ``calls`` (one
    sequence batch's calls, layer by layer) still takes; the values of the others are dropped."""
    wanted = {id(s) for call in calls[after + 1:] for s in takes(call)}
    found = []
    for i, call in enumerate(calls[:after + 1]):
        for q, slot in enumerate(slots_of(call)):
            if id(slot) in wanted:
                found.append((i, q, slot))
            else:
                slot.value = NOT_RUN
    return found


def carried(calls: Sequence[Sequence[Sequence[Any]]], after: int) -> dict[str, Any]:
    """What a later layer still takes after layer ``after``, for each model's (``calls[m][s]``: batch ``s``'s
    calls) batches, by journal name (:data:`CARRIED`; a None value as an empty tensor under that name and
    ``.none``)."""
    return {CARRIED.format(m=m, s=s, i=i, q=q) + ("" if slot.value is not None else ".none"):
            slot.value.contiguous() if slot.value is not None else torch.empty(0)
            for m, model in enumerate(calls) for s, batch in enumerate(model)
            for i, q, slot in live(batch, after) if slot.value is not NOT_RUN}



def restore(calls: Sequence[Sequence[Sequence[Any]]], tensors: Mapping[str, Any]) -> None:
    """Put the journaled values (:func:`carried`) back in the slots of ``calls``."""
    for name, value in tensors.items():
        parts = name.split(".")
        if len(parts) in (5, 6) and parts[0] == "carried":
            m, s, i, q = map(int, parts[1:5])
            slots_of(calls[m][s][i])[q].value = value if len(parts) == 5 else None


def as_model(tensors: Mapping[str, Any], m: int) -> dict[str, Any]:
    """One model's journaled values (named as model 0's: a Ray actor holds one model's calls) as model ``m``'s."""
    found = {}
    for name, value in tensors.items():
        parts = name.split(".")
        found[".".join([parts[0], str(m), *parts[2:]])] = value
    return found


def of_model(tensors: Mapping[str, Any], m: int) -> dict[str, Any]:
    """Model ``m``'s journaled values among ``tensors``, named as model 0's (what its actor restores)."""
    found = {}
    for name, value in tensors.items():
        parts = name.split(".")
        if len(parts) in (5, 6) and parts[0] == "carried" and parts[1] == str(m):
            found[".".join([parts[0], "0", *parts[2:]])] = value
    return found


class Held:
    """What the layers of calls held in this process hand on (``calls()``: per model, per batch, the layers'
    calls, as the pass's client holds them once it entered its batches), for the pass's journal."""

    def __init__(self, calls: Callable[[], Sequence[Sequence[Sequence[Any]]]]) -> None:
        self.calls = calls

    def carried(self, index: int) -> dict[str, Any]:
        return carried(self.calls(), index)

    def restore(self, tensors: Mapping[str, Any]) -> None:
        restore(self.calls(), tensors)

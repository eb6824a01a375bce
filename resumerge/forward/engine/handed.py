"""What a decoder layer hands a later layer beside the hidden states (GLM-5's layers return their top-k indices,
and the next layer, where it shares the indexer, takes them as ``prev_topk_indices``).

The model's own forward, run once with stand-ins for its layers (:meth:`~resumerge.forward.engine.stream.ModelStream.
inputs`), shows it: each stand-in returns, beside the hidden states, a :class:`Slot` for each extra output the
forward unpacks, and a later layer's recorded call that holds one takes that output. A call of a layer with extra
outputs is a :class:`HandingCall` holding its slots: when the layer runs, its extra outputs are put in them, and a
later call's slots are replaced by their values (:func:`given`). What a later layer still takes after layer ``i``
(:func:`live`) is journaled beside the hidden states (:func:`carried`, :func:`restore`), so that a resumed pass
hands it on too; what none takes any more is dropped. That is the one layer pass's job
(:class:`~resumerge.forward.job.layerpass.LayerPass`'s ``carries``), whoever holds the calls: :class:`Held` for calls
held in this process, a placement's own for calls held by a Ray actor (which sends its model's values with each
layer's outputs, named by :func:`as_model`, and takes them back by :func:`of_model`).

What the forward itself computes between the layers from their hidden outputs is followed the same way (Inkling 2's
block states: the states entering each block-boundary layer, stacked by its forward between layer calls, which every
later layer takes): each stand-in returns its input as a :func:`traced` tensor, whose value is known and whose every
torch operation is recorded, so a later call's value computed from earlier layers' outputs is a :class:`Derived`
(those operations, over the :class:`Output` slots of the layers read), computed again from the outputs the pass's
layers gave when that layer runs (:func:`given`); one computed from no layer's output keeps its value.

A layer whose output the forward reads by attribute (Reformer's return two streams, ``attn_output`` and
``hidden_states``) is stood in for by :class:`Reads`: each attribute read is a :class:`Read`, traced; the one the next
call takes as its hidden states is the call's hidden output, the others its extra outputs (:func:`read_by_name`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from functools import cache
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


class Output(Slot):
    """A layer's hidden output, where a later layer's call or the forward after the layers takes it (:class:`Derived`);
    ``kept``: held to the end of the pass (the forward after the layers reads it: :class:`~.tail.Tail`)."""

    __slots__ = ("__weakref__", "kept")

    def __init__(self) -> None:
        super().__init__()
        self.kept = False


class Read(Output):
    """One output of a layer whose output the forward reads by attribute (Reformer's layers return its two streams,
    ``attn_output`` and ``hidden_states``): its value ``name``\'s; the one the forward gives the next call as its hidden
    states is the call's :class:`Output` (last in its slots), the others its extra outputs."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


class Reads:
    """What a layer's stand-in returns where the forward reads its output by attribute: each attribute read, a
    :class:`Read` of it (one per name), given as the layer's input, traced (:func:`traced`); ``hidden``: the name the
    layer was given its hidden states by, where a keyword."""

    def __init__(self, hidden: torch.Tensor, given_as: str | None) -> None:
        object.__setattr__(self, "_hidden", hidden)
        object.__setattr__(self, "given_as", given_as)
        object.__setattr__(self, "read", {})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        read: dict[str, Read] = self.__dict__["read"]
        if name not in read:
            read[name] = Read(name)
        return traced(self.__dict__["_hidden"], read[name])


def read_by_name(made: Sequence[tuple[Slot, ...]], outputs: Sequence[Any], seen: Sequence[Any]
                 ) -> tuple[list[tuple[Slot, ...]], list[Output]]:
    """A capture's extra outputs and hidden outputs, call by call, where its layers' stand-ins returned
    :class:`Reads`: each call's hidden output the :class:`Read` the forward gave the next call as its hidden states
    (the last call's: of the name the others' were, else the name its hidden states were given by, else the first
    read), its other reads its extra outputs, in the order read."""
    if not any(isinstance(o, Reads) for o in outputs):
        return list(made), list(outputs)
    names: list[str | None] = []
    for k, out in enumerate(outputs):
        read = out.read if isinstance(out, Reads) else {}
        after = _node_of(seen[k + 1]) if k + 1 < len(seen) else None
        names.append(next((n for n, r in read.items() if r is after), None))
    found_made, found_outs = [], []
    for k, out in enumerate(outputs):
        if not isinstance(out, Reads):
            found_made.append(made[k])
            found_outs.append(out)
            continue
        read = dict(out.read)
        name = names[k] or next((n for n in reversed(names[:k]) if n), None) or (
            out.given_as if out.given_as in read else next(iter(read), None))
        main = read.pop(name) if name is not None else Read("hidden_states")
        found_made.append((*made[k], *read.values()))
        found_outs.append(main)
    return found_made, found_outs


# How a layer's call names the hidden states it was given by keyword (Reformer's forward calls its layers with
# keywords alone): the call's keyword holds this in their place, the pass's own given there when the layer runs
class _ByName:
    def __repr__(self) -> str:
        return "HIDDEN"

    def __reduce__(self) -> str:
        return "HIDDEN"


HIDDEN: Any = _ByName()


class Node:
    """One torch operation the forward applied to a traced value: ``func`` of ``args`` and ``kwargs``, which hold
    nodes, :class:`Output` slots and values as they were."""

    __slots__ = ("args", "func", "kwargs")

    def __init__(self, func: Any, args: Any, kwargs: Any) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs

    def __reduce__(self) -> Any:
        return (Node, (self.func, self.args, self.kwargs))


def _map(value: Any, change: Callable[[Any], Any]) -> Any:
    """``value`` with ``change`` applied to each leaf, through tuples, lists and dicts."""
    if type(value) in (tuple, list):
        return type(value)(_map(v, change) for v in value)
    if type(value) is dict:
        return {k: _map(v, change) for k, v in value.items()}
    return change(value)


def _leaves(value: Any) -> list[Any]:
    found: list[Any] = []
    _map(value, found.append)
    return found


class Derived:
    """A value of a layer's call that the forward computed from earlier layers' outputs: ``node``, computed again
    from the outputs the pass's layers gave (:meth:`computed`)."""

    __slots__ = ("node", "outputs")

    def __init__(self, node: Node | Output) -> None:
        self.node = node
        found: dict[int, Output] = {}
        seen: set[int] = set()  # (a node several later ones read is walked once)

        def walk(value: Any) -> None:
            for leaf in _leaves(value):
                if isinstance(leaf, Output):
                    found[id(leaf)] = leaf
                elif isinstance(leaf, Node) and id(leaf) not in seen:
                    seen.add(id(leaf))
                    walk((leaf.args, leaf.kwargs))

        walk(node)
        self.outputs = tuple(found.values())

    def __reduce__(self) -> Any:
        return (Derived, (self.node,))

    def computed(self, value: Callable[[Slot], Any]) -> Any:
        """Its value, each output read by ``value`` (the values it holds as they were moved where they are)."""
        device = next((v.device for v in map(value, self.outputs) if isinstance(v, torch.Tensor)), None)
        done: dict[int, Any] = {}

        def run(leaf: Any) -> Any:
            if isinstance(leaf, Slot):
                return value(leaf)
            if isinstance(leaf, torch.Tensor):
                return leaf if device is None else leaf.to(device)
            if not isinstance(leaf, Node):
                return leaf
            if id(leaf) not in done:
                done[id(leaf)] = leaf.func(*_map(leaf.args, run), **_map(leaf.kwargs, run))
            return done[id(leaf)]

        return run(self.node)


@cache
def _traced_class() -> Any:
    """The tensor class whose operations are recorded (a class made on first use: torch loads then)."""

    class Traced(torch.Tensor):
        node: Any

        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            if not isinstance(out, torch.Tensor) and type(out) not in (tuple, list):
                return out  # (a shape, a dtype, a number)
            made = Node(func, _map(args, _node_of), _map(kwargs, _node_of))
            if isinstance(out, torch.Tensor):
                return traced(out, made)
            return type(out)(traced(o, Node(operator.getitem, (made, i), {})) if isinstance(o, torch.Tensor) else o
                             for i, o in enumerate(out))

    return Traced


def traced(value: torch.Tensor, node: Node | Output) -> Any:
    """``value`` as a tensor whose operations are recorded, computed by ``node`` (or a layer's output)."""
    with torch._C.DisableTorchFunctionSubclass():
        made = torch.Tensor._make_subclass(_traced_class(), value)
    made.node = node
    return made


def _node_of(value: Any) -> Any:
    return value.node if isinstance(value, _traced_class()) else value


def plain(value: Any) -> Any:
    """``value`` (a traced tensor) as a plain one (its value at the capture); anything else as it is."""
    if isinstance(value, _traced_class()):
        with torch._C.DisableTorchFunctionSubclass():
            return value.as_subclass(torch.Tensor)
    return value


def outputs_read(value: Any) -> tuple[Output, ...]:
    """The layers' outputs traced ``value`` was computed from (none for any other value)."""
    node = _node_of(value)
    return Derived(node).outputs if isinstance(node, (Node, Output)) and not isinstance(value, Slot) else ()


def derived(value: Any) -> Any:
    """A layer's call's argument as the pass hands it: a :class:`Derived` where the capture computed it from earlier
    layers' outputs, else its value at the capture."""
    if outputs_read(value):  # (a layer's output itself as +output: a copy)
        node = _node_of(value)
        return Derived(node if isinstance(node, Node) else Node(operator.pos, (node,), {}))
    return _map(value, plain)


class HandingCall(tuple):  # type: ignore[type-arg]
    """A layer's call (positional arguments after the hidden states, keywords) whose layer returns extra outputs:
    ``slots`` receive them, in the order the layer returns them; ``entering``: the hidden states the forward gives
    it, where they are not the previous call's output (a :class:`Derived`, or a value computed from no layer's
    output): a loop's first layer is given what the forward computes as each loop starts (Dory's normed output plus
    the normed input section's)."""

    slots: tuple[Slot, ...]
    entering: Any

    def __new__(cls, call: tuple[tuple[Any, ...], dict[str, Any]], slots: tuple[Slot, ...],
                entering: Any = None) -> HandingCall:
        made = super().__new__(cls, call)
        made.slots, made.entering = slots, entering
        return made

    def remade(self, call: tuple[tuple[Any, ...], dict[str, Any]]) -> HandingCall:
        """``call`` (this one's arguments changed) with this one's slots and entering hidden states."""
        return HandingCall(call, self.slots, self.entering)

    def __reduce__(self) -> Any:
        return (HandingCall, (tuple(self), self.slots, self.entering))


def entered(call: Any, hidden: Any, layer: int | None = None) -> Any:
    """The hidden states a layer's ``call`` is given where the previous call's output is ``hidden``: its own
    entering value (computed again from the pass's outputs where derived from them) where it has one."""
    entering = getattr(call, "entering", None)
    if entering is None:
        return hidden
    return given(((entering,), {}), layer)[0][0] if isinstance(entering, Derived) else entering


def slots_of(call: Any) -> tuple[Slot, ...]:
    """The slots a layer's ``call`` puts its extra outputs in (none for a layer that returns none), and its hidden
    output's (:class:`Output`, last) where a later call or the forward after the layers takes it."""
    return call.slots if isinstance(call, HandingCall) else ()


def hands_on(call: Any) -> bool:
    """Whether a layer's ``call`` takes what an earlier layer returned, or its layer returns more than its hidden
    states for a later one (not where only the forward after the layers reads its output: :class:`Output`)."""
    return bool(takes(call)) or any(not isinstance(s, Output) for s in slots_of(call))


def takes(call: Any) -> list[Slot]:
    """The slots of earlier layers' outputs ``call`` takes (those its derived values are computed from too)."""
    args, kwargs = call
    return [s for v in (*args, *kwargs.values(), getattr(call, "entering", None))
            for s in (v.outputs if isinstance(v, Derived) else (v,)) if isinstance(s, Slot)]


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

    def given_value(v: Any) -> Any:
        return v.computed(value) if isinstance(v, Derived) else value(v)

    return tuple(given_value(a) for a in args), {k: given_value(v) for k, v in kwargs.items()}


def handing(calls: Sequence[Any], made: Sequence[tuple[Slot, ...]], outputs: Sequence[Output],
            seen: Sequence[Any] = ()) -> list[Any]:
    """Call by call, the calls a capture recorded (their stand-ins' extra outputs ``made``, hidden ``outputs``, the
    hidden states ``seen`` given them) as the pass hands them: each value computed from earlier layers' outputs a
    :class:`Derived`, any other its value; a :class:`HandingCall` where the layer returns extra outputs, a later call
    or the forward after the layers (``kept``) takes its hidden output, or it is given other hidden states than the
    previous call's output (its ``entering``)."""
    found = [(tuple(derived(a) for a in args), {k: derived(v) for k, v in kwargs.items()}) for args, kwargs in calls]
    entering = [None if k == 0 or _passed_on(h, seen[k - 1], outputs[k - 1]) else derived(h)
                for k, h in enumerate(seen)]
    entering += [None] * (len(found) - len(entering))
    taken = {id(s) for call, e in zip(found, entering) for s in takes(HandingCall(call, (), e))}
    # (an output read by attribute is always in its slots: the run reads it by its name)
    slots = [(*m, *([o] if id(o) in taken or o.kept or isinstance(o, Read) else [])) for m, o in zip(made, outputs)]
    return [HandingCall(call, s, e) if s or e is not None else call for call, s, e in zip(found, slots, entering)]


def _passed_on(hidden: Any, before: Any, output: Output) -> bool:
    """Whether the hidden states ``hidden`` a call was given are the previous call's ``output`` (given ``before``),
    as it is or by operations that keep its values (a cast to its own dtype, a contiguous copy)."""
    read = outputs_read(hidden)
    return _node_of(hidden) is output or (all(o is output for o in read) and plain(hidden).shape == plain(
        before).shape and bool(torch.equal(plain(hidden), plain(before))))


def hidden_of(call: Any, out: Any) -> Any:
    """A layer's hidden output of its output ``out`` under ``call``: the attribute the forward reads it by (a
    :class:`Read`), the first of a tuple or list (GPT-1's layer returns a list), or ``out`` itself."""
    slots = slots_of(call)
    if slots and isinstance(slots[-1], Read):
        return getattr(out, slots[-1].name)
    return out[0] if isinstance(out, (tuple, list)) else out


def handed_on(call: Any, out: Any) -> Any:
    """A layer's hidden output of its output ``out`` under ``call``, its extra outputs and its hidden output put in
    the call's slots for later layers."""
    hidden = hidden_of(call, out)
    if any(isinstance(s, Read) for s in slots_of(call)):  # read by attribute: each by its name
        for slot in slots_of(call):
            slot.value = getattr(out, slot.name) if isinstance(slot, Read) else hidden
        return hidden
    extras = [s for s in slots_of(call) if not isinstance(s, Output)]
    for slot, value in zip(extras, out[1:] if isinstance(out, (tuple, list)) else ()):
        slot.value = value
    for slot in slots_of(call):
        if isinstance(slot, Output):
            slot.value = hidden
    return hidden


def live(calls: Sequence[Any], after: int) -> list[tuple[int, int, Slot]]:
    """(layer, output, slot) of the extra outputs of layers up to ``after`` that a later layer of ``calls`` (one
    sequence batch's calls, layer by layer) still takes; the values of the others are dropped."""
    wanted = {id(s) for call in calls[after + 1:] for s in takes(call)}
    found = []
    for i, call in enumerate(calls[:after + 1]):
        for q, slot in enumerate(slots_of(call)):
            if id(slot) in wanted or (isinstance(slot, Output) and slot.kept):
                found.append((i, q, slot))
            else:
                slot.value = NOT_RUN
    return found


def carried(calls: Sequence[Sequence[Sequence[Any]]], after: int) -> dict[str, Any]:
    """What a later layer still takes after layer ``after``, for each model's (``calls[m][s]``: batch ``s``'s
    calls) batches, by journal name (:data:`CARRIED`; a None value as an empty tensor under that name and
    ``.none``)."""
    return {CARRIED.format(m=m, s=s, i=i, q=q) + ("" if slot.value is not None else ".none"):
            torch.empty(0) if slot.value is None else slot.value.clone(memory_format=torch.contiguous_format)
            if i == after and isinstance(slot, Output) else slot.value.contiguous()  # (layer ``after``'s output is
            # the hidden states journaled beside it: a copy)
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


def is_cache(value: Any) -> bool:
    """Whether ``value`` is a cache a layer writes its keys and values into (transformers' ``Cache``)."""
    import sys

    cache_utils = sys.modules.get("transformers.cache_utils")  # (no transformers imported: no cache)
    return cache_utils is not None and isinstance(value, cache_utils.Cache)

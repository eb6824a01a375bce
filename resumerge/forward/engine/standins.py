"""The stand-ins a streamed forward puts in a model's place (:mod:`.stream`): a decoder layer's, recording its calls;
the base model's under the causal-LM head, returning the final norm's output; the final norm's while the layers'
calls are captured. Each reads its other attributes from the module it stands in for. And two edits of a recorded
call: the real token ids where renumbered ones were given, a cache the forward made unasked taken out."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from resumerge.forward.engine.handed import HIDDEN, HandingCall, Output, Reads, Slot, is_cache, plain, traced
from resumerge.machine.torch_import import torch

# One decoder layer's call for one token sequence: (positional arguments after the hidden states, keywords).
LayerCall = tuple[tuple[Any, ...], dict[str, Any]]
# The output arity of a layer stand-in that returns an object whose attributes the forward reads
BY_ATTRIBUTE = -1
# The output arity of a layer stand-in that returns what the real layer returns, in its shape (found by running it
# without weights: the ``shaped`` a stand-in is given), each extra output a slot, or None where the layer gives None
# (XLNet's query stream, which its forward tests for None after the last layer)
AS_BUILT = -2


class _Output:
    """The base model's output as the causal-LM class reads it: the last hidden state, and None for whatever
    else a family asks of it (the cache, attentions)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> None:
        return None

    def __getitem__(self, index: int) -> torch.Tensor:
        if index != 0:
            raise IndexError(index)
        return self.last_hidden_state



def stand_ins() -> tuple[Any, Any, Any]:
    """The stand-ins a pass puts in a model's place, as classes made here: they subclass ``torch.nn.Module``, and a
    class statement at module level would import torch with this module (torch loads on first use)."""

    class _StandIn(torch.nn.Module):
        """A module's stand-in whose other attributes are the real module's, which is not registered as a child:
        a forward reads them (Nemotron-H picks each layer's mask by its ``block_type``, Falcon-H1's head multiplies
        by the base model's ``lm_head_multiplier``, Zaya casts to its final norm's ``weight.dtype``)."""

        def __init__(self, real: torch.nn.Module) -> None:
            super().__init__()
            object.__setattr__(self, "real", real)

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.__dict__["real"], name)

    class _Captured(_StandIn):
        """A decoder layer's stand-in: records what it is called with, each time (``order``, shared by the
        stand-ins: the index of the layer each call called, in the forward's order), and hands the hidden states on,
        as its output (``outs``: traced, so that what the forward computes from it is known: :mod:`.handed`):
        alone, in a tuple of ``arity`` values, or (``arity`` :data:`BY_ATTRIBUTE`) as each attribute the forward
        reads of it (:class:`~.handed.Reads`: Reformer's layers return their two streams so), or (``arity``
        :data:`AS_BUILT`) in the shape the layer's own output has for the call, found by ``shaped`` (the layer and
        its arguments: what it returns, run without its weights), a slot for each other value it returns, None where
        it returns None (XLNet's query stream; XLM's parts, an attention's tuple and a norm's tensor). Hidden states
        given by keyword (``hidden_states=``) are recorded as given so (:data:`~.handed.HIDDEN`)."""

        def __init__(self, calls: list[LayerCall], arity: int, real: torch.nn.Module,
                     order: list[int] | None = None, index: int = 0, shaped: Any = None) -> None:
            super().__init__(real)
            self.calls, self.arity = calls, arity
            object.__setattr__(self, "shaped", shaped)  # (arity AS_BUILT: the layer's output for its arguments)
            self.order, self.index = [] if order is None else order, index
            self.seen: list[torch.Tensor] = []
            self.made: list[tuple[Slot, ...]] = []
            self.outs: list[Output | Reads] = []

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            given = args, kwargs
            if args:
                hidden_states, args = args[0], args[1:]
            elif "hidden_states" in kwargs:
                hidden_states, kwargs = kwargs["hidden_states"], {**kwargs, "hidden_states": HIDDEN}
            else:
                raise TypeError(f"{type(self.real).__name__} called without hidden states")
            self.calls.append((args, kwargs))
            self.seen.append(hidden_states)
            self.order.append(self.index)
            self.made.append(tuple(Slot() for _ in range(max(0, self.arity - 1))))
            if self.arity == BY_ATTRIBUTE:
                reads = Reads(plain(hidden_states), "hidden_states" if kwargs.get("hidden_states") is HIDDEN else None)
                self.outs.append(reads)
                return reads
            output = Output()
            self.outs.append(output)
            out = traced(plain(hidden_states), output)
            if self.arity == AS_BUILT:
                real = self.__dict__["shaped"](self.real, *given)
                if not isinstance(real, (tuple, list)):
                    return out
                self.made[-1] = tuple(Slot() for _ in real[1:])
                return type(real)((out, *(s if v is not None else None for s, v in zip(self.made[-1], real[1:]))))
            return (out, *self.made[-1]) if self.arity else out

    class _Finished(_StandIn):
        """The base model's stand-in under the causal-LM head: returns the final norm's output it is given; so does
        its module on the way to the decoder layers (``path``: their ids), which a head may call itself (OPT's
        calls ``model.decoder``)."""

        def __init__(self, hidden: torch.Tensor, real: torch.nn.Module, path: frozenset[int] = frozenset()) -> None:
            super().__init__(real)
            self.hidden = hidden
            object.__setattr__(self, "path", path)

        def __getattr__(self, name: str) -> Any:
            found = super().__getattr__(name)
            if isinstance(found, torch.nn.Module) and id(found) in self.__dict__["path"]:
                return type(self)(self.hidden, found, self.__dict__["path"])
            return found

        def forward(self, *args: Any, **kwargs: Any) -> _Output:
            return _Output(self.hidden)

    class _Passed(_StandIn):
        """The final norm's stand-in while the layers' calls are captured: hands its input on."""

        def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return hidden

    return _Captured, _Finished, _Passed


@contextmanager
def fed_to(module: torch.nn.Module) -> Iterator[list[Any]]:
    """The first argument ``module`` is given in the block, each time, in a list."""
    found: list[Any] = []
    hook = module.register_forward_pre_hook(lambda _module, args: found.append(args[0] if args else None))
    try:
        yield found
    finally:
        hook.remove()


@contextmanager
def recorded(module: torch.nn.Module) -> Iterator[list[Any]]:
    """What ``module`` returns in the block, each time, in a list."""
    found: list[Any] = []
    hook = module.register_forward_hook(lambda _module, _args, out: found.append(out))
    try:
        yield found
    finally:
        hook.remove()


def ids_back(call: LayerCall, renumbered: torch.Tensor, ids: torch.Tensor) -> LayerCall:
    """A layer's ``call`` captured with the ``renumbered`` token ids (rows of a cut embedding table), the real
    ``ids`` in their place: a layer that reads the ids (DeepSeek-V4's hash routing, ``tid2eid[input_ids]``) is
    given the tokens themselves."""
    args, kwargs = call
    fixed = (tuple(ids if v is renumbered else v for v in args),
             {k: ids if v is renumbered else v for k, v in kwargs.items()})
    return call.remade(fixed) if isinstance(call, HandingCall) else fixed


def unasked_cache_dropped(call: LayerCall, more: Mapping[str, Any] | None) -> LayerCall:
    """A layer's ``call`` given None for a cache the forward made though none was asked for (not among ``more``, the
    forward's arguments given: a generation's cache is kept): XLM's forward makes one whatever ``use_cache`` says,
    and a layer given it writes its keys there, so that running the call again (the padding probe, a base's pass)
    would attend to the keys of the run before too."""
    asked = {id(v) for v in (more or {}).values()}
    args, kwargs = call
    if not any(is_cache(v) and id(v) not in asked for v in (*args, *kwargs.values())):
        return call
    args = tuple(None if is_cache(v) and id(v) not in asked else v for v in args)
    return args, {k: None if is_cache(v) and id(v) not in asked else v for k, v in kwargs.items()}

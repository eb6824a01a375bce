"""What a base model's forward does after its decoder layers, read from that forward's own code.

Mostly the modules it applies to the last layer's output one after another (:func:`final_names`: the final norm).
Where it does more (Gemma 3n folds its four hidden-state streams into one, each through its own projection and
rescaled, before the norm), the forward itself is run over given last hidden states (:class:`Tail`): its decoder
layers stand-ins that return them, the parts that run before the layers stand-ins that return zeros of their
outputs' shapes (no weight read for them: a Gemma 3n's per-layer embeddings are gigabytes), so that what comes
after the layers is transformers' own code, never rewritten here. The same probe says where the layers' hidden
states hold a sequence's positions (:func:`sequence_row`), and :func:`weighted_parts` which of a model's modules
hold weights around the layers.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from resumerge.forward.engine.handed import Derived, Output, is_cache, outputs_read, plain
from resumerge.machine.torch_import import torch

# The token ids' shape the probe runs with, to find where the hidden states hold the batch and positions (Gemma 3n's
# stack its streams first): two sizes no stream count or width is taken for
_PROBE = (3, 5)


def _after(inner: torch.nn.Module, layers: torch.nn.Module, *, before: bool = False
           ) -> tuple[str | None, list[ast.stmt]]:
    """The attribute of ``inner`` holding ``layers`` and the statements of ``inner``'s forward after the last one
    that uses them (``before``: before the first one), none where its code cannot be read."""
    children = dict(inner.named_children())
    layer_name = next((n for n, c in children.items() if c is layers), None)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(inner).forward)))
    except (OSError, TypeError, SyntaxError):
        return layer_name, []
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.FunctionDef) else []
    using = [i for i, statement in enumerate(body)
             if any(_self_attribute(n) == layer_name for n in ast.walk(statement))]
    if layer_name is None or not using:
        return layer_name, []
    return layer_name, body[:using[0]] if before else body[using[-1] + 1:]


def final_names(inner: torch.nn.Module, layers: torch.nn.Module, *, rebinds: bool = False) -> tuple[str, ...]:
    """The attributes of the modules ``inner``'s forward applies to the last decoder layer's output, in the order
    it applies them (its final norm: ``norm``, LFM2's ``embedding_norm``, Nemotron-H's ``norm_f``; DeepSeek-V4's
    hyper-connection head ``hc_head`` before it), found in that forward's own code: the modules of ``inner`` it
    calls with one argument in the statements after the last one that uses the decoder layers ``layers``, arguments
    before the call that takes them. Empty where it calls none (the head reads the last layer's output) or its code
    cannot be read. ``rebinds``: only those whose output is bound to the name of their input (``x = self.norm(x)``),
    for a module above the one holding the layers (``layers`` then the module on the way to them), whose forward
    goes on to other things than the hidden states (BigBird's pooler, given the first position)."""
    children = dict(inner.named_children())
    layer_name, after = _after(inner, layers)
    found: list[str] = []

    def visit(node: ast.AST) -> None:  # evaluation order: what a call's arguments call comes before it
        for child in ast.iter_child_nodes(node):
            visit(child)
        # a module given the hidden states alone (Inkling2's final_input, given its block states too, is no such)
        alone = isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords
        name = _self_attribute(node.func) if isinstance(node, ast.Call) and alone else None
        if name is not None and name != layer_name and isinstance(children.get(name), torch.nn.Module):
            found.append(name)

    for statement in after:
        if not rebinds:
            visit(statement)
        elif isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Call) and [
                t.id for t in statement.targets if isinstance(t, ast.Name)] == [
                a.id for a in statement.value.args if isinstance(a, ast.Name)] != []:
            visit(statement.value)
    return tuple(dict.fromkeys(found))


def tail_names(inner: torch.nn.Module, layers: torch.nn.Module, *, before: bool = False) -> tuple[str, ...]:
    """The attributes of every module of ``inner`` its forward uses after the decoder layers ``layers``
    (``before``: before them), however (called, indexed: Gemma 3n's ``altup_unembed_projections[i - 1]``), in the
    order its code names them."""
    children = dict(inner.named_children())
    layer_name, after = _after(inner, layers, before=before)
    named = (_self_attribute(n) for statement in after for n in ast.walk(statement))
    return tuple(dict.fromkeys(n for n in named if n is not None and n != layer_name
                               and isinstance(children.get(n), torch.nn.Module)))


def _self_attribute(node: ast.AST) -> str | None:
    """``X`` where ``node`` is ``self.X``."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def weighted_parts(root: torch.nn.Module, within: torch.nn.Module | tuple[torch.nn.Module, ...],
                   skip: Sequence[torch.nn.Module | None]) -> list[torch.nn.Module]:
    """``root``'s modules that hold weights, but ``skip``: its children, and the children of every module of it that
    holds ``within`` (or one of them) in place of that module (OPT's embeddings inside ``decoder`` beside its
    layers; HRM's two stacks' norms beside their layers)."""
    found: list[torch.nn.Module] = []
    inside = within if isinstance(within, tuple) else (within,)
    for child in root.children():
        if any(child is s for s in skip):
            continue
        if any(m is w for m in child.modules() for w in inside):
            found += weighted_parts(child, within, skip)
        elif any(True for _ in child.parameters()):
            found.append(child)
    return found


def sequence_row(value: torch.Tensor, batch: torch.Size, r: int, n: int) -> torch.Tensor:
    """Sequence ``r``'s first ``n`` positions of a ``batch``-shaped batch's hidden states ``value`` (a batch of one):
    where ``value`` holds the batch and the positions first, or after other axes (Gemma 3n's streams first), with
    any positions they hold before the tokens' (CPM-Ant's prompt)."""
    axis = next((i for i in range(value.dim() - 1) if value.shape[i] == batch[0] and value.shape[i + 1] >= batch[1]),
                0)
    return value.narrow(axis, r, 1).narrow(axis + 1, 0, n + value.shape[axis + 1] - batch[1])


def held_positions(hidden: torch.Tensor, batch: tuple[int, ...]) -> int:
    """How many positions more than its token sequences' a ``batch``-shaped batch's hidden states ``hidden`` hold
    (CPM-Ant's prompt before the tokens; Reformer's own padding to a multiple of its chunk length after them)."""
    return int(sequence_row(hidden, torch.Size(batch), 0, batch[1]).shape[-2]) - batch[1]


def positions_first(first: torch.Tensor, given: torch.Tensor, fed: list[Any]) -> bool:
    """Whether the hidden states ``first`` entering the first layer hold the positions first, the batch second, for
    the ``given`` ids or input embeddings (batch first; ``fed``: what the input embeddings were given, where they ran):
    their first two sizes swapped, or, where the two are one size, the ids the embeddings were given swapped
    (XLNet's forward transposes them before anything)."""
    batch = tuple(given.shape[:2])
    if first.dim() != 3 or tuple(first.shape[:2]) != batch[::-1]:
        return False
    if batch[0] != batch[1]:
        return True
    ids = fed[0] if fed and isinstance(fed[0], torch.Tensor) else None
    return (ids is not None and given.dim() == 2 and not torch.equal(ids, given)
            and torch.equal(ids, given.transpose(0, 1)))


class Tail:
    """``inner``'s forward after its decoder ``layers``, over given last hidden states: its parts that run before
    the layers (``before``) are stood in for by zeros of their outputs' shapes, its layers by what returns the
    given states (a tuple of values where the forward unpacks one: :meth:`probe`); the
    modules it uses after them must hold their weights while it runs. Its output: the base model's last hidden
    state (after the final norm)."""

    def __init__(self, inner: torch.nn.Module, layers: torch.nn.ModuleList, before: Sequence[torch.nn.Module],
                 after: Sequence[torch.nn.Module] = ()) -> None:
        self.inner, self.layers, self.before, self.after = inner, layers, tuple(before), tuple(after)
        # the layers' output arity, the batch's axis in their hidden states, the positions they hold before the
        # tokens' (CPM-Ant's prompt)
        self._found: tuple[int, int, int] | None = None
        # the index of the layer each of the forward's layer calls calls, in its order (a loop calls some twice)
        self.order: list[int] = []
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self._unprobed = False  # the probe failed: not asked again
        # per batch its capture ran for, by its last layer's output (for as long as the pass holds that batch's
        # calls): what the input embeddings gave, the other layers' outputs the forward after the layers reads
        # (Inkling 2's final block-attention residual reads the block states: the embeddings and the states entering
        # each block-boundary layer)
        self._kept: weakref.WeakKeyDictionary[Output, tuple[Any, dict[int, Output]]] = \
            weakref.WeakKeyDictionary()
        # per batch, by its last layer's output: the last hidden state as the forward computed it from more than that
        # output (Reformer's: its two streams' last outputs side by side, its own padding cut off), before the finals
        self._derived: weakref.WeakKeyDictionary[Output, Derived] = weakref.WeakKeyDictionary()
        self._last_derived: tuple[torch.Tensor, torch.Tensor] | None = None

    def keep(self, out: Any, embedded: Sequence[Any], outputs: Sequence[Output]) -> None:
        """Keep for the tail what the capture of a batch found (its forward's output ``out``, traced, what the input
        embeddings gave, the layers' ``outputs``): the outputs the forward read after the layers, to the end of
        the pass."""
        last = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        read = {id(o) for o in outputs_read(last)} | {id(outputs[-1])}
        kept = {i: o for i, o in enumerate(outputs) if id(o) in read}
        for output in kept.values():
            output.kept = True
        self._kept[outputs[-1]] = (plain(embedded[0]) if embedded else None,
                                   {i: o for i, o in kept.items() if o is not outputs[-1]})

    def derives(self, out: Any, outputs: Sequence[Output]) -> None:
        """Where the forward's last hidden state as a capture traced it (its output ``out``; the finals stood in for
        by their input) reads more of the layers' ``outputs`` than the last, or reads it otherwise than as it is
        (Reformer's: its last call's two outputs side by side, its own padding of the positions cut off): keep how,
        with what it reads, to the end of the pass (:meth:`derived`)."""
        last = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        read = outputs_read(last)
        if not read or all(o is outputs[-1] for o in read):
            return
        for output in read:
            output.kept = True
        self._derived[outputs[-1]] = Derived(last.node)

    def derived(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last hidden state before the finals for a batch's last layer output ``hidden``: what :meth:`derives`
        kept for its batch computed from the pass's outputs, or ``hidden`` itself."""
        if self._last_derived is not None and self._last_derived[0] is hidden:  # (the head's blocks of rows)
            return self._last_derived[1]
        for output, how in list(self._derived.items()):
            last = output.value
            if isinstance(last, torch.Tensor) and (last is hidden or (
                    last.shape == hidden.shape and torch.equal(last.to(hidden.device), hidden))):
                found: torch.Tensor = how.computed(lambda slot: slot.value.to(hidden.device))
                self._last_derived = (hidden, found)
                return found
        return hidden

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._last is not None and self._last[0] is hidden:  # the head read a block of rows at a time
            return self._last[1]
        arity, axis, extra = self.probe(hidden.device)
        shape = (hidden.shape[axis], hidden.shape[axis + 1] - extra)
        embedded, outputs = self._sources(hidden)
        found: torch.Tensor = self._run(torch.zeros(shape, dtype=torch.long, device=hidden.device), arity,
                                        lambda entering, i: outputs.get(i, hidden), embedded=embedded)
        self._last = (hidden, found)
        return found

    def _sources(self, hidden: torch.Tensor) -> tuple[Any, dict[int, Any]]:
        """What the forward after the layers reads beside ``hidden`` (a batch's last layer's output): what the
        input embeddings gave, the layers' outputs it reads, by layer; nothing where no capture kept them."""
        for output, (embedded, outputs) in list(self._kept.items()):
            last = output.value
            if isinstance(last, torch.Tensor) and (last is hidden or (
                    last.shape == hidden.shape and torch.equal(last.to(hidden.device), hidden))):
                return embedded, {i: o.value for i, o in outputs.items()}
        return None, {}

    def positions_before(self) -> int:
        """How many positions the layers' hidden states hold before the tokens' (CPM-Ant's prompt; any others they
        hold come after them: Reformer's padding to a multiple of its chunk length); 0 where the probe cannot run."""
        try:
            return self.probe(torch.device("cpu"))[2]
        except Exception:  # whatever the forward raises with its parts before the layers stood in for
            return 0

    def reshapes(self, device: torch.device) -> bool:
        """Whether the layers' hidden states hold the batch and the positions otherwise than the tokens do (after
        other axes: Gemma 3n's streams; more positions: CPM-Ant's prompt before the tokens), so that only the
        forward's own code after them gives the last hidden state; False where the probe cannot run."""
        if self._unprobed:
            return False
        try:
            return self.probe(device)[1:] != (0, 0)
        except Exception:  # whatever the forward raises with its parts before the layers stood in for
            self._unprobed = True
            return False

    def probe(self, device: torch.device) -> tuple[int, int, int]:
        """How many values the forward unpacks from a layer's output (0: it takes the hidden states alone), where
        the layers' hidden states hold the batch and how many positions they hold before the tokens': found once,
        by a run whose layers see what the forward gives them for ids of shape :data:`_PROBE`, every part that
        holds weights stood in for (none read)."""
        if self._found is None:
            failed: Exception | None = None
            seen: list[tuple[int, ...]] = []

            def seeing(entering: torch.Tensor, i: int) -> torch.Tensor:
                seen.append(tuple(entering.shape))
                return entering

            for arity in range(4):
                seen.clear()
                try:
                    self.order = self._run(torch.zeros(_PROBE, dtype=torch.long, device=device), arity, seeing,
                                           (*self.before, *self.after), ordered=True)
                except (ValueError, TypeError, IndexError) as error:  # the forward unpacks the output otherwise
                    failed = error
                    continue
                axis = next((i for i in range(len(seen[0]) - 1)
                             if seen[0][i] == _PROBE[0] and seen[0][i + 1] >= _PROBE[1]), 0)
                self._found = (arity, axis, seen[0][axis + 1] - _PROBE[1])
                break
            else:
                assert failed is not None
                raise failed
        return self._found

    def _run(self, ids: torch.Tensor, arity: int, returned: Any,
             zeroed: Sequence[torch.nn.Module] | None = None, embedded: Any = None, ordered: bool = False) -> Any:
        """The forward over ids ``ids``, the ``i``-th layer call returning what ``returned`` makes of what it is
        given and ``i`` (``arity`` values; a layer the forward calls in a loop is several calls), the parts ``zeroed``
        (the parts before the layers) stood in for by zeros, the input embeddings by ``embedded`` where given (what
        they gave the batch). Its last hidden state, or (``ordered``) the layer each call called, in order."""
        real = list(self.layers)
        order: list[int] = []
        _, _, passed = _stand_ins()

        class _Returning(passed):  # type: ignore[misc, valid-type]
            def __init__(self, layer: torch.nn.Module, index: int) -> None:
                super().__init__(layer)
                self.index = index

            def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                order.append(self.index)
                out = returned(hidden_states, len(order) - 1)
                return (out, *[None] * (arity - 1)) if arity else out

        embedding: torch.nn.Module = self.inner.get_input_embeddings()  # type: ignore[operator]
        parts = [p for p in (self.before if zeroed is None else zeroed) if embedded is None or p is not embedding]
        try:
            for i, layer in enumerate(real):
                self.layers[i] = _Returning(layer, i)
            if embedded is not None:
                embedding.forward = lambda *args, **kwargs: embedded.to(ids.device)  # type: ignore[method-assign]
            with _zeros_for(parts), _own_zeros(self.inner if zeroed is not None else None), torch.no_grad():
                out = self.inner(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                                 output_hidden_states=True)
        finally:
            for i, layer in enumerate(real):
                self.layers[i] = layer
            if embedded is not None:
                del embedding.forward  # (its class's again)
        found: torch.Tensor = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return order if ordered else found


def _stand_ins() -> tuple[Any, Any, Any]:
    from resumerge.forward.engine.standins import stand_ins

    return stand_ins()


@contextmanager
def _zeros_for(parts: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Each of ``parts`` whose weights are on the meta device made, for the block, to return zeros of the shape
    and dtype its forward gives (:func:`_shaped`)."""
    parts = [leaf for part in parts for leaf in (part.children() if isinstance(
        part, (torch.nn.ModuleList, torch.nn.ModuleDict)) else (part,))  # (Gemma 3n's altup_projections[i])
             if all(p.is_meta for p in leaf.parameters())]  # one given its weights runs as it is
    saved = [part.forward for part in parts]

    def zeros(part: torch.nn.Module, real: Any) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            device = next((v.device for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
            return _zeros_like(_shaped(part, real, args, kwargs), device)
        return forward

    try:
        for part, real in zip(parts, saved):
            part.forward = zeros(part, real)  # type: ignore[method-assign]
        yield
    finally:
        for part, real in zip(parts, saved):
            part.forward = real  # type: ignore[method-assign]


@contextmanager
def _own_zeros(inner: torch.nn.Module | None) -> Iterator[None]:
    """``inner``'s own weights on the meta device (of no child module: HRM's low-level initial state) made zeros of
    their shapes for the block (a probe's: none read); nothing where ``inner`` is None."""
    own = {} if inner is None else {n: p for n, p in inner.named_parameters(recurse=False) if p.is_meta}
    try:
        for name, param in own.items():
            zeros = torch.nn.Parameter(torch.zeros(param.shape, dtype=param.dtype), requires_grad=False)
            inner._parameters[name] = zeros  # type: ignore[union-attr]
        yield
    finally:
        for name, param in own.items():
            inner._parameters[name] = param  # type: ignore[union-attr]


# a part whose weights are at most this many bytes is run on the CPU with unset stand-ins for them (only its
# output's shape is taken), not on the meta device: torch's first computation there imports its symbolic-shape
# machinery (sympy, ~75 MB a process), which a check's budget would then have to hold
_SMALL_PART = 1 << 22


def shaped(part: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What ``part`` (its weights on the meta device) returns for ``args`` and ``kwargs`` (traced or not), for its
    shape alone: which of its outputs are tensors, which None (a decoder layer's, for a capture's stand-in). A cache
    among them is given as a copy (:func:`fresh`): the call's own is left as the forward made it."""
    given = _tensors_mapped((args, kwargs), plain)
    return _shaped(part, part.forward, tuple(map(fresh, given[0])), {k: fresh(v) for k, v in given[1].items()})


def fresh(value: Any) -> Any:
    """``value``, or a copy of it where it is a cache (:func:`is_cache`): a run for an output's shape leaves the
    call's own cache as the forward made it."""
    if is_cache(value):
        import copy

        return copy.deepcopy(value)
    return value


def _shaped(part: torch.nn.Module, real: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What ``part`` (its weights on the meta device; its forward ``real``) returns for ``args``, for its shape and
    dtype alone: an embedding's from the ids' shape (``*ids, width``: Gemma's scaled ones too), a small part's run
    on the CPU with unset weights, another's from the meta device."""
    if isinstance(part, torch.nn.Embedding) and args and isinstance(args[0], torch.Tensor):
        return torch.empty((*args[0].shape, part.embedding_dim), dtype=part.weight.dtype)
    named = [*part.named_parameters(), *part.named_buffers()]
    if sum(t.numel() * t.element_size() for _, t in named) <= _SMALL_PART:
        from torch.func import functional_call

        given = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in named}  # no computation on the meta device
        standing = part.forward
        part.forward = real  # type: ignore[method-assign]
        try:
            with torch.no_grad():
                return functional_call(part, given, _to_cpu(args), _to_cpu(kwargs))
        finally:
            part.forward = standing  # type: ignore[method-assign]
    on_meta = _to_meta((args, kwargs))
    return real(*on_meta[0], **on_meta[1])


def _to_cpu(value: Any) -> Any:
    return _tensors_mapped(value, lambda t: torch.zeros(t.shape, dtype=t.dtype) if t.is_meta else t.cpu())


def _to_meta(value: Any) -> Any:
    return _tensors_mapped(value, lambda t: t.to("meta"))


def _zeros_like(value: Any, device: torch.device | None) -> Any:
    # a dict a part returns (a ModelOutput) is left as it is
    return _tensors_mapped(value, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device or "cpu"),
                           dicts=False)


def _tensors_mapped(value: Any, change: Callable[[torch.Tensor], torch.Tensor], *, dicts: bool = True) -> Any:
    """``value`` with ``change`` applied to each tensor in it, through tuples, lists and (``dicts``) dicts."""
    if isinstance(value, torch.Tensor):
        return change(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_tensors_mapped(v, change, dicts=dicts) for v in value)
    if dicts and isinstance(value, dict):
        return {k: _tensors_mapped(v, change, dicts=dicts) for k, v in value.items()}
    return value

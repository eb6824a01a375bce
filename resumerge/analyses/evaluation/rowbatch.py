"""A token step's newest tokens run through a decoder layer as one batch whose every row computes, bit for bit,
what that request computes alone (lm-eval's ``hf`` model generates ``generate_until`` requests one at a time at its
default batch size of one; :mod:`.streamgen` runs them together so that a step's layer runs once, not once a
request, and must still choose the same tokens).

A plain batch would not: a matrix product of eight rows rounds otherwise than eight of one row (oneDNN's and MKL's
kernels block the sum by the shape), and a left-padded attention sums over the padding's zeros in another order.
So, for the block of :func:`row_exact`:

- each ``torch.nn.Linear`` of the layer computes a batch of one-position rows as a batched product of one row each
  against the same weight (``torch.bmm`` over a stride-0 view: the weight read once, each row's sum the one-row
  product's);
- the attention runs row by row (:func:`rows_attention`, an implementation registered in transformers'
  ``AttentionInterface``): each row's query against its own positions only (the padding sliced off) under the mask
  its own forward made, through the family's own implementation (``sdpa``; a family running its own ``eager``
  runs its rows one at a time);
- its activations (a layer's leaf modules that hold no tensors: SiLU, GELU) run row by row: torch computes a
  vector's tail of elements with the scalar ``exp``, whose rounding is not the vectorised one's, and a row's
  elements are another vector's tail in a batch than alone (a width of 48: 32 and 16 alone, three rows of 48 in
  nine vectors of 16 together);
- what else the layer does position by position (sums, products, a norm's mean, the residual) is the same
  arithmetic in a batch.

A layer whose batch differs from its rows alone anyway (a family computing otherwise) is found on the first token
step (:mod:`.streamgen` compares them there) and runs its rows one at a time, as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from resumerge.forward.engine.handed import hands_on
from resumerge.forward.engine.standins import LayerCall
from resumerge.machine.torch_import import torch

ROWS = "resumerge_rows"  # the attention implementation's name in transformers' registry, and its keyword
_MASK = "attention_mask"


@dataclass(frozen=True)
class Rows:
    """What :func:`rows_attention` needs beside the batch: the family's own attention implementation, each row's
    mask as its own forward made it, and where each row's own positions start among the keys (after its padding)."""

    implementation: str
    masks: tuple[Any, ...]
    starts: tuple[int, ...]


def rows_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention of a batch row by row: each row's query, its own keys and values (its positions, contiguous as
    a cache of its own holds them) and its own mask, through the family's implementation (see the module)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    rows: Rows = kwargs.pop(ROWS)
    own = ALL_ATTENTION_FUNCTIONS[rows.implementation]
    found = []
    for r, (mask, start) in enumerate(zip(rows.masks, rows.starts)):
        out, _ = own(module, query[r:r + 1], key[r:r + 1, :, start:].contiguous(),
                     value[r:r + 1, :, start:].contiguous(), mask, **kwargs)
        found.append(out)
    return torch.cat(found), None


def _registered() -> None:
    """:func:`rows_attention` in transformers' attention registry (idempotent)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ROWS not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(ROWS, rows_attention)


def _row_linear(module: torch.nn.Linear) -> Any:
    """``module``'s forward computing a batch of one-position rows ``(rows, 1, in)`` as one-row products (see the
    module); any other input as ``torch.nn.Linear`` computes it."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[1] != 1 or x.shape[0] == 1:
            return torch.nn.functional.linear(x, module.weight, module.bias)
        weight = module.weight.t().unsqueeze(0).expand(x.shape[0], -1, -1)
        if module.bias is None:
            return torch.bmm(x, weight)
        return torch.baddbmm(module.bias.view(1, 1, -1).expand(x.shape[0], 1, -1), x, weight)

    return forward


def _by_row(module: torch.nn.Module) -> Any:
    """``module``'s forward computing a batch of one-position rows one row at a time; any other input as before."""
    own = type(module).forward

    def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1] != 1 or x.shape[0] == 1:
            return own(module, x, *args, **kwargs)
        return torch.cat([own(module, x[r:r + 1]) for r in range(x.shape[0])])

    return forward


def _activations(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """``layer``'s leaf modules holding no tensors (its activations; not a dropout, which a pass never draws)."""
    return [m for m in layer.modules() if not any(True for _ in m.children()) and not any(True for _ in m.parameters())
            and not any(True for _ in m.buffers()) and not isinstance(m, (torch.nn.Dropout, torch.nn.Identity))]


@contextmanager
def row_exact(layer: torch.nn.Module) -> Iterator[None]:
    """For the block, ``layer`` (its weights loaded) computing a batch of one-position rows as each row alone:
    its linear layers one row at a time against the weight read once, its activations and its attention row by row
    (:func:`rows_attention`, which the call's keyword :data:`ROWS` tells what it needs)."""
    _registered()
    linears = [m for m in layer.modules() if type(m) is torch.nn.Linear]
    configs = {id(c): c for m in layer.modules() if (c := getattr(m, "config", None)) is not None
               and hasattr(c, "_attn_implementation_internal")}
    before = {key: c._attn_implementation_internal for key, c in configs.items()}
    rows = _activations(layer)
    try:
        for linear in linears:
            linear.forward = _row_linear(linear)  # type: ignore[method-assign]
        for module in rows:
            module.forward = _by_row(module)  # type: ignore[method-assign]
        for config in configs.values():
            config._attn_implementation_internal = ROWS
        yield
    finally:
        for module in (*linears, *rows):
            module.__dict__.pop("forward", None)
        for key, config in configs.items():
            config._attn_implementation_internal = before[key]


def implementation(layer: torch.nn.Module) -> str | None:
    """The attention implementation ``layer``'s family runs, where it is one of transformers' registry (``sdpa``;
    None: none found, or ``eager``, which each family writes for itself: its rows run one at a time)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    found = {c._attn_implementation_internal for m in layer.modules()
             if (c := getattr(m, "config", None)) is not None and hasattr(c, "_attn_implementation_internal")}
    if len(found) != 1:
        return None
    name = next(iter(found))
    return name if isinstance(name, str) and name != ROWS and name in ALL_ATTENTION_FUNCTIONS else None


def batched_call(calls: Sequence[LayerCall], shaped: Sequence[Any], cache: Any, rows: Rows) -> LayerCall | None:
    """One call of a layer for the rows whose own calls are ``calls`` (each made against the stand-in cache
    ``shaped[r]``): each row's tensors stacked (those the rows share as they are), the stand-ins replaced by the
    batch's ``cache``, the masks moved to ``rows`` (the layer given none; :func:`rows_attention` gives each row
    its own). None where the calls cannot be one (a layer handing values on, calls of other forms)."""
    if any(hands_on(call) for call in calls):
        return None
    first_args, first_kwargs = calls[0]
    if any(len(args) != len(first_args) or kwargs.keys() != first_kwargs.keys() for args, kwargs in calls):
        return None
    args = []
    for position in range(len(first_args)):
        value = _stacked([call[0][position] for call in calls], shaped, cache)
        if value is _UNSTACKED:
            return None
        args.append(value)
    kwargs: dict[str, Any] = {ROWS: rows}
    for name in first_kwargs:
        if name == _MASK:
            kwargs[name] = None
            continue
        value = _stacked([call[1][name] for call in calls], shaped, cache)
        if value is _UNSTACKED:
            return None
        kwargs[name] = value
    return tuple(args), kwargs


_UNSTACKED = object()


def _stacked(values: list[Any], shaped: Sequence[Any], cache: Any) -> Any:
    """The rows' ``values`` of one argument as the batch's (:data:`_UNSTACKED`: not one)."""
    first = values[0]
    if all(v is s for v, s in zip(values, shaped)):
        return cache
    if isinstance(first, torch.Tensor):
        if not all(isinstance(v, torch.Tensor) and v.shape == first.shape and v.dtype == first.dtype
                   for v in values):
            return _UNSTACKED
        if all(torch.equal(v, first) for v in values[1:]):
            return first
        return torch.cat(values) if first.dim() > 0 and first.shape[0] == 1 else _UNSTACKED
    if isinstance(first, tuple) and all(isinstance(v, tuple) and len(v) == len(first) for v in values):
        parts = [_stacked([v[i] for v in values], shaped, cache) for i in range(len(first))]
        return _UNSTACKED if any(p is _UNSTACKED for p in parts) else tuple(parts)
    if all(v is first or (type(v) is type(first) and isinstance(v, (bool, int, float, str)) and v == first)
           for v in values):
        return first
    return _UNSTACKED


def padded(pasts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The rows' pasts (keys, values: ``(1, heads, length, width)`` each) as one left-padded batch, and where each
    row's own positions start."""
    longest = max(int(k.shape[2]) for k, _ in pasts)
    keys_like, values_like = pasts[0]
    keys = keys_like.new_zeros((len(pasts), keys_like.shape[1], longest, keys_like.shape[3]))
    values = values_like.new_zeros((len(pasts), values_like.shape[1], longest, values_like.shape[3]))
    starts = []
    for r, (k, v) in enumerate(pasts):
        start = longest - int(k.shape[2])
        keys[r, :, start:] = k[0]
        values[r, :, start:] = v[0]
        starts.append(start)
    return keys, values, starts

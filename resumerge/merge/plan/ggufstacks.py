"""Where each output tensor goes in a GGUF output: its GGUF tensor, in data order, with a mixture of experts' routed
projections stacked as llama.cpp's converter stacks them (``gguf.md`` §3: ``blk.N.ffn_{gate,up,down}_exps.weight``
[E, rows, cols], expert e at ``[e]``).

An output tensor stored one per expert (``mlp.experts.e.up_proj.weight``; Mixtral's ``block_sparse_moe.experts.e.
w3.weight``) stays its own unit, written as expert e's slice of its stack: E units make one GGUF tensor, each merged,
sized in memory and written alone at its offset. transformers 5's fused stacks (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``) are one unit each, the first written as two GGUF tensors. Routers
(``ffn_gate_inp``) are F32, as the converter stores them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from resumerge.errors import ModelInputError
from resumerge.inputs.gguf.names import expert_target, gguf_name
from resumerge.merge.plan.merge_plan import TensorPlan
from resumerge.outputs.gguf.layout import TensorInfo
from resumerge.outputs.gguf.outcodec import GgufOutCodec

# What --out-type gguf writes: the families (model_type) and where their experts come from. Named in the refusal of
# any other family.
WRITTEN = ("llama, mistral, qwen2, qwen3, gemma2, gemma3, and the mixtures of experts qwen3_moe, qwen2_moe and "
           "mixtral")

SQUEEZED = "ffn_gate_inp_shexp.weight"
Encode = Callable[..., TensorPlan]  # (tp, GGUF name, *, expert=-1, up_name="") -> tp with its GGUF codec


@dataclass(frozen=True)
class Entry:
    """One GGUF tensor of the output (two for a fused gate_up stack) and the output tensors written into it, in
    data order: a stack's experts in expert order."""

    tensors: tuple[tuple[str, TensorPlan], ...]
    infos: tuple[TensorInfo, ...]


def place_tensors(tensors: Mapping[str, TensorPlan], arch: str, config: Mapping[str, Any], encode: Encode,
                  last: Collection[str] = ()) -> list[Entry]:
    """Every tensor of ``tensors`` (an ``arch`` output whose config.json is ``config``) in its GGUF tensor,
    ``encode`` giving each its codec; the entries in data order (by output tensor name, a stack where its first
    expert sorts; the tensors named in ``last`` at the end: routers a prompt pass computes while the rest is
    merged). Raises :class:`ModelInputError` for a tensor with no GGUF name or a stack missing experts."""
    count = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    slots: list[tuple[str, TensorPlan] | str] = []  # a tensor placed, or the GGUF name of a stack, in data order
    stacks: dict[str, list[tuple[int, str]]] = {}
    fused: dict[str, Entry] = {}
    for name in sorted(tensors):
        tp = tensors[name]
        found = expert_target(name) if count else None
        if found is None:
            target = gguf_name(arch, name, experts=bool(count))
            if target is not None:
                slots.append((name, encode(tp, target)))
            continue
        targets, expert = found
        if expert is not None:
            if targets[0] not in stacks:
                stacks[targets[0]] = []
                slots.append(targets[0])
            stacks[targets[0]].append((expert, name))
            continue
        _check_stack(name, tp.shape[0], count)
        placed = encode(tp, targets[0], up_name=targets[1] if len(targets) > 1 else "")
        infos = tuple(TensorInfo(t, _value_shape(tp.shape, len(targets)), _codec(placed).ggml_type,
                                 placed.nbytes // len(targets)) for t in targets)
        fused[name] = Entry(((name, placed),), infos)
        slots.append(name)
    entries = []
    for slot in slots:
        if isinstance(slot, tuple):
            name, tp = slot
            codec = _codec(tp)
            # Qwen2-MoE's shared expert router [1, n_embd] is 1-D in the converter's GGUF (it squeezes it), as
            # llama.cpp and transformers read it; the same bytes
            shape = tp.shape[1:] if codec.gguf_name.endswith(SQUEEZED) and tp.shape[0] == 1 else tp.shape
            entries.append(Entry(((name, tp),), (TensorInfo(codec.gguf_name, shape, codec.ggml_type, tp.nbytes),)))
        elif slot in fused:
            entries.append(fused[slot])
        else:
            entries.append(_stack(slot, stacks[slot], tensors, count, encode))
    return sorted(entries, key=lambda e: e.tensors[0][0] in last)  # stable: the rest keep their order


def _codec(tp: TensorPlan) -> GgufOutCodec:
    """The GGUF codec ``tp`` was placed with."""
    codec = tp.out_codec
    if not isinstance(codec, GgufOutCodec):
        raise TypeError(f"internal: {tp.name} is not placed in a GGUF")
    return codec


def _value_shape(shape: tuple[int, ...], halves: int) -> tuple[int, ...]:
    """The shape of each GGUF tensor a fused stack of ``shape`` is written as (gate_up: two halves of dim 1)."""
    return (shape[0], shape[1] // halves, *shape[2:])


def _check_stack(name: str, experts: int, count: int) -> None:
    if experts != count:
        raise ModelInputError(f"{name} stacks {experts} experts, but the output's config.json has {count}: a GGUF "
                              "output stacks every expert of a layer", tensor=name, hint="write it as safetensors")


def _stack(target: str, members: list[tuple[int, str]], tensors: Mapping[str, TensorPlan], count: int,
           encode: Encode) -> Entry:
    """The entry of stacked GGUF tensor ``target`` holding the per-expert tensors ``members`` (expert, name)."""
    members = sorted(members)
    first = tensors[members[0][1]]
    if [e for e, _ in members] != list(range(count)) or any(tensors[n].shape != first.shape for _, n in members):
        listing = ", ".join(f"{n} {list(tensors[n].shape)}" for _, n in members)
        raise ModelInputError(f"{target} would stack {listing}: a GGUF output stacks the {count} experts of a layer, "
                              "each of one shape", tensor=members[0][1], hint="write it as safetensors")
    placed = tuple((name, encode(tensors[name], target, expert=e)) for e, name in members)
    info = TensorInfo(target, (count, *first.shape), _codec(placed[0][1]).ggml_type,
                      sum(tp.nbytes for _, tp in placed))
    return Entry(placed, (info,))

"""The static pass: one read of each model's tensors, no forward.

Per logical tensor: non-finite values in the merge; its shape against the base's and the parents'; d_M = ‖M−B‖
and dᵢ = ‖Pᵢ−B‖. Per group (decoder layer × kind of tensor, and per kind over the whole model): the merge's
movement sqrt(Σ d_M²) against the parents' weighted mean of sqrt(Σ dᵢ²) (the merge's own weights where its
record has them, else equal), and their ratio: about 0 for a whole kind the parents moved (every expert at the
base's value, unsloth #5410) names that kind. A multi-token-prediction module (Qwen3-Next's ``mtp.*``, the layers
DeepSeek-V3 and GLM-4.5 store after their decoder layers, ``num_nextn_predict_layers`` of them) is one group of its
own, kind ``mtp``, outside the decoder layers: the forward pass does not run it (transformers does not build it),
its tensors are compared as any other.
A multimodal model's vision tower and projector are one group too, kind ``vision`` (the forward pass runs the
language model on text).

A tensor is compared only where the base holds it in the merge's shape: a merge of another vocabulary (a
``tokenizer_source: union`` merge's larger embeddings and head) has its tables named among the shape problems and
its other figures unchanged, and the base's and parents' tables are not read for any figure. Where this process runs
no forward pass (``check --executor ray``: each model's pass runs on a node), the static pass reads them all the same
(``whole``): every stored tensor of each hub model, so that each of its files is read whole here and proved against
the hub's checksum before the report (:mod:`resumerge.forward.opening.hubreads`), as a local check's forward pass reads
them.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from resumerge.analyses.check.models import Checked
from resumerge.analyses.check.report import GroupFigures, StaticFigures
from resumerge.forward.compared.needs import STATIC_SPAN
from resumerge.forward.engine.reader import CastReader, Weights, base_formats
from resumerge.forward.opening.opened import layer_of
from resumerge.inputs.codecs import StoredFormats
from resumerge.inputs.safetensors_format import numel
from resumerge.machine.torch_import import torch

# A kind the parents moved (their movement above this share of the base's norm over the kind) whose movement by
# the merge is below UNMOVED_RATIO of the parents' is named.
UNMOVED_RATIO = 0.01
_PARENTS_MOVED = 1e-6
# Values per block of a difference (4 MB in float32), and per span a tensor is read in (a whole number of blocks:
# one; the span the budget counts, :data:`~resumerge.forward.compared.needs.STATIC_SPAN`).
_BLOCK = _SPAN = STATIC_SPAN

# A multimodal model's vision tower and projector: one group, not counted in the decoder layers' groups.
_VISION = re.compile(r"(?:^|\.)(?:vision_tower|vision_model|visual|multi_modal_projector|vision_embed_tokens)\.")
_KINDS = (  # first match wins
    ("shared experts", re.compile(r"shared_expert")),
    ("routed experts", re.compile(r"\.experts\.")),
    ("router", re.compile(r"(?:mlp\.gate\.|router|gate\.e_score)")),
    ("norms", re.compile(r"(?:norm|ln_\w*|layernorm)\.(?:weight|bias)$")),
    ("embeddings", re.compile(r"(?:embed_tokens|wte|wpe|word_embeddings|embed_in)\.")),
    ("head", re.compile(r"(?:^|\.)(?:lm_head|embed_out)\.")),  # a VLM's language_model.lm_head too
    ("attention", re.compile(r"(?:attn|attention)")),
    ("mlp", re.compile(r"(?:mlp|feed_forward|ffn)")),
)


def kind_of(name: str) -> str:
    """The kind of tensor ``name`` (attention, mlp, routed experts, shared experts, router, norms, embeddings,
    head, other)."""
    return next((kind for kind, pattern in _KINDS if pattern.search(name)), "other")


def group_of(name: str, mtp_from: int | None) -> tuple[int | None, str]:
    """The group of tensor ``name``: (its decoder layer or None, its kind); an MTP module's tensor is (None,
    ``mtp``): ``mtp.*``, or a layer numbered ``mtp_from`` or after (see :func:`mtp_from`)."""
    if _VISION.search(name):
        return None, "vision"
    layer = layer_of(name)
    if name.startswith("mtp.") or (mtp_from is not None and layer is not None and layer >= mtp_from
                                   and name.startswith("model.layers.")):
        return None, "mtp"
    return layer, kind_of(name)


def mtp_from(config: Mapping[str, Any]) -> int | None:
    """The number of the first MTP layer a config.json declares stored after its decoder layers
    (``num_nextn_predict_layers`` > 0: DeepSeek-V3, GLM-4.5), None where it declares none."""
    try:
        return int(config["num_hidden_layers"]) if int(config.get("num_nextn_predict_layers") or 0) > 0 else None
    except (KeyError, TypeError, ValueError):
        return None


# One tensor's static figures: whether the merge's values are all finite, and where it is compared with the base,
# [‖M−B‖², ‖Pᵢ−B‖² of each parent of the base's shape, ‖B‖²] (None where it is not: no base, or another shape).
TensorResult = tuple[bool, list[float] | None]


def static_pass(models: Sequence[Checked], known: Mapping[str, TensorResult] | None = None, *,
                whole: bool = False) -> StaticFigures:
    """Compare every tensor of the merge (``models[0]``) with the base's and the parents'; ``known``: the figures
    of tensors already found (by the forward pass's reads, :mod:`.folded`), not read again. ``whole``: every stored
    tensor of each hub model is read, those no figure compares too (see the module's docstring: where no forward
    pass runs in this process, the bytes its files' proof needs)."""
    opened = [_opened(model) for model in models]
    shapes = [_shapes(formats) for _, formats in opened]
    proved = [bool(model.remote) for model in models] if whole else None
    return assemble(models, _results(models, opened, shapes, known, proved=proved), shapes)


def tensor_results(models: Sequence[Checked], known: Mapping[str, TensorResult] | None = None,
                   only: Callable[[str], bool] | None = None) -> dict[str, TensorResult]:
    """Each tensor's :data:`TensorResult` (of those ``only`` accepts, when given): ``known`` ones as given, the
    others read (a span at a time)."""
    opened = [_opened(model) for model in models]
    return _results(models, opened, [_shapes(formats) for _, formats in opened], known, only)


def _results(models: Sequence[Checked], opened: list[tuple[Weights, StoredFormats]],
             shapes: list[dict[str, tuple[int, ...]]], known: Mapping[str, TensorResult] | None = None,
             only: Callable[[str], bool] | None = None, proved: Sequence[bool] | None = None
             ) -> dict[str, TensorResult]:
    """Each tensor's :data:`TensorResult` (see :func:`tensor_results`); ``proved``: the models every stored tensor of
    which is read, whether a figure compares it or not (see :func:`static_pass`), each in its name's turn (the
    order the figures read in, so that a file's ranges still come about in order)."""
    results = dict(known or {})
    roles = [m.role for m in models]
    proving = [m for m, wanted in enumerate(proved or ()) if wanted]
    names = set(shapes[0]).union(*(shapes[m] for m in proving))
    wanted = [n for n in sorted(names) if n not in results and (only is None or only(n))]
    if not wanted:
        return results
    readers = [CastReader(weights, formats, torch.float32, key=model.role)
               for model, (weights, formats) in zip(models, opened)]
    try:
        for name in wanted:
            read: set[int] = set()
            if name in shapes[0]:
                results[name] = _read_result(readers, shapes, roles, name)
                others = compared_with(shapes, roles, name)
                read = {0} if others is None else {0, roles.index("base"), *others}
            for m in proving:
                if m not in read and name in shapes[m]:  # no figure reads it: its bytes for its file's proof
                    _read_only(readers[m], name, numel(shapes[m][name]))
    finally:
        for reader in readers:
            reader.close()
    return results


def logical_shapes(models: Sequence[Checked]) -> list[dict[str, tuple[int, ...]]]:
    """Each model's logical tensors and their value shapes (headers only)."""
    return [_shapes(formats) for _, formats in map(_opened, models)]


def _opened(model: Checked) -> tuple[Weights, StoredFormats]:
    """``model``'s weights and the formats its stored tensors are read in (headers only)."""
    weights = Weights.of(model.opened.directory, model.opened.tensors, model.remote, model.reads)
    return weights, base_formats(weights.tensors, model.opened.config, weights.directory)


def _shapes(formats: StoredFormats) -> dict[str, tuple[int, ...]]:
    return {name: tuple(formats.codec(name).value_shape(tuple(t.entry.shape))) for name, t in formats.logical().items()}


def compared_with(shapes: list[dict[str, tuple[int, ...]]], roles: Sequence[str], name: str) -> list[int] | None:
    """The parents (model indices) the merge's tensor ``name`` is compared with the base's beside, or None where
    it is not compared (no base, not in the base, or of another shape there)."""
    base = roles.index("base") if "base" in roles else None
    if base is None or name not in shapes[base] or shapes[base][name] != shapes[0][name]:
        return None
    return [i for i, r in enumerate(roles) if r == "parent" and shapes[i].get(name) == shapes[base][name]]


def _read_result(readers: list[CastReader], shapes: list[dict[str, tuple[int, ...]]], roles: Sequence[str],
                 name: str) -> TensorResult:
    values = numel(shapes[0][name])
    others = compared_with(shapes, roles, name)
    if others is None:
        return _finite(readers[0], name, values), None
    found, finite = _tensor_sums(readers, name, values, roles.index("base"), others)
    return finite, found


def assemble(models: Sequence[Checked], results: Mapping[str, TensorResult],
             shapes: list[dict[str, tuple[int, ...]]] | None = None) -> StaticFigures:
    """The static figures from every tensor's :data:`TensorResult`: summed per group in the merge's tensors' sorted
    order, whoever found them (so the figures are the same to the bit); ``shapes``: :func:`logical_shapes`'s, when
    already found."""
    shapes = logical_shapes(models) if shapes is None else shapes
    roles = [m.role for m in models]
    base = roles.index("base") if "base" in roles else None
    parents = [i for i, r in enumerate(roles) if r == "parent"]
    weights = _weights([models[i].weight for i in parents])
    parameters = {_label(models, i): sum(numel(s) for s in shapes[i].values()) for i in range(len(models))}
    nonfinite, problems = [], []
    # (layer, kind) -> [Σ d_M², Σ dᵢ² per parent, Σ ‖B‖², tensors]
    sums: dict[tuple[int | None, str], list[float]] = defaultdict(lambda: [0.0] * (len(parents) + 3))
    first_mtp = mtp_from(models[0].opened.config)
    for name in sorted(shapes[0]):
        finite, found = results[name]
        if not finite:
            nonfinite.append(name)
        if base is None or name not in shapes[base]:
            continue
        if shapes[base][name] != shapes[0][name]:
            problems.append(f"{name}: merge {shapes[0][name]}, base {shapes[base][name]}")
            continue
        assert found is not None
        others = [k for k, i in enumerate(parents) if shapes[i].get(name) == shapes[base][name]]
        entry = sums[group_of(name, first_mtp)]
        entry[0] += found[0]
        for k, value in zip(others, found[1:-1]):
            entry[1 + k] += value
        entry[-2] += found[-1]
        entry[-1] += 1
    missing = [n for i in (base, *parents) if i is not None for n in shapes[i] if n not in shapes[0]]
    problems.extend(f"{n}: not in the merge" for n in sorted(set(missing)))
    groups = [_group(layer, kind, v, weights) for (layer, kind), v in sorted(sums.items(), key=_order)]
    return StaticFigures(parameters=parameters, nonfinite=tuple(nonfinite), shape_problems=tuple(problems),
                         groups=tuple(groups), unmoved=_unmoved(sums, weights))


def _spans(reader: CastReader, name: str, values: int) -> list[tuple[int, int]]:
    """The spans a tensor of ``values`` values is read in: whole blocks of :data:`_SPAN` values where the reader
    can read a span alone, else the whole tensor at once."""
    if not reader.spannable(name) or values <= _SPAN:
        return [(0, values)]
    return [(start, min(start + _SPAN, values)) for start in range(0, values, _SPAN)]


def _read_only(reader: CastReader, name: str, values: int) -> None:
    """Read tensor ``name`` (``values`` values) a span at a time, nothing kept: its bytes pass the model's checks."""
    for a, b in _spans(reader, name, values):
        reader.read_span(name, a, b)


def _finite(reader: CastReader, name: str, values: int) -> bool:
    return all(all_finite(reader.read_span(name, a, b)) for a, b in _spans(reader, name, values))


def all_finite(values: torch.Tensor) -> bool:
    """Whether every value is finite: where their sum is (an inf or a NaN among them would make it inf or NaN),
    else as :func:`torch.isfinite` finds (a sum of large finite values may overflow). The sum is a fifth of the
    cost of ``isfinite`` (which writes a flag per value)."""
    return math.isfinite(float(values.sum())) or bool(torch.isfinite(values).all())


def _tensor_sums(readers: list[CastReader], name: str, values: int, base: int, parents: list[int]
                 ) -> tuple[list[float], bool]:
    """For one tensor of the merge, the base and ``parents`` (all of one shape): [‖M−B‖², ‖Pᵢ−B‖² each,
    ‖B‖²] and whether the merge's values are all finite, read a span at a time (of every model the same span:
    at most three spans are held, never a whole embedding). Each sum runs over the same blocks in the same
    order whatever the spans, so the figures do not depend on them."""
    totals = [0.0] * (len(parents) + 2)
    finite = True
    differences = difference_buffer()
    spans = _spans(readers[0], name, values) if all(readers[i].spannable(name) for i in (base, *parents)) \
        else [(0, values)]
    for a, b in spans:
        merged = readers[0].read_span(name, a, b)
        finite = finite and all_finite(merged)
        reference = readers[base].read_span(name, a, b)
        totals[0] = squared(merged, reference, totals[0], differences)
        del merged  # two spans at most are held: the base's and one other
        for k, index in enumerate(parents):
            other = readers[index].read_span(name, a, b)
            totals[1 + k] = squared(other, reference, totals[1 + k], differences)
            del other
        totals[-1] = squared(reference, None, totals[-1])
        del reference
    return totals, finite


def squared(values: torch.Tensor, minus: torch.Tensor | None = None, total: float = 0.0,
            scratch: torch.Tensor | None = None) -> float:
    """``total`` + ‖values − minus‖² (‖values‖² without ``minus``), a block of rows at a time: no difference of
    a whole embedding is held, and each block's norm is taken in float32 as torch reduces it. ``scratch`` (a
    :func:`difference_buffer`) takes each block's difference: the same values, without a fresh 4 MB allocation per
    block (mapped and faulted in anew by the tuned allocator, :mod:`resumerge.machine.memory.allocator`: 2-3x the
    cost)."""
    flat, other = values.reshape(-1), None if minus is None else minus.reshape(-1)
    for start in range(0, flat.numel(), _BLOCK):
        block = flat[start:start + _BLOCK]
        if other is not None:
            part = other[start:start + _BLOCK]
            block = block - part if scratch is None else torch.sub(block, part, out=scratch[:block.numel()])
        total += float(torch.linalg.vector_norm(block)) ** 2
    return total


def difference_buffer() -> torch.Tensor:
    """A buffer for :func:`squared`'s differences (one block, 4 MB)."""
    return torch.empty(_BLOCK, dtype=torch.float32)


def _label(models: Sequence[Checked], index: int) -> str:
    """``merge``, ``base``, ``parent 1`` …"""
    role = models[index].role
    return role if role != "parent" else f"parent {sum(m.role == 'parent' for m in models[:index + 1])}"


def _order(item: tuple[tuple[int | None, str], list[float]]) -> tuple[int, str]:
    (layer, kind), _ = item
    return (-1 if layer is None else layer, kind)


def _weights(given: list[float | None]) -> list[float]:
    if not given or any(w is None or w <= 0 for w in given):
        return [1.0] * len(given)
    return [float(w) for w in given if w is not None]


def _movement(values: list[float], weights: list[float]) -> tuple[float, float]:
    """(the merge's movement, the parents' weighted mean movement) from a group's sums."""
    parents = values[1:1 + len(weights)]
    mean = sum(w * math.sqrt(v) for w, v in zip(weights, parents)) / sum(weights) if weights else 0.0
    return math.sqrt(values[0]), mean


def _group(layer: int | None, kind: str, values: list[float], weights: list[float]) -> GroupFigures:
    merge, parents = _movement(values, weights)
    return GroupFigures(layer=layer, kind=kind, tensors=int(values[-1]), merge_moved=merge, parents_moved=parents,
                        ratio=merge / parents if parents > 0 else None)


def _unmoved(sums: dict[tuple[int | None, str], list[float]], weights: list[float]) -> tuple[str, ...]:
    """The kinds (over all layers) the parents moved and the merge did not."""
    per_kind: dict[str, list[float]] = defaultdict(lambda: [0.0] * (len(weights) + 3))
    for (_, kind), values in sums.items():
        per_kind[kind] = [a + b for a, b in zip(per_kind[kind], values)]
    named = []
    for kind, values in sorted(per_kind.items()):
        merge, parents = _movement(values, weights)
        if parents > _PARENTS_MOVED * math.sqrt(values[-2]) and merge < UNMOVED_RATIO * parents:
            named.append(f"{kind}: the merge moved {merge:.4g} from the base where the parents moved {parents:.4g} "
                         f"(ratio {merge / parents:.3g} < {UNMOVED_RATIO})")
    return tuple(named)

"""The slices of a stack of layers: a config's ``models:`` or ``slices:`` form (or a ``modules:`` entry's) as one
list of :class:`Slice`, each checked against the models' layouts and the merge method before a tensor is planned,
and what a stack of slices leaves out of each model."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from resumerge.config.merge_config import SliceConfig, SourceConfig
from resumerge.config.modelref import ModelRef
from resumerge.config.params import Setting
from resumerge.errors import ConfigError
from resumerge.merge.methods.registry import BasePolicy, MethodSpec
from resumerge.merge.plan.accounting import Drops
from resumerge.merge.plan.architecture import Layout
from resumerge.merge.plan.modules import refuse_sliced_modules

# Why a planner leaves input tensors out (resumerge.merge.plan.accounting).
OUTSIDE_SLICES = "layers outside the slices"


@dataclass(frozen=True)
class Slice:
    """One slice of a stack of layers: its sources and the layer range each gives (one length), its base, its
    parameters and where it is in the YAML."""

    sources: tuple[SourceConfig, ...]
    ranges: tuple[tuple[int, int], ...]
    base: ModelRef | None
    parameters: Mapping[str, Setting]
    yaml_path: str
    # The ``modules:`` entry the slice belongs to: its parameters come between the slice's and the top level's.
    module_parameters: Mapping[str, Setting] = field(default_factory=dict)
    module_path: str = ""


def normalise(
    models: tuple[SourceConfig, ...] | None,
    slices: tuple[SliceConfig, ...] | None,
    base: ModelRef | None,
    layouts: Mapping[str, Layout],
    *,
    root: str = "",
    module_parameters: Mapping[str, Setting] | None = None,
) -> list[Slice]:
    """The slices of a ``models:`` or ``slices:`` form (of the config, or of the ``modules:`` entry at ``root``):
    a models form becomes one slice over every layer of each model, the base model added when not listed."""
    module_params = module_parameters or {}
    if models is not None:
        where = f"{root}.models" if root else "models"
        sources = list(models)
        if base is not None and base.key not in {s.model.key for s in sources}:
            # mergekit: "Base model specified but not in input models - adding"
            sources.insert(0, SourceConfig(base, None, {}, "base_model"))
        counts = {s.model.key: layouts[s.model.key].num_layers for s in sources}
        if len(set(counts.values())) > 1:
            listing = ", ".join(f"{k}: {v}" for k, v in counts.items())
            raise ConfigError(
                f"models have different layer counts ({listing})",
                yaml_path=where,
                hint="use slices: with matching layer_range lengths per slice",
            )
        n = next(iter(counts.values()))
        return [Slice(tuple(sources), tuple((0, n) for _ in sources), base, {}, where, module_params, root)]
    out = []
    for sl in slices or ():
        for src in sl.sources:
            layout = layouts[src.model.key]
            refuse_sliced_modules(src.model.key, layout.layer_prefix, layout.other_modules, f"{src.yaml_path}.model")
        ranges = tuple(s.layer_range or (0, 0) for s in sl.sources)
        out.append(Slice(sl.sources, ranges, sl.base_model or base, sl.parameters, sl.yaml_path, module_params,
                          root))
    return out


def _refuse_no_stack(key: str, layout: Layout, yaml_path: str) -> None:
    """Refuse a ``layer_range`` of a model whose tensors hold no one list of numbered decoder layers: XLM keeps
    each layer's attention, norms and feed-forward in lists of their own (``attentions.N``, ``ffns.N``, …), which
    a slice cannot take whole layers from."""
    lists = sorted({found.group(1) for name in (*layout.pre, *layout.post)
                    if (found := re.match(r"(.+?)\.\d+\.", name)) is not None})
    what = (f"keeps its layers' parts in separate numbered lists ({', '.join(lists)}), not one list of decoder "
            "layers" if len(lists) > 1 else "holds no list of numbered decoder layers")
    raise ConfigError(f"{key} {what}: a layer_range cannot take whole layers from it", yaml_path=yaml_path,
                      hint="merge it in the models: form (every tensor merged by its name)")


def check_slice(sl: Slice, method: MethodSpec, layouts: Mapping[str, Layout]) -> None:
    """Raise ConfigError for a slice whose ranges run past a model's layers or differ in length, or whose sources
    ``method`` does not take (its base, its number of models)."""
    for src, (start, end) in zip(sl.sources, sl.ranges):
        available = layouts[src.model.key].num_layers
        if end > 0 and available == 0:
            _refuse_no_stack(src.model.key, layouts[src.model.key], f"{src.yaml_path}.layer_range")
        if end > available:
            raise ConfigError(
                f"layer_range [{start}, {end}] is past the end of {src.model.key}, which has {available} layers",
                yaml_path=f"{src.yaml_path}.layer_range",
                hint=f"use an end of at most {available} (end is exclusive)",
            )
    lengths = {src.model.key + f"[{s}:{e}]": e - s for src, (s, e) in zip(sl.sources, sl.ranges)}
    if len(set(lengths.values())) > 1:
        listing = ", ".join(f"{k} has {v}" for k, v in lengths.items())
        raise ConfigError(
            f"All inputs to a slice must contain the same number of layers: {listing}",
            yaml_path=f"{sl.yaml_path}.sources",
            hint="give each source the same layer_range length, or put them in separate slices",
        )
    n = len(sl.sources)
    base_in = sl.base is not None and sl.base.key in {s.model.key for s in sl.sources}
    if method.base is BasePolicy.REQUIRED and not base_in:
        what = "no base_model is set" if sl.base is None else f"base {sl.base.key} is not among its sources"
        raise ConfigError(
            f"merge method {method.name} requires a base model, but {what}",
            yaml_path=sl.yaml_path,
            hint="set base_model and list it among the slice's sources",
        )
    others = n - (1 if base_in else 0)
    low = method.min_non_base or 0
    if others < low or (method.max_non_base is not None and others > method.max_non_base):
        want = f"exactly {low}" if method.max_non_base == low else f"at least {low}"
        raise ConfigError(
            f"merge method {method.name} takes {want} models besides the base, got {others}",
            yaml_path=f"{sl.yaml_path}.sources" if not sl.yaml_path.endswith("models") else sl.yaml_path,
        )
    if n < method.min_inputs or (method.max_inputs is not None and n > method.max_inputs):
        want = (
            f"exactly {method.min_inputs}"
            if method.max_inputs == method.min_inputs
            else f"at least {method.min_inputs}"
            if method.max_inputs is None
            else f"{method.min_inputs} to {method.max_inputs}"
        )
        raise ConfigError(
            f"merge method {method.name} takes {want} inputs (base included), got {n}",
            yaml_path=f"{sl.yaml_path}.sources" if not sl.yaml_path.endswith("models") else sl.yaml_path,
        )


def left_out(slices: Sequence[Slice], layouts: Mapping[str, Layout], drops: Drops) -> None:
    """Tell ``drops`` what a stack of ``slices`` leaves out of each model of ``layouts``: its layers no slice takes,
    its pre-layer tensors unless it is in the first slice, its post-layer ones unless it is in the last."""
    taken: dict[str, set[int]] = {}
    for sl in slices:
        for src, (start, end) in zip(sl.sources, sl.ranges):
            taken.setdefault(src.model.key, set()).update(range(start, end))
    first, last = ({s.model.key for s in sl.sources} for sl in (slices[0], slices[-1]))
    for key, layout in layouts.items():
        outside = (i for i in range(layout.num_layers) if i not in taken.get(key, ()))
        drops.add(key, (layout.layer_name(i, s) for i in outside for s in layout.suffixes_of(i)), OUTSIDE_SLICES)
        if key not in first:
            drops.add(key, layout.pre, "pre-layer tensors come from the first slice's models")
        if key not in last:
            drops.add(key, layout.post, "post-layer tensors come from the last slice's models")

"""A genotype (the flat list of numbers CMA-ES proposes) turned into a merge config.

For mergekit-evolve's methods (linear, task_arithmetic, ties, dare_ties, slerp) the genotype and the config are
mergekit 0.1.5's (``ModelGenome``: the genotype shaped (layer groups, models, filters + 1, parameters), weights
made positive unless negative weights are allowed, densities held to [0, 1], ``smooth`` parameters given per group
as a gradient, slerp's two heaviest models per group), so a search here and one there propose the same merges.
resumerge's other methods whose parameters are numbers (della, breadcrumbs, tsv, iso_c, ...) get the same shape
for their per-model numbers, followed by one block (layer groups, filters + 1, parameters) for their global numbers
(tsv's ``scaling``, della's ``lambda``), each held to the bounds the method declares."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from resumerge.errors import ConfigError
from resumerge.machine.torch_import import torch
from resumerge.merge.methods.registry import BasePolicy, Scope, get_method
from resumerge.runs.evolve.spec import MERGEKIT_METHODS, Genome

# Global parameters that tune arithmetic, not the merge (a tolerance, an epsilon against division by zero).
_NUMERICAL = frozenset({"eps", "tol", "epsilon"})


@dataclass(frozen=True)
class Layout:
    """The genotype's shape: ``groups`` of layers, ``models``, parameter ``sets`` (one per filter, then the rest),
    the per-model parameters searched, and the global ones (resumerge's methods only) with their first values
    and bounds."""

    groups: int
    models: int
    sets: int
    per_model: tuple[str, ...]
    global_: tuple[str, ...] = ()
    global_start: tuple[float, ...] = ()
    # The first value of each per-model number but the weight (None: mergekit's 1).
    per_model_start: tuple[float, ...] | None = None
    bounds: tuple[tuple[str, float | None, float | None], ...] = ()

    @property
    def size(self) -> int:
        """How many numbers a genotype holds."""
        return self.groups * self.sets * (self.models * len(self.per_model) + len(self.global_))


def layout_of(genome: Genome, layers: int) -> Layout:
    """The genotype's layout for ``genome`` over models of ``layers`` decoder layers; raises :class:`ConfigError`
    (naming the YAML path) for a granularity that does not divide the layers, a method resumerge does not have,
    one with no number to search, or a method that needs a base without one."""
    if genome.granularity and layers % genome.granularity:
        raise ConfigError(f"the models have {layers} layers, not a multiple of {genome.granularity}",
                          yaml_path="genome.layer_granularity", hint="pick a divisor of the layer count, or 0")
    groups = layers // genome.granularity if genome.granularity else 1
    sets = len(genome.filters) + 1
    spec = get_method(genome.method)
    if spec is None:
        raise ConfigError(f"unknown merge method {genome.method!r}", yaml_path="genome.merge_method")
    # mergekit-evolve's slerp names a base per layer group itself; its other methods need the genome's.
    needs_base = genome.method in ("ties", "dare_ties", "task_arithmetic") if genome.method in MERGEKIT_METHODS \
        else spec.base is BasePolicy.REQUIRED
    if needs_base and genome.base is None:
        raise ConfigError(f"{genome.method} needs a base_model", yaml_path="genome.base_model")
    if genome.method in MERGEKIT_METHODS:
        return Layout(groups, len(genome.models), sets, MERGEKIT_METHODS[genome.method])
    floats = [p for p in spec.params if p.kind is float]
    per_model = [p.name for p in floats if p.scope is not Scope.GLOBAL]
    per_model.sort(key=lambda name: name != "weight")  # weight first, as mergekit's genome has it
    globals_ = [p for p in floats if p.scope is Scope.GLOBAL and p.name not in _NUMERICAL]
    if not per_model and not globals_:
        raise ConfigError(f"{genome.method} has no numeric parameter to search", yaml_path="genome.merge_method",
                          hint="pick a method with weights, densities or a scaling (ties, della, tsv, ...)")
    start = tuple(float(p.default) if p.default is not None else 0.5 for p in globals_)
    defaults = {p.name: p.default for p in floats}
    own_start = tuple(float(defaults[n]) if defaults[n] is not None else 1.0 for n in per_model)
    bounds = tuple((p.name, p.minimum, p.maximum) for p in floats)
    return Layout(groups, len(genome.models), sets, tuple(per_model), tuple(p.name for p in globals_), start,
                  own_start, bounds)


def initial_genotype(layout: Layout) -> list[float]:
    """mergekit's first genotype: every weight 1/models, every other per-model number 1 (resumerge's methods: its
    default, della's epsilon 0.15); the global numbers at the method's defaults."""
    if layout.per_model_start is None:  # mergekit's: the first number (weight, or slerp's t) 1/models, the rest 1
        first = [1.0 / layout.models] + [1.0] * (len(layout.per_model) - 1)
    else:
        first = [1.0 / layout.models if name == "weight" else layout.per_model_start[i]
                 for i, name in enumerate(layout.per_model)]
    values = [v for _ in range(layout.groups) for _ in range(layout.models) for _ in range(layout.sets)
              for v in first]
    return values + [v for _ in range(layout.groups) for _ in range(layout.sets) for v in layout.global_start]


def random_genotype(layout: Layout, seed: int) -> list[float]:
    """mergekit's first genotype under ``random_init``: every number uniform in [0, 1) (its ``torch.rand``), here
    drawn from a generator of ``seed`` (PCG64, not the strategy's own stream) so a resumed search starts alike."""
    import numpy as np

    return [float(v) for v in np.random.default_rng(seed).random(layout.size)]


def merge_config(genome: Genome, layout: Layout, layers: int, genotype: Sequence[float]) -> dict[str, Any]:
    """The merge config (a plain mapping, keys in mergekit's order, None left out) genotype ``genotype`` becomes."""
    if len(genotype) != layout.size:
        raise ValueError(f"a genotype of {len(genotype)} numbers, not {layout.size}")
    x = torch.tensor([float(v) for v in genotype], dtype=torch.float64)
    split = layout.groups * layout.models * layout.sets * len(layout.per_model)
    own = x[:split].view(layout.groups, layout.models, layout.sets, len(layout.per_model))
    shared = x[split:].view(layout.groups, layout.sets, len(layout.global_))
    step = genome.granularity or layers
    if genome.method == "slerp":
        slices: list[dict[str, Any]] | None = _slerp_slices(genome, own, step)
        models = None
    else:
        arrays = {name: _held(genome, layout, name, own[:, :, :, i]) for i, name in enumerate(layout.per_model)}
        globals_ = {name: _held(genome, layout, name, shared[:, :, i]) for i, name in enumerate(layout.global_)}
        if genome.smooth:
            slices, models = None, _smooth_models(genome, layout, arrays, layers)
        else:
            slices, models = _discrete_slices(genome, layout, arrays, globals_, step), None
    parameters = _top_parameters(genome, layout, globals_ if genome.smooth and genome.method != "slerp" else {})
    doc = {"merge_method": genome.method, "slices": slices, "models": models, "parameters": parameters,
           "dtype": "bfloat16", "base_model": genome.base, "tokenizer_source": genome.tokenizer_source}
    return {key: value for key, value in doc.items() if value is not None}


def _held(genome: Genome, layout: Layout, name: str, values: torch.Tensor) -> torch.Tensor:
    """``values`` of parameter ``name`` as the merge takes them: a density's magnitude held to [0, 1]; a weight
    (or slerp's t) its magnitude unless negative weights are allowed; another number held to its method's bounds."""
    if name == "density":
        return torch.abs(values).clamp(0, 1)
    if name in ("weight", "t"):
        return values if genome.allow_negative else torch.abs(values)
    for bound_name, low, high in layout.bounds:
        if bound_name == name and (low is not None or high is not None):
            return values.clamp(low, high)
    return values


def _filtered(genome: Genome, values: torch.Tensor, one: bool) -> Any:
    """A parameter's value over the sets of ``values`` (last axis): a number (``one``: a single group) or a list
    over groups where there are no filters; else mergekit's list of ``{filter, value}``."""
    def value(v: torch.Tensor) -> Any:
        return v.item() if one else _single(v.tolist())

    if values.shape[-1] == 1:
        return value(values[..., 0])
    return [{"filter": f, "value": value(values[..., s])} for s, f in enumerate([*genome.filters, None])]


def _single(values: list[float]) -> float | list[float]:
    return values[0] if len(values) == 1 else values


def _range(genome: Genome, index: int, step: int) -> list[int]:
    return [index * step, (index + 1) * step]


def _base_source(genome: Genome, layer_range: list[int] | None) -> list[dict[str, Any]]:
    """The base as a source of its own where it is not one of the searched models (mergekit's rule)."""
    if genome.base is None or genome.base in genome.models:
        return []
    return [{"model": genome.base, "layer_range": layer_range} if layer_range is not None else {"model": genome.base}]


def _discrete_slices(genome: Genome, layout: Layout, arrays: dict[str, torch.Tensor],
                     globals_: dict[str, torch.Tensor], step: int) -> list[dict[str, Any]]:
    slices = []
    for g in range(layout.groups):
        sources: list[dict[str, Any]] = [
            {"model": model, "layer_range": _range(genome, g, step),
             "parameters": {name: _filtered(genome, values[g, m], True) for name, values in arrays.items()}}
            for m, model in enumerate(genome.models)]
        found: dict[str, Any] = {"sources": sources + _base_source(genome, _range(genome, g, step))}
        if globals_:
            found["parameters"] = {name: _filtered(genome, values[g], True) for name, values in globals_.items()}
        slices.append(found)
    return slices


def _smooth_models(genome: Genome, layout: Layout, arrays: dict[str, torch.Tensor],
                   layers: int) -> list[dict[str, Any]]:
    models: list[dict[str, Any]] = [
        {"model": model, "layer_range": [0, layers],
         "parameters": {name: _filtered(genome, values[:, m], False) for name, values in arrays.items()}}
        for m, model in enumerate(genome.models)]
    return models + _base_source(genome, None)


def _top_parameters(genome: Genome, layout: Layout, smooth_globals: dict[str, torch.Tensor]) -> dict[str, Any]:
    """mergekit's ``normalize`` (its default: on for ties, dare_ties and linear) and ``int8_mask``; for
    resumerge's methods only those the method has, and with ``smooth`` the global numbers as gradients."""
    normalize = genome.normalize
    if normalize is None:
        normalize = genome.method in ("ties", "dare_ties", "linear")
    if genome.method in MERGEKIT_METHODS:
        return {"normalize": normalize, "int8_mask": True}
    spec = get_method(genome.method)
    names = {p.name for p in spec.params} if spec is not None else set()
    found: dict[str, Any] = {}
    if "normalize" in names and genome.normalize is not None:
        found["normalize"] = genome.normalize
    if "int8_mask" in names:
        found["int8_mask"] = True
    for name, values in smooth_globals.items():
        found[name] = _filtered(genome, values, False)
    return found


def _slerp_slices(genome: Genome, own: torch.Tensor, step: int) -> list[dict[str, Any]]:
    """Per group, the two models of largest weight (torch's topk, as mergekit picks them) and t from their
    softmax."""
    slices = []
    for g in range(own.shape[0]):
        chosen = torch.topk(own[g, :, 0, 0], 2)
        t = torch.softmax(chosen.values, dim=-1)[1].item()
        first, second = (int(i) for i in chosen.indices.tolist())
        sources: list[dict[str, Any]] = [{"model": genome.models[i], "layer_range": _range(genome, g, step)}
                                         for i in (first, second)]
        if genome.tokenizer_source:
            sources[0]["parameters"] = {"weight": 1 - t}
            sources[1]["parameters"] = {"weight": t}
        slices.append({"sources": sources + _base_source(genome, _range(genome, g, step)),
                       "parameters": {"t": t}, "base_model": genome.models[first]})
    return slices


def tokenizer_model(genome: Genome) -> str | None:
    """The model whose tokenizer every candidate gets (``tokenizer_source``'s model, else the base, else the first
    model, as ``run`` copies it, where that is a local folder); None where each candidate's own is read (a
    ``union`` built per candidate, or a hub model's)."""
    source = genome.tokenizer_source
    if source == "union":
        return None
    found = source if source is not None and source != "base" else genome.base or genome.models[0]
    return None if found.startswith("hf://") else found

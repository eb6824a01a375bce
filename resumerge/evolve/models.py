"""The genome's models judged from their headers alone, before any weight is read: one shape (the same tensors,
each of the same shape), the decoder layers a layer group divides, every filter matching some tensor, and each
``kl`` task's parent a model of that shape too."""

from __future__ import annotations

from collections.abc import Mapping

from resumerge.config.locations import StateDir
from resumerge.errors import ConfigError
from resumerge.evolve.spec import EvolveSpec
from resumerge.forward.opened import open_for_pass


def genome_layers(spec: EvolveSpec, state: StateDir) -> int:
    """The decoder layers of the genome's models; raises :class:`ConfigError` (naming the YAML path) where two of
    them differ in shape, a filter matches no tensor, or a config.json names no layer count."""
    genome = spec.genome
    named = [(f"genome.models[{i}]", m) for i, m in enumerate(genome.models)]
    if genome.base is not None and genome.base not in genome.models:
        named.append(("genome.base_model", genome.base))
    named += [(f"tasks[{i}].kl.parent", t.parent) for i, t in enumerate(spec.tasks) if t.parent is not None]
    shapes: list[tuple[str, str, Mapping[str, tuple[int, ...]]]] = []
    layers = None
    for where, path in named:
        opened = open_for_pass(path, where, state).opened
        shapes.append((where, path, {name: tuple(source.entry.shape) for name, source in opened.tensors.items()}))
        if layers is None:
            config = opened.config.get("text_config") or opened.config
            layers = config.get("num_hidden_layers") if isinstance(config, dict) else None
    first_where, first_path, first = shapes[0]
    for where, path, found in shapes[1:]:
        differs = sorted(set(first) ^ set(found)) or [n for n in first if first[n] != found[n]]
        if differs:
            name = differs[0]
            raise ConfigError(f"{path} is not the shape of {first_path}: tensor {name} is "
                              f"{_shape(found.get(name))} there, {_shape(first.get(name))} in {first_path}",
                              yaml_path=where, hint="a genome merges models of one architecture and size")
    for i, text in enumerate(genome.filters):
        if not any(text in name for name in first):
            raise ConfigError(f"filter {text!r} matches no tensor of {first_path}",
                              yaml_path=f"genome.filters[{i}]", hint="a filter is a substring of tensor names")
    if not isinstance(layers, int) or layers < 1:
        raise ConfigError(f"{first_path}'s config.json gives no num_hidden_layers", yaml_path=first_where)
    return layers


def _shape(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else "x".join(map(str, shape)) or "a scalar"

"""The genome's models judged from their headers alone, before any weight is read: one shape (the same tensors,
each of the same shape), the decoder layers a layer group divides, every filter matching some tensor, and each
``kl`` task's parent a model of that shape too, but for its vocabulary's rows: a parent of another vocabulary (a
fine-tune with added tokens, a ``tokenizer_source: union`` candidate's parent) is measured over the tokens both hold,
as ``eval`` measures it (:mod:`.generation`); whether they can meet is judged from the tokenizers when the texts are
read."""

from __future__ import annotations

from collections.abc import Mapping

from resumerge.config.locations import StateDir
from resumerge.errors import ConfigError
from resumerge.forward.opening.opened import open_for_pass
from resumerge.forward.text.vocabs import model_rows
from resumerge.runs.evolve.spec import EvolveSpec


def genome_layers(spec: EvolveSpec, state: StateDir) -> int:
    """The decoder layers of the genome's models; raises :class:`ConfigError` (naming the YAML path) where two of
    them differ in shape (a ``kl`` task's parent may differ in its vocabulary's rows alone: :func:`_vocab_rows`), a
    filter matches no tensor, or a config.json names no layer count."""
    genome = spec.genome
    named = [(f"genome.models[{i}]", m) for i, m in enumerate(genome.models)]
    if genome.base is not None and genome.base not in genome.models:
        named.append(("genome.base_model", genome.base))
    named += [(f"tasks[{i}].kl.parent", t.parent) for i, t in enumerate(spec.tasks) if t.parent is not None]
    shapes: list[tuple[str, str, Mapping[str, tuple[int, ...]]]] = []
    rows: list[int | None] = []
    layers = None
    for where, path in named:
        opened = open_for_pass(path, where, state).opened
        shapes.append((where, path, {name: tuple(source.entry.shape) for name, source in opened.tensors.items()}))
        rows.append(model_rows(opened.config))
        if layers is None:
            config = opened.config.get("text_config") or opened.config
            layers = config.get("num_hidden_layers") if isinstance(config, dict) else None
    first_where, first_path, first = shapes[0]
    for (where, path, found), own in zip(shapes[1:], rows[1:]):
        vocab = (rows[0], own) if where.startswith("tasks[") else None
        differs = sorted(set(first) ^ set(found)) or [n for n in first if first[n] != found[n]
                                                      and not _vocab_rows(first[n], found[n], vocab)]
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


def _vocab_rows(ours: tuple[int, ...], theirs: tuple[int, ...], rows: tuple[int | None, int | None] | None) -> bool:
    """Whether a tensor of shape ``theirs`` differs from ``ours`` in its vocabulary's rows alone (``rows``: the
    genome's vocabulary size and the kl parent's; None: not a kl parent, whose shapes must be the same)."""
    if rows is None or None in rows or rows[0] == rows[1] or len(ours) != len(theirs) or not ours:
        return False
    return (ours[0], theirs[0]) == rows and ours[1:] == theirs[1:]


def _shape(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else "x".join(map(str, shape)) or "a scalar"

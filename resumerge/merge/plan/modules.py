"""Multi-module models (VLMs): which numbered tensors are layers, and which layer stack is the language model's.

A multimodal checkpoint numbers several stacks of layers: the language model's (``language_model.model.layers.N``
in Llava / Gemma 3 / Mistral 3 checkpoints as transformers 5 saves them, ``model.layers.N`` in Qwen2-VL,
``model.text_model.layers.N`` in Idefics3 / SmolVLM), and the vision tower's (``vision_tower.encoder.layers.N``,
``vision_tower.vision_model.encoder.layers.N`` in llava-1.5 hub checkpoints, ``vision_tower.transformer.layers.N``
in Mistral 3, ``visual.blocks.N`` in Qwen2-VL). Each stack is a *module* merged with its own layer numbering, as
mergekit defines it (``mergekit-modules-moe.md`` §1.5): layer ``k`` of an ``n``-layer module gets
``t = k / (n - 1)``.

Not every numbered name is a layer: ``visual.merger.mlp.0.weight`` and ``visual.merger.mlp.2.weight`` (the
Qwen2-VL projector) index an ``nn.Sequential``. When a model numbers tensors under several prefixes, only the
prefixes whose last part names a layer container (:data:`LAYER_CONTAINERS`) are modules; the other numbered
tensors are loose tensors merged at ``t = 0`` like the projector's others (mergekit plans them twice and gives
them the gradient's last value; defect 3 of the reference). A model with one numbered prefix keeps it as its layer
stack whatever its name, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from resumerge.errors import ConfigError, ModelInputError

T = TypeVar("T")

# Names of the containers that hold a model's layers across transformers families.
LAYER_CONTAINERS = frozenset({"layers", "layer", "h", "blocks", "block"})


@dataclass(frozen=True)
class ModuleLayout:
    """One stack of numbered layers: its prefix, layer count and the suffixes each layer holds (sorted)."""

    prefix: str
    num_layers: int
    suffixes_by_layer: tuple[tuple[str, ...], ...]

    def layer_name(self, index: int, suffix: str) -> str:
        """Full tensor name of ``suffix`` in layer ``index``."""
        return f"{self.prefix}.{index}.{suffix}"


def layer_stacks(numbered: Mapping[str, Mapping[int, list[str]]]) -> tuple[dict[str, dict[int, list[str]]], list[str]]:
    """Split numbered tensors (prefix → layer index → suffixes) into layer stacks and loose tensor names.

    With one prefix it is the layer stack; with several, only prefixes ending in a layer container are.
    """
    if len(numbered) <= 1:
        return {p: dict(v) for p, v in numbered.items()}, []
    stacks: dict[str, dict[int, list[str]]] = {}
    loose: list[str] = []
    for prefix, layers in numbered.items():
        if prefix.rsplit(".", 1)[-1] in LAYER_CONTAINERS:
            stacks[prefix] = dict(layers)
        else:
            loose.extend(f"{prefix}.{i}.{s}" for i, suffixes in layers.items() for s in suffixes)
    return stacks, loose


def module_of(layers: Mapping[int, list[str]], prefix: str) -> ModuleLayout:
    """The :class:`ModuleLayout` of the stack ``prefix`` (layer index → suffixes; missing indices are empty)."""
    found = max(layers) + 1 if layers else 0
    by_layer = tuple(tuple(sorted(layers.get(i, ()))) for i in range(found))
    return ModuleLayout(prefix, found, by_layer)


def language_stack(prefixes: Iterable[str], embedding: str | None, *, where: str) -> str | None:
    """The prefix of the language model's layers among several stacks: the one under the token embedding's
    parent (``language_model.model.embed_tokens.weight`` → ``language_model.model.layers``); None when several
    sit there (HRM's ``model.H_module.layers`` and ``model.L_module.layers``, which the language model runs in
    turn: every stack is the language model's, none alone).

    Raises :class:`ModelInputError` when no stack sits beside the embedding.
    """
    candidates = sorted(prefixes)
    if embedding is not None and "." in embedding:
        parent = embedding.rsplit(".", 2)[0] + "."
        beside = [p for p in candidates if p.startswith(parent)]
        if len(beside) == 1:
            return beside[0]
        if len(beside) > 1:
            return None
    raise ModelInputError(
        f"cannot tell which of the layer stacks {', '.join(candidates)} is the language model's",
        path=where,
        hint="the token embedding (…embed_tokens.weight) should sit beside the language model's layers",
    )


def plan_modules(
    keys: Sequence[str],
    modules: Mapping[str, tuple[ModuleLayout, ...]],
    make: Callable[[str, list[str], float], T],
    *,
    yaml_path: str,
) -> dict[str, T]:
    """Plan the layers of every module besides the language model for a ``models:`` merge of ``keys``.

    ``modules[key]`` are model ``key``'s other stacks; ``make(out_name, input_names, t)`` plans one tensor. Each
    module keeps its own numbering and gets ``t = k / (n - 1)`` over its own ``n`` layers (``t = 1`` when
    ``n == 1``), as mergekit does. Raises :class:`ConfigError` when the models' modules differ.
    """
    first = modules[keys[0]]
    for key in keys[1:]:
        if [(m.prefix, m.num_layers) for m in modules[key]] != [(m.prefix, m.num_layers) for m in first]:
            raise ConfigError(
                f"models have different modules: {keys[0]} has {_describe(first)}, {key} has {_describe(modules[key])}",
                yaml_path=yaml_path,
                hint="merge models of one architecture and size (their vision towers must match too)",
            )
    planned: dict[str, T] = {}
    for module in first:
        n = module.num_layers
        for k in range(n):
            t = 1.0 if n == 1 else k / (n - 1)
            for suffix in module.suffixes_by_layer[k]:
                name = module.layer_name(k, suffix)
                planned[name] = make(name, [name] * len(keys), t)
    return planned


def _describe(modules: tuple[ModuleLayout, ...]) -> str:
    return ", ".join(f"{m.prefix} ({m.num_layers} layers)" for m in modules) or "none"


def refuse_sliced_modules(key: str, text_prefix: str | None, modules: tuple[ModuleLayout, ...], yaml_path: str) -> None:
    """Refuse a ``slices:`` merge of a multi-module model: a ``layer_range`` cannot say which module it means
    (mergekit refuses it too). Raises :class:`ConfigError` naming the modules."""
    if modules and text_prefix is None:
        raise ConfigError(
            f"{key}'s language model runs its layer stacks {_describe(modules)} in turn: a layer_range cannot "
            "say which stack it slices, and a stack cut short is another model",
            yaml_path=yaml_path,
            hint="merge it in the models: form (every stack merged layer by layer)",
        )
    if modules:
        raise ConfigError(
            f"{key} is a multi-module model (language model {text_prefix}, and {_describe(modules)}): "
            "a layer_range cannot say which module it slices",
            yaml_path=yaml_path,
            hint="merge it in the models: form (every module merged layer by layer)",
        )

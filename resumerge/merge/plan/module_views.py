"""The ``modules:`` form: a multi-module model's tensors split into the modules mergekit names.

mergekit's JSON definitions of VLMs (Gemma 3, Mistral 3, Qwen2-VL, …) call them ``text_decoder`` (the language
model: its layers, token embedding, final norm and head), ``vision_tower`` (the vision layers and the tensors
beside them: patch and position embeddings, layer norms) and ``multi_modal_projector`` (everything else: the
projector / connector, Qwen2-VL's ``visual.merger``; no layers). Here the same three are found from the tensor
names of any two-stack model — so Llava and Idefics3 (no JSON definition in mergekit) get them too: each stack's
*root* is its prefix down to the first part where the two stacks' prefixes differ (``language_model.`` and
``vision_tower.``; ``model.text_model.`` and ``model.vision_model.``), and a loose tensor belongs to the module
whose root it starts with, heads to the text decoder, the rest to the projector.

Each module is given as a :class:`~resumerge.merge.plan.architecture.Layout` of its own, so the planner merges a
module's ``models`` or ``slices`` exactly as it merges a whole single-module model's: layer ``k`` of each slice at
``t = k / (n - 1)``, loose tensors before the layers from the first slice's models, the others from the last
slice's. Modules the config does not list are copied from the donor (see the planner).

For a model with no JSON definition (Llava) mergekit *infers* the modules and names them by their layer prefix in
transformers 5's in-memory layout (``model.language_model.layers``, ``model.vision_tower.encoder.layers``) plus
``default``, which holds every loose tensor (``mergekit-modules-moe.md`` §1.4, §2.3). Configs written with those
names are accepted with what the names denote there: each stack module holds only its layers and ``default`` every
loose tensor, as pre-layer tensors of a 0-layer module (:func:`inferred_views`). The prefix may be written as the
checkpoint names it too (``language_model.model.layers``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from resumerge.errors import ConfigError
from resumerge.merge.plan.architecture import Layout, is_head
from resumerge.merge.plan.modules import LAYER_CONTAINERS, ModuleLayout

if TYPE_CHECKING:
    from resumerge.config.merge_config import MergeConfig, ModuleConfig

TEXT, VISION, PROJECTOR = "text_decoder", "vision_tower", "multi_modal_projector"
MODULE_NAMES = (TEXT, VISION, PROJECTOR)
# mergekit's module of an inferred architecture's loose tensors.
DEFAULT = "default"
# Parts of a layer prefix that say which stack it is, whatever the layout (in-memory, saved, hub).
_TEXT_PARTS, _VISION_PARTS = frozenset({"language_model", "text_model"}), frozenset({"vision_tower", "vision_model",
                                                                                     "visual"})
# Parts that one layout adds and another leaves out (``language_model.model.layers``, ``model.language_model.layers``).
_FILLER_PARTS = frozenset({"model", "vision_model"})
# vision_config keys that hold the vision layer count, across families (Qwen2-VL: depth).
VISION_COUNT_KEYS = ("num_hidden_layers", "depth", "num_layers")


def module_views(layout: Layout, key: str, *, yaml_path: str) -> dict[str, Layout]:
    """The layout of each module of ``layout`` (model ``key``), by module name, in mergekit's planning order.

    Raises :class:`ConfigError` for a model that is not a two-stack (language + vision) model.
    """
    if layout.layer_prefix is None or len(layout.other_modules) != 1:
        what = "a single-module model" if not layout.other_modules else "a model with more than two layer stacks"
        raise ConfigError(
            f"modules: needs a language model and a vision tower, but {key} is {what}",
            yaml_path=yaml_path,
            hint="merge single-module models with models: or slices:",
        )
    vision = layout.other_modules[0]
    text_root, vision_root = _root(layout.layer_prefix, vision.prefix), _root(vision.prefix, layout.layer_prefix)
    owner = {}
    for name in (*layout.pre, *layout.post):
        if name.startswith(text_root) or is_head(name):
            owner[name] = TEXT
        elif name.startswith(vision_root) and "merger" not in name.split("."):
            owner[name] = VISION
        else:
            owner[name] = PROJECTOR
    text = ModuleLayout(layout.layer_prefix, layout.num_layers, layout.suffixes_by_layer)
    return {module: _view(layout, stack, owner, module)
            for module, stack in ((TEXT, text), (VISION, vision), (PROJECTOR, None))}


def inferred_module(name: str, layout: Layout) -> str | None:
    """The module (:data:`TEXT`, :data:`VISION` or :data:`DEFAULT`) that mergekit's inferred module name ``name``
    denotes in ``layout``, or None when ``name`` is not one of them.

    A stack is named by its layer prefix, as the checkpoint writes it or as transformers 5 holds it in memory
    (``model.language_model.layers`` for a checkpoint's ``language_model.model.layers``).
    """
    if name == DEFAULT:
        return DEFAULT
    if layout.layer_prefix is None or len(layout.other_modules) != 1:
        return None
    stacks = ((TEXT, layout.layer_prefix), (VISION, layout.other_modules[0].prefix))
    for module, prefix in stacks:
        if _core(name) == _core(prefix):
            return module
    parts = set(name.split("."))
    if name.rsplit(".", 1)[-1] not in LAYER_CONTAINERS or bool(parts & _TEXT_PARTS) == bool(parts & _VISION_PARTS):
        return None
    return TEXT if parts & _TEXT_PARTS else VISION


def _core(prefix: str) -> tuple[str, ...]:
    return tuple(p for p in prefix.split(".") if p not in _FILLER_PARTS)


def inferred_views(layout: Layout, key: str, *, yaml_path: str) -> dict[str, Layout]:
    """The modules of ``layout`` (model ``key``) as mergekit infers them: :data:`DEFAULT` (every loose tensor, as
    the pre-layer tensors of a 0-layer module), then the language model's layers, then the vision layers.

    Raises :class:`ConfigError` for a model that is not a two-stack (language + vision) model.
    """
    views = module_views(layout, key, yaml_path=yaml_path)
    loose = (*layout.pre, *layout.post)
    layers_only = {m: replace(views[m], pre=(), post=()) for m in (TEXT, VISION)}
    return {DEFAULT: Layout(None, 0, loose, (), (), ()), **layers_only}


def _view(layout: Layout, stack: ModuleLayout | None, owner: dict[str, str], module: str) -> Layout:
    pre = tuple(n for n in layout.pre if owner[n] == module)
    post = tuple(n for n in layout.post if owner[n] == module)
    if stack is None:
        return Layout(None, 0, pre, (), post, ())
    suffixes = tuple(sorted({s for layer in stack.suffixes_by_layer for s in layer}))
    mtp = layout.mtp if module == TEXT else None  # the language model's, planned after its last layer
    return Layout(stack.prefix, stack.num_layers, pre, suffixes, post, stack.suffixes_by_layer, mtp=mtp)


def _root(prefix: str, other: str) -> str:
    """``prefix`` down to the first part where it differs from ``other``, with a trailing dot."""
    mine, theirs = prefix.split("."), other.split(".")
    common = 0
    while common < min(len(mine), len(theirs)) - 1 and mine[common] == theirs[common]:
        common += 1
    return ".".join(mine[: common + 1]) + "."


def set_vision_layers(out_config: dict[str, object], count: int) -> None:
    """Write the output's vision layer count into ``vision_config`` (under the key the donor uses)."""
    vision = out_config.get("vision_config")
    if isinstance(vision, dict):
        key = next((k for k in VISION_COUNT_KEYS if type(vision.get(k)) is int), None)
        if key is not None:
            vision[key] = count


def module_names(config: MergeConfig, layout: Layout
                 ) -> tuple[tuple[str, ...], dict[str, str], dict[str, ModuleConfig]]:
    """The modules of ``config``'s ``modules:`` form to plan over models laid out as ``layout`` (the donor's), in
    order; the name each is shown by; and the listed ``modules:`` entries, all keyed by module (mergekit's JSON
    names, or its inferred names — ``default`` and the layer prefixes — taken as what they denote). Raises
    :class:`ConfigError` for an unknown name, or for the two kinds of names mixed."""
    entries = config.modules or ()
    inferred = {m.name: inferred_module(m.name, layout) for m in entries if m.name not in MODULE_NAMES}
    for entry in entries:
        if entry.name not in MODULE_NAMES and inferred[entry.name] is None:
            stacks = (layout.layer_prefix, *(m.prefix for m in layout.other_modules))
            raise ConfigError(f"{entry.name!r} is not a module of these models", yaml_path=entry.yaml_path,
                              hint=f"the modules are {', '.join(MODULE_NAMES)} (or mergekit's inferred names: "
                                   f"{', '.join(str(p) for p in (DEFAULT, *stacks) if p)})")
    if not inferred:
        return MODULE_NAMES, {n: n for n in MODULE_NAMES}, {m.name: m for m in entries}
    mixed = [m for m in entries if m.name in MODULE_NAMES]
    if mixed:
        raise ConfigError(f"{mixed[0].name!r} is one of mergekit's defined module names, but {next(iter(inferred))!r} "
                          "is one of its inferred ones: they split the model differently",
                          yaml_path=mixed[0].yaml_path,
                          hint=f"use {', '.join(MODULE_NAMES)}, or default and the layer prefixes, not both")
    listed: dict[str, ModuleConfig] = {}
    for entry in entries:
        module = inferred[entry.name]
        assert module is not None
        if module in listed:
            raise ConfigError(f"{entry.name!r} and {listed[module].name!r} name the same module",
                              yaml_path=entry.yaml_path, hint="list each module once")
        listed[module] = entry
    shown = {DEFAULT: DEFAULT, TEXT: str(layout.layer_prefix), VISION: layout.other_modules[0].prefix}
    shown.update({module: entry.name for module, entry in listed.items()})
    return (DEFAULT, TEXT, VISION), shown, listed

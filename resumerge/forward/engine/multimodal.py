"""The text part of a multimodal model (Llava, Gemma 3, Qwen2-VL, Qwen3-VL-MoE, Mistral 3, Idefics3, Llama 4 …) for a
layer-streamed pass.

transformers builds such a model as ``…ForConditionalGeneration``: no ``AutoModelForCausalLM`` class for some
(:func:`causal_lm_class` falls back to ``AutoModelForImageTextToText``), its base model holding a vision tower and
the language model (``language_model`` or ``text_model``). A pass over text-only tokens runs the language model's
embeddings and decoder layers (what the whole model runs when it is given no image) and the head of the whole
model (its soft-capping included).

The checkpoint names the language model's tensors in one of several layouts (``language_model.model.layers.N`` as
transformers 5 saves Llava and Gemma 3, ``model.layers.N`` as Qwen2-VL ships, ``model.text_model.layers.N``,
transformers 5's in-memory ``model.language_model.layers.N``), and the head ``lm_head`` or
``language_model.lm_head``: :func:`stored_prefixes` finds the checkpoint's own.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from resumerge.errors import ModelInputError
from resumerge.machine.torch_import import torch

_TEXT_PARTS = ("language_model", "text_model")
# Where checkpoints put a language model's tensors, besides where the built model has them.
_TEXT_ROOTS = ("language_model.model.", "model.language_model.", "model.text_model.", "model.", "language_model.",
               "text_model.", "")
_HEAD_ROOTS = ("", "language_model.")


def causal_lm_class(transformers: Any, config: Any) -> Any:
    """The auto class that builds ``config``'s model with its head: the causal-LM one, else (a multimodal model
    it does not map) the image-text-to-text one; :class:`ModelInputError` (exit 2, one line) where neither maps
    it (an encoder-decoder, a vision-only model)."""
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        if type(config) in auto._model_mapping:
            return auto
    raise ModelInputError(f"transformers {transformers.__version__} builds no causal language model for "
                          f"{type(config).__name__} (model_type {getattr(config, 'model_type', '?')!r}): a "
                          "layer-by-layer pass runs decoder-only language models and the text part of multimodal "
                          "ones")


def text_model(base: torch.nn.Module) -> torch.nn.Module:
    """The language model of a multimodal ``base`` model; ``base`` itself for a text model. Either is taken one
    level down where it is a causal LM itself, its text model its attribute ``model``: Llama 4's
    ``Llama4ForCausalLM``, whose ``base_model_prefix`` names no attribute (so it is its own ``base_model``), alone
    or as ``Llama4ForConditionalGeneration``'s ``language_model``."""
    for name in _TEXT_PARTS:
        part = getattr(base, name, None)
        if isinstance(part, torch.nn.Module) and part is not base:
            return _below_head(part)
    return _below_head(base)


def _below_head(module: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(module, "model", None)
    head = getattr(module, "get_output_embeddings", None)
    return inner if isinstance(inner, torch.nn.Module) and callable(head) and head() is not None else module


def head_site(model: Any, text: torch.nn.Module) -> tuple[Any, str]:
    """Where a pass's head puts its stand-in for the part of ``model`` that runs before the head: (the module whose
    forward computes the logits, the attribute of it to replace). ``model`` and its ``base_model_prefix``, unless
    that names no attribute (Llama 4): then the attribute holding ``text`` (the language model), or the causal LM
    inside ``model`` (a multimodal one) that holds it and the head."""
    attribute = getattr(model, "base_model_prefix", "")
    if attribute and isinstance(getattr(model, attribute, None), torch.nn.Module):
        return model, attribute
    for name, child in model.named_children():
        if child is text:
            return model, name
    head = model.get_output_embeddings()
    for child in model.children():
        if (child is not model and callable(getattr(child, "get_output_embeddings", None))
                and child.get_output_embeddings() is head and any(m is text for m in child.modules())):
            return head_site(child, text)
    raise ModelInputError(f"cannot find where {type(model).__name__} runs its language model before its head")


def stored_prefixes(model: Any, text: torch.nn.Module, stored: Collection[str]) -> list[tuple[str, str]]:
    """(built prefix, stored prefix) pairs that map the language model's and the head's module names in ``model``
    to the names of the ``stored`` tensors (empty where they are the same, or ``text`` is the whole base model)."""
    names = {id(m): n for n, m in model.named_modules()}
    if text is model.base_model:
        return []
    pairs = []
    root = names[id(text)] + "."
    found = _first(root, _TEXT_ROOTS, lambda p: any(n.startswith(p + "layers.0.") for n in stored))
    if found != root:
        pairs.append((root, found))
    head = model.get_output_embeddings()
    if head is not None:
        built = names[id(head)] + "."
        found = _first(built, [r + built for r in _HEAD_ROOTS], lambda p: any(n.startswith(p) for n in stored))
        if found != built:
            pairs.append((built, found))
    return pairs


def _first(built: str, candidates: Collection[str], holds: Callable[[str], bool]) -> str:
    return next((p for p in (built, *candidates) if holds(p)), built)


def renamed(name: str, pairs: list[tuple[str, str]]) -> str:
    """``name`` (a built module's prefix) as the checkpoint names it (see :func:`stored_prefixes`)."""
    for built, stored in pairs:
        if name.startswith(built):
            return stored + name[len(built):]
    return name

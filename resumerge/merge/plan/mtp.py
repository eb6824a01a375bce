"""Multi-token-prediction (MTP) modules: recognised in a checkpoint, and carried through a new layer stack.

Real checkpoints of two layouts carry one (``architectures-2026.md`` §2, §3):

- *indexed* (DeepSeek-V3/R1, Kimi-K2, GLM-4.5/4.6): ``num_nextn_predict_layers`` extra layers numbered after the
  decoder layers, ``model.layers.{num_hidden_layers + i}.*``: a decoder layer plus ``enorm``, ``hnorm``,
  ``eh_proj``, ``shared_head.{norm,head}`` and a stored copy of ``embed_tokens``. They are told from a stray layer
  by ``eh_proj`` (every MTP layer has it, no decoder layer does); transformers ignores them on load.
- *top-level* (Qwen3-Next, Qwen3.5): ``mtp.layers.{i}.*`` and loose ``mtp.*`` tensors (``fc``, ``norm``,
  ``pre_fc_norm_*``); transformers ignores ``^mtp.*``.

The rule, the same for both: the MTP module goes with the output's **last layer**. In a same-stack merge
(``models:``) it is merged like any layer, with the last layer's parameters (``t = 1``); in a ``slices:`` merge it
is taken from the last slice's models (merged when the slice has several) and renumbered after the output's last
layer, because those are the models whose last hidden state and head the output ends with: an MTP module is
trained on its own model's final hidden state and shares its head. Carrying is the default because MTP is only
used to draft tokens for speculative decoding, which the main model verifies: a module that fits the new stack
less well costs acceptance rate, never a wrong answer, while dropping it removes the feature from every serving
stack that uses it. When a model of the last slice has no MTP module, none is written and the config's count
says 0 (what NeMo RL's BF16 recipe does to V3). Its vocabulary tensors (the stored embedding and
``shared_head.head``) follow the embedding's and head's rules (``t = 0``, the output vocabulary) rather than the
layer's, as the tensors they copy do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

# The suffix only an indexed MTP layer holds (DeepSeek-V3's and GLM-4.5's ``eh_proj``, [H, 2H]).
_MARKER = "eh_proj.weight"
# Top-level MTP modules (Qwen3-Next, Qwen3.5): every tensor name under this part.
_TOP = "mtp"
# config.json keys that count MTP layers: DeepSeek/GLM (and what vLLM reads for Qwen3-Next), Qwen3.5.
COUNT_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
# Suffixes of an MTP layer's vocabulary tensors.
_VOCAB_SUFFIXES = ("embed_tokens.weight", "shared_head.head.weight")


@dataclass(frozen=True)
class MtpLayout:
    """A model's MTP module: its layers under ``prefix`` (numbered from ``first``: the decoder layer count for an
    indexed module, 0 for a top-level one) with the suffixes each holds, and its loose tensors (top-level only)."""

    prefix: str
    first: int
    suffixes_by_layer: tuple[tuple[str, ...], ...]
    loose: tuple[str, ...] = ()

    @property
    def indexed(self) -> bool:
        """Whether the MTP layers continue the decoder layers' numbering (DeepSeek-V3, GLM-4.5)."""
        return not self.prefix.startswith(_TOP + ".")

    @property
    def num_layers(self) -> int:
        """How many MTP layers the module holds."""
        return len(self.suffixes_by_layer)

    def layer_name(self, index: int, suffix: str, *, decoder_layers: int) -> str:
        """The name of ``suffix`` in MTP layer ``index`` of a model with ``decoder_layers`` decoder layers."""
        return f"{self.prefix}.{(decoder_layers if self.indexed else 0) + index}.{suffix}"

    def names(self) -> list[str]:
        """Every tensor name of the module in the model it was found in."""
        return [*(self.layer_name(i, s, decoder_layers=self.first) for i, suffixes in
                  enumerate(self.suffixes_by_layer) for s in suffixes), *self.loose]


@dataclass(frozen=True)
class MtpOutcome:
    """What a merge does with the inputs' MTP modules: how many layers it writes (0: dropped), the note that says
    so (empty when the module is merged in place, as every other layer is), and for an indexed module the
    (model, source layer) each written MTP layer comes from (the first of the models that supply it)."""

    count: int
    note: str
    origins: tuple[tuple[str, int], ...] = ()


def split_indexed(prefix: str, layers: dict[int, list[str]], declared: int | None) -> MtpLayout | None:
    """Take the indexed MTP layers out of ``layers`` (the stack ``prefix``'s layer index → suffixes, changed in
    place) and return them: the layers from ``declared`` (config.json's layer count) on, when every one of them
    holds ``eh_proj``. None (``layers`` untouched) when there are no such layers."""
    extra = sorted(i for i in layers if declared is not None and i >= declared)
    if not extra or extra != list(range(declared or 0, (declared or 0) + len(extra))):
        return None
    if not all(_MARKER in layers[i] for i in extra):
        return None
    found = tuple(tuple(sorted(layers.pop(i))) for i in extra)
    return MtpLayout(prefix, declared or 0, found)


def split_top_level(stacks: dict[str, dict[int, list[str]]], loose: list[str]) -> MtpLayout | None:
    """Take a top-level ``mtp.*`` module out of ``stacks`` (prefix → layer index → suffixes) and ``loose`` (both
    changed in place) and return it; None when the model has none."""
    prefixes = [p for p in stacks if p.split(".", 1)[0] == _TOP]
    names = [n for n in loose if n.split(".", 1)[0] == _TOP]
    if not prefixes and not names:
        return None
    for name in names:
        loose.remove(name)
    layers = stacks.pop(prefixes[0]) if prefixes else {}
    for other in prefixes[1:]:  # a second numbered part (``mtp.fc.0``?) is loose: nothing here is a layer of it
        loose_layers = stacks.pop(other)
        names.extend(f"{other}.{i}.{s}" for i, suffixes in loose_layers.items() for s in suffixes)
    count = max(layers) + 1 if layers else 0
    by_layer = tuple(tuple(sorted(layers.get(i, ()))) for i in range(count))
    return MtpLayout(prefixes[0] if prefixes else f"{_TOP}.layers", 0, by_layer, tuple(sorted(names)))


def is_vocab_suffix(suffix: str) -> bool:
    """Whether an MTP layer's tensor ``suffix`` is a vocabulary tensor (its stored embedding or head)."""
    return suffix in _VOCAB_SUFFIXES


def plan_mtp(
    keys: Sequence[str],
    found: Mapping[str, MtpLayout | None],
    out_layers: int,
    in_layers: Mapping[str, int],
    make: Callable[[str, list[str], bool], T],
) -> tuple[dict[str, T], MtpOutcome | None]:
    """Plan the output's MTP module from the models ``keys`` that supply the output's last layer.

    ``found`` holds every input model's MTP module (None: it has none), ``out_layers`` is the output's decoder
    layer count and ``in_layers[key]`` each model's; ``make(out_name, input_names, vocab)`` plans one tensor
    (``vocab``: an embedding or head copy). Returns the planned tensors and the outcome; the outcome is None when
    no input model has an MTP module (nothing to write or to say).
    """
    if not any(m is not None for m in found.values()):
        return {}, None
    modules = [found.get(k) for k in keys]
    if not all(m is not None for m in modules):
        lacking = next(k for k, m in zip(keys, modules) if m is None)
        holders = ", ".join(sorted(k for k, m in found.items() if m is not None))
        return {}, MtpOutcome(0, f"MTP module of {holders} dropped (its layer count set to 0 in config.json): "
                                 f"{lacking}, which supplies the output's last layer, has none")
    first = modules[0]
    assert first is not None
    planned: dict[str, T] = {}
    for index, suffixes in enumerate(first.suffixes_by_layer):
        for suffix in suffixes:
            names = [m.layer_name(index, suffix, decoder_layers=in_layers[k])
                     for k, m in zip(keys, modules) if m is not None]
            out = first.layer_name(index, suffix, decoder_layers=out_layers)
            planned[out] = make(out, names, is_vocab_suffix(suffix))
    for name in first.loose:
        planned[name] = make(name, [name] * len(keys), False)
    moved = first.indexed and any(in_layers[k] != out_layers for k in keys)
    origins = tuple((keys[0], in_layers[keys[0]] + i) for i in range(first.num_layers)) if first.indexed else ()
    if len(found) == len(keys) and not moved:  # a same-stack merge: merged in place like every layer
        return planned, MtpOutcome(first.num_layers, "", origins)
    count = f"{first.num_layers} layer" + ("s" if first.num_layers > 1 else "")
    what = (f"{first.prefix}.{min(in_layers[k] for k in keys)}" if first.indexed else "mtp.*") + f" ({count})"
    verb = "carried" if len(keys) == 1 else "merged"
    note = f"MTP module {what} of {', '.join(keys)} {verb} with the output's last layer"
    if moved:
        note += f", renumbered to {first.prefix}.{out_layers}"
    return planned, MtpOutcome(first.num_layers, note, origins)


def set_mtp_count(target: dict[str, Any], outcome: MtpOutcome | None) -> None:
    """Write the output's MTP layer count into the layer config ``target`` under the keys it has; a config with
    none gets DeepSeek's ``num_nextn_predict_layers: 0`` when the module is dropped. Nothing when no input had an
    MTP module."""
    if outcome is None:
        return
    keys = [k for k in COUNT_KEYS if k in target] or ([COUNT_KEYS[0]] if outcome.count == 0 else [])
    for key in keys:
        target[key] = outcome.count

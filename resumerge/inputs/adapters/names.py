"""The tensor names of a PEFT LoRA ``adapter_model.safetensors`` and the base tensors they stand for.

PEFT saves, under the prefix ``base_model.model.``:

* ``<module>.lora_A.weight`` ``(r, in)`` and ``<module>.lora_B.weight`` ``(out, r)`` for a linear (or GPT-2
  ``Conv1D``) layer, whose base tensor is ``<module>.weight``;
* ``<module>.lora_embedding_A`` ``(r, num_embeddings)`` and ``<module>.lora_embedding_B`` ``(embedding_dim, r)``
  for an embedding layer, base tensor ``<module>.weight``;
* full tensors, which PEFT loads over the base's tensor of the same name: ``modules_to_save`` copies
  (``lm_head.weight``), biases trained with ``bias: all|lora_only``, and embedding matrices saved beside an
  embedding LoRA. A full tensor of a LoRA-adapted module is saved as ``<module>.base_layer.<param>``.

Anything else — another prefix, DoRA magnitudes, LoRA biases, trainable-token deltas, adapter names left in the
key — is refused by name rather than guessed at.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from resumerge.errors import ModelInputError

PREFIX = "base_model.model."
_FACTORS = MappingProxyType({
    ".lora_A.weight": ("linear", "A"),
    ".lora_B.weight": ("linear", "B"),
    ".lora_embedding_A": ("embedding", "A"),
    ".lora_embedding_B": ("embedding", "B"),
})
# Keys PEFT writes for features resumerge refuses, and what to call them in the message.
_REFUSED_PARTS = MappingProxyType({
    "lora_magnitude_vector": "a DoRA magnitude vector",
    "trainable_tokens_delta": "a trainable-tokens delta",
    "lora_B.bias": "a LoRA bias (lora_bias)",
    "lora_A.bias": "a LoRA bias",
})
_MODULE = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")
_PARAMS = ("weight", "bias")


@dataclass(frozen=True)
class Factor:
    """One LoRA factor tensor: the adapted module, ``linear`` or ``embedding``, and which factor (A or B)."""

    module: str
    kind: str
    factor: str


@dataclass(frozen=True)
class FullTensor:
    """A full tensor that replaces the base tensor ``base_name``; ``module`` is its owner when LoRA-adapted."""

    base_name: str
    adapted_module: str | None


def classify(name: str, *, path: Path, yaml_path: str) -> Factor | FullTensor:
    """Say what the adapter tensor ``name`` is. Raises :class:`ModelInputError` for a name PEFT would not write.

    ``FullTensor.adapted_module`` is set for ``<module>.base_layer.<param>`` names, whose module must then also
    carry LoRA factors (checked by the caller, which sees every name).
    """
    if not name.startswith(PREFIX):
        raise _unknown(name, path, yaml_path, f"does not start with {PREFIX!r}")
    rest = name[len(PREFIX):]
    for part, what in _REFUSED_PARTS.items():
        if f".{part}" in f".{rest}":
            raise ModelInputError(
                f"{path} holds {what} ({name}), which resumerge cannot merge exactly",
                yaml_path=yaml_path, path=str(path), tensor=name,
                hint="merge it with PEFT's merge_and_unload and reference the merged folder",
            )
    for suffix, (kind, factor) in _FACTORS.items():
        if rest.endswith(suffix):
            module = rest[: -len(suffix)]
            if not _MODULE.match(module) or ".base_layer" in f".{module}.":
                raise _unknown(name, path, yaml_path, "names no module")
            return Factor(module, kind, factor)
    owner, _, param = rest.rpartition(".")
    if param not in _PARAMS or not _MODULE.match(owner) or any(
        p.startswith("lora_") or p in ("modules_to_save", "original_module", "default") for p in owner.split(".")
    ):
        raise _unknown(name, path, yaml_path, "is neither a LoRA factor nor a full weight or bias")
    module, marker, inner = owner.rpartition(".base_layer")
    if marker and not inner:
        return FullTensor(f"{module}.{param}", module)
    if ".base_layer" in f".{owner}.":
        raise _unknown(name, path, yaml_path, "has base_layer in an unexpected place")
    return FullTensor(rest, None)


def _unknown(name: str, path: Path, yaml_path: str, why: str) -> ModelInputError:
    return ModelInputError(
        f"{path} holds tensor {name!r}, which {why}: not a PEFT LoRA adapter tensor",
        yaml_path=yaml_path, path=str(path), tensor=name,
        hint="only adapters saved by PEFT's save_pretrained (LoRA) are supported",
    )

"""Check an opened adapter against its base model's tensors (names, dtypes and shapes from the headers only)."""

from __future__ import annotations

from collections.abc import Mapping

from resumerge.errors import ModelInputError
from resumerge.inputs.adapters.adapter import Adapter, LoraTarget

_FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})


def check_adapter(
    adapter: Adapter, base_tensors: Mapping[str, tuple[str, tuple[int, ...]]], *, yaml_path: str
) -> None:
    """Raise :class:`ModelInputError` unless ``adapter`` fits the base whose tensors are ``base_tensors``.

    ``base_tensors`` maps each base tensor name to its safetensors dtype code and shape. Every target must
    exist in the base as a 2-D float tensor of shape ``B @ A`` (transposed under ``fan_in_fan_out``); every
    replacement must exist with the same shape (its dtype may differ: it is cast to the base's). The message
    names the tensor and both shapes.
    """
    for name, target in adapter.targets.items():
        _check_target(adapter, name, target, base_tensors, yaml_path)
    for name, source in adapter.replacements.items():
        if name not in base_tensors:
            raise _error(adapter, yaml_path, name,
                         f"replaces {name}, which the base model does not have", _missing_hint(name, base_tensors))
        shape = base_tensors[name][1]
        if tuple(source.entry.shape) != tuple(shape):
            raise _error(
                adapter, yaml_path, name,
                f"replaces {name} with a {list(source.entry.shape)} tensor, but the base's is {list(shape)}",
                "the adapter was trained on a resized vocabulary or another base model; resumerge does not resize"
                if "embed" in name or "lm_head" in name else "check that the adapter was trained on this base model",
            )


def _check_target(
    adapter: Adapter,
    name: str,
    target: LoraTarget,
    base_tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    yaml_path: str,
) -> None:
    if name not in base_tensors:
        raise _error(adapter, yaml_path, name, f"adapts {name}, which the base model does not have",
                     _missing_hint(name, base_tensors))
    dtype, shape = base_tensors[name]
    if dtype not in _FLOAT_DTYPES:
        raise _error(adapter, yaml_path, name, f"adapts {name}, which the base stores as {dtype}",
                     "LoRA can only be merged into float (F32/F16/BF16/F64) weights, not quantised ones")
    want = target.weight_shape
    if tuple(shape) == want:
        return
    hint = "check that the adapter was trained on this base model"
    if tuple(shape) == want[::-1] and want[0] != want[1]:
        hint = (f"the shapes fit with fan_in_fan_out={str(not target.fan_in_fan_out).lower()}; "
                "adapter_config.json disagrees with the base's layer type")
    raise _error(
        adapter, yaml_path, name,
        f"adapts {name}: B @ A gives {list(want)} but the base tensor is {list(shape)}", hint,
    )


def _missing_hint(name: str, base_tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> str:
    if name.startswith("lm_head.") and "lm_head.weight" not in base_tensors:
        return "the base ties lm_head to the input embeddings (no lm_head.weight); resumerge cannot adapt it alone"
    head, _, tail = name.partition(".")
    if tail in base_tensors:
        return f"the base stores it as {tail!r} (without the {head + '.'!r} prefix): a checkpoint naming difference"
    return "check that the adapter was trained on this base model"


def _error(adapter: Adapter, yaml_path: str, tensor: str, what: str, hint: str) -> ModelInputError:
    return ModelInputError(f"LoRA adapter {adapter.directory} {what}", yaml_path=yaml_path,
                           path=str(adapter.directory), tensor=tensor, hint=hint)

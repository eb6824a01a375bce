"""Whether PEFT can load a LoRA of each module the extraction decomposes, asked of the modules transformers builds.

A LoRA factor pair is applied by PEFT to a module of the model transformers builds from the base's config.json: a
``torch.nn`` linear, embedding or convolution. A checkpoint may store a weight no such module holds: experts stored
one by one that transformers 5 fuses into one stack as it loads (GLM-5, DeepSeek-V3.2), a router that is a module of
the family's own (LFM2-MoE's ``feed_forward.gate``). An adapter holding factors of those would load with them
dropped, or not at all: the extraction is refused in one line naming the first, before a weight is read, with the
flag that leaves such modules out. PEFT itself refuses some modules it could wrap (:data:`PEFT_REFUSES`: a Mamba
model's ``out_proj`` and ``conv1d``, whose fused kernels read the weight directly): those are refused alike.
Without transformers, or for a family it cannot build, nothing is asked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from resumerge.errors import UsageError
from resumerge.merge.plan.expertmodules import renamed
from resumerge.runs.extract.modelview import model_modules

# The modules PEFT refuses to give LoRA factors, by their last name, in models of these types (peft 0.17-0.21,
# tuners_utils._check_lora_target_modules_mamba: "is incompatible with Mamba-based models").
PEFT_REFUSES: Mapping[str, frozenset[str]] = MappingProxyType(dict.fromkeys(
    ("falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"), frozenset({"out_proj", "conv1d"})))


def check_loadable(config: Mapping[str, Any], modules: Iterable[tuple[str, str]]) -> None:
    """Raise :class:`UsageError` (exit 2) for the first of ``modules`` (each the model's name and the checkpoint's,
    without ``.weight``) PEFT cannot wrap in the model transformers builds from the base's ``config``, or refuses."""
    refused = PEFT_REFUSES.get(str(config.get("model_type")), frozenset())
    for path, name in modules:
        if path.split(".")[-1] in refused:
            raise UsageError(
                f"{name} cannot be given LoRA factors: PEFT refuses LoRA on a {config.get('model_type')} model's "
                f"{path.split('.')[-1]} (Mamba's fused kernels read its weight directly)",
                hint=f"leave it out with -e (for example -e '{_pattern(name)}')",
            )
    built = model_modules(config)
    if built is None:
        return
    renames = built.patterns()
    for path, name in modules:
        path = renamed(f"{path}.weight", renames).removesuffix(".weight")
        kind = built.kinds.get(path)
        if kind is None:
            problem = (f"transformers builds no module {path} in a {config.get('model_type')} model (it fuses or "
                       "renames that weight as it loads)")
        else:
            if kind[1]:
                continue
            problem = f"its module is a {kind[0]}, not a linear, embedding or convolution layer"
        raise UsageError(
            f"{name} cannot be given LoRA factors PEFT loads: {problem}",
            hint=f"leave such modules out with -e (for example -e '{_pattern(name)}')",
        )


def _pattern(name: str) -> str:
    """A regex for ``name``'s kind of module in every layer (``\\.mlp\\.experts\\.``, ``\\.feed_forward\\.gate$``)."""
    parts = name.split(".")
    numbered = [i for i, p in enumerate(parts) if p.isdigit()]
    tail = parts[numbered[0] + 1:] if numbered else parts[-1:]
    if len(numbered) > 1:  # an expert's projection: every expert of the stack
        tail = parts[numbered[0] + 1:numbered[1]]
        return "\\." + "\\.".join(tail) + "\\."
    return "\\." + "\\.".join(tail) + "$"

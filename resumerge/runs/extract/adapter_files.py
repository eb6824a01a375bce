"""The adapter's side files: PEFT's ``adapter_config.json`` and the model card ``README.md``.

Both are pure functions of the planned modules and the spec, made at plan time (so their bytes are part of the
plan and written through the same journaled protocol as the tensors). The fields and their meaning follow
mergekit-extract-lora 0.1.5, except that lists are sorted (mergekit's set order changes from run to run) and the
card's ``base_model`` names the base (mergekit writes an empty list for local paths).
"""

from __future__ import annotations

from pathlib import PurePosixPath

import yaml

from resumerge.config.modelref import parse_model_ref
from resumerge.inputs.adapters.settings import written_config
from resumerge.runs.extract.modules import ModuleChoice, rank_pattern
from resumerge.runs.extract.spec import ExtractSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
CARD = "README.md"


def base_name(spec: ExtractSpec) -> str:
    """The base model as PEFT and the hub should name it: the hub id (or path) the user gave, without revision."""
    return parse_model_ref(spec.base_model).path


def adapter_config(spec: ExtractSpec, choice: ModuleChoice) -> bytes:
    """``adapter_config.json``: r is the largest rank, rank_pattern/alpha_pattern the modules below it (alpha
    equals rank everywhere, so every module's scale is 1)."""
    return written_config(base_model=base_name(spec), target_modules=choice.target_modules,
                          modules_to_save=choice.modules_to_save, ranks={m.name: m.rank for m in choice.lora})


def model_card(spec: ExtractSpec, choice: ModuleChoice) -> bytes:
    """``README.md``: metadata naming the base, what was extracted from what, and the command."""
    meta = yaml.safe_dump({"base_model": [base_name(spec)], "library_name": "peft",
                           "tags": ["resumerge", "peft", "lora"]}, sort_keys=False)
    r, pattern = rank_pattern(choice.lora)
    how = "the exact truncated SVD (--exact)" if spec.exact else "a seeded randomized truncated SVD"
    lines = [
        "---", meta.rstrip("\n"), "---",
        f"# {PurePosixPath(parse_model_ref(spec.model).path).name} (LoRA)", "",
        "This is a LoRA adapter extracted from a language model with resumerge.", "",
        "## LoRA Details", "",
        f"This LoRA adapter was extracted from `{spec.model}` and uses `{spec.base_model}` as a base.", "",
        f"- rank {r} ({len(choice.lora)} modules; {len(pattern)} at a lower rank), computed by {how}",
        f"- saved whole: {', '.join(choice.modules_to_save) or 'nothing'}",
    ]
    lines += [f"- note: {n}" for n in choice.notes]
    lines += ["", "### Parameters", "", "The following command was used to extract this LoRA adapter:", "",
              "```sh", spec.command(), "```", ""]
    return "\n".join(lines).encode("utf-8")

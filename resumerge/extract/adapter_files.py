"""The adapter's side files: PEFT's ``adapter_config.json`` and the model card ``README.md``.

Both are pure functions of the planned modules and the spec, made at plan time (so their bytes are part of the
plan and written through the same journaled protocol as the tensors). The fields and their meaning follow
mergekit-extract-lora 0.1.5, except that lists are sorted (mergekit's set order changes from run to run) and the
card's ``base_model`` names the base (mergekit writes an empty list for local paths).
"""

from __future__ import annotations

import json
from pathlib import PurePosixPath

import yaml

from resumerge.config.modelref import parse_model_ref
from resumerge.extract.modules import ModuleChoice, rank_pattern
from resumerge.extract.spec import ExtractSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
CARD = "README.md"


def base_name(spec: ExtractSpec) -> str:
    """The base model as PEFT and the hub should name it: the hub id (or path) the user gave, without revision."""
    return parse_model_ref(spec.base_model).path


def adapter_config(spec: ExtractSpec, choice: ModuleChoice) -> bytes:
    """``adapter_config.json``: r is the largest rank, rank_pattern/alpha_pattern the modules below it (alpha
    equals rank everywhere, so every module's scale is 1)."""
    r, pattern = rank_pattern(choice.lora)
    doc = {
        "base_model_name_or_path": base_name(spec),
        "peft_type": "LORA",
        "use_rslora": False,
        "target_modules": list(choice.target_modules),
        "modules_to_save": list(choice.modules_to_save),
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": r,
        "rank_pattern": dict(pattern),
        "alpha_pattern": dict(pattern),
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    return (json.dumps(doc, indent=4) + "\n").encode("utf-8")


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

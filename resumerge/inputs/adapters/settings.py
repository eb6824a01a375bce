"""``adapter_config.json`` of a PEFT LoRA adapter: the numbers that shape the merge, and the options refused.

Only what changes the merged weights is kept: ``r``, ``lora_alpha``, ``use_rslora``, ``fan_in_fan_out`` and the
per-module ``rank_pattern`` / ``alpha_pattern``. ``modules_to_save`` and ``bias`` only decide which full tensors
PEFT saved beside the factors, and the weights file itself lists those (see :mod:`resumerge.inputs.adapters.names`).
Options that would change the arithmetic in ways resumerge does not reproduce (DoRA and the other LoRA variants,
initialisations that rewrite the base weights, layer replication, ...) are refused by name rather than merged
wrongly; so is any option this module does not know, unless it is unset.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from resumerge.errors import ModelInputError

CONFIG_NAME = "adapter_config.json"

# Keys that never change merged weights: bookkeeping, training-only settings, and target selection (the weights
# file already says which modules were adapted; PEFT would ignore tensors its selection did not create, and
# adapters saved by PEFT never hold such tensors).
_IGNORED_KEYS = frozenset({
    "auto_mapping", "base_model_name_or_path", "revision", "task_type", "inference_mode", "peft_version",
    "lora_dropout", "megatron_core", "runtime_config", "qalora_group_size", "loftq_config", "eva_config",
    "corda_config", "lora_ga_config", "target_modules", "exclude_modules", "layers_to_transform",
    "layers_pattern", "ensure_weight_tying", "modules_to_save", "bias",
})
# Keys read by this module.
_READ_KEYS = frozenset({
    "peft_type", "r", "lora_alpha", "use_rslora", "fan_in_fan_out", "rank_pattern", "alpha_pattern",
    "init_lora_weights",
})
# Options that change how PEFT merges (or forbid merging) and are refused whenever they are set.
_REFUSED_OPTIONS = MappingProxyType({
    "use_dora": "DoRA (use_dora) adapters",
    "lora_bias": "adapters with a trained LoRA bias (lora_bias)",
    "layer_replication": "adapters that replicate layers (layer_replication)",
    "target_parameters": "adapters on raw parameters such as MoE experts (target_parameters)",
    "trainable_token_indices": "adapters with trainable tokens (trainable_token_indices)",
    "use_qalora": "QA-LoRA adapters (use_qalora)",
    "alora_invocation_tokens": "activated LoRA adapters (alora_invocation_tokens)",
    "megatron_config": "Megatron-parallel adapters (megatron_config)",
    "arrow_config": "Arrow routing adapters (arrow_config)",
    "velora_config": "VeLoRA adapters (velora_config)",
    "monteclora_config": "MonteCLoRA adapters (monteclora_config)",
    "kasa_config": "KaSA adapters (kasa_config)",
    "use_bdlora": "block-diagonal LoRA adapters (use_bdlora)",
})
# init_lora_weights values that only initialise the adapter's own factors (the saved factors are what count).
_SAFE_INITS = frozenset({"gaussian", "eva", "orthogonal", "mica"})
# Inits that also rewrite the base weights, so the saved factors only make sense on that rewritten base.
_BASE_REWRITING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")
# A pattern key is a regular expression (PEFT's semantics); these shapes backtrack exponentially, so a hostile
# config could hang the planner: a quantified group that itself contains a quantifier, e.g. ``(a+)+``.
_NESTED_QUANTIFIER = re.compile(r"\([^()]*[*+}][^()]*\)\s*[*+{]")
_MAX_PATTERN_LENGTH = 500
# A real adapter_config.json is a few kilobytes; refuse to read a hostile giant one into memory.
_MAX_CONFIG_BYTES = 16 << 20


@dataclass(frozen=True)
class LoraSettings:
    """The merge-relevant contents of ``adapter_config.json``.

    ``rank_pattern`` / ``alpha_pattern`` keep the file's key order, which decides which key wins (PEFT takes the
    first key that matches). Missing keys take PEFT's defaults (``r`` 8, ``lora_alpha`` 8).
    """

    r: int
    lora_alpha: float
    use_rslora: bool
    fan_in_fan_out: bool
    rank_pattern: tuple[tuple[str, int], ...]
    alpha_pattern: tuple[tuple[str, float], ...]

    def rank_and_alpha(self, module: str) -> tuple[int, float]:
        """The rank and alpha PEFT gives ``module`` (a module name such as ``model.layers.0.self_attn.q_proj``).

        PEFT's rule (``peft.utils.other.get_pattern_key``): the first pattern key ``k`` for which
        ``re.match(rf"(.*\\.)?({k})$", module)`` succeeds selects the value; otherwise ``r`` / ``lora_alpha``.
        """
        rank = next((v for k, v in self.rank_pattern if _pattern_matches(k, module)), self.r)
        alpha = next((v for k, v in self.alpha_pattern if _pattern_matches(k, module)), self.lora_alpha)
        return rank, alpha

    def scale(self, rank: int, alpha: float) -> float:
        """PEFT's scaling: ``alpha / sqrt(rank)`` with rsLoRA, else ``alpha / rank`` (a Python float)."""
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def written_config(*, base_model: str, target_modules: Sequence[str], modules_to_save: Sequence[str],
                   ranks: Mapping[str, int], fan_in_fan_out: bool = False) -> bytes:
    """``adapter_config.json`` of an adapter resumerge writes (an extracted one, a merged one): ``r`` is the largest
    of ``ranks`` (by module name), ``rank_pattern``/``alpha_pattern`` the modules below it, and alpha equals rank
    everywhere, so every module's scale is 1 and the factors hold the whole delta."""
    top = max(ranks.values(), default=0)
    pattern = {name: rank for name, rank in ranks.items() if rank != top}
    doc = {
        "base_model_name_or_path": base_model,
        "peft_type": "LORA",
        "use_rslora": False,
        "target_modules": list(target_modules),
        "modules_to_save": list(modules_to_save),
        "task_type": "CAUSAL_LM",
        "r": top,
        "lora_alpha": top,
        "rank_pattern": pattern,
        "alpha_pattern": pattern,
        "lora_dropout": 0.0,
        "fan_in_fan_out": fan_in_fan_out,
        "inference_mode": True,
    }
    return (json.dumps(doc, indent=4) + "\n").encode("utf-8")


def read_settings(path: Path, *, yaml_path: str) -> tuple[LoraSettings, Mapping[str, Any], bytes]:
    """Parse and validate ``adapter_config.json`` at ``path``; return the settings, the whole document, its bytes.

    Raises :class:`ModelInputError` (one line, naming the file and the key) for a file over 16 MiB, invalid JSON,
    a non-LoRA ``peft_type``, ill-typed values, refused options, and unknown options that are set.
    """
    size = path.stat().st_size
    if size > _MAX_CONFIG_BYTES:
        raise _error(path, yaml_path, f"is {size} bytes; an adapter config is a few kilobytes")
    raw = path.read_bytes()
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _error(path, yaml_path, f"is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _error(path, yaml_path, "must hold a JSON object")
    peft_type = doc.get("peft_type")
    if peft_type != "LORA":
        raise _error(
            path, yaml_path, f"has peft_type {peft_type!r}; only LoRA adapters (peft_type 'LORA') can be merged",
            hint="IA3, AdaLoRA, prompt tuning and other PEFT methods are not supported",
        )
    _refuse_options(doc, path, yaml_path)
    settings = LoraSettings(
        r=_positive_int(doc.get("r", 8), "r", path, yaml_path),
        lora_alpha=_number(doc.get("lora_alpha", 8), "lora_alpha", path, yaml_path),
        use_rslora=_flag(doc.get("use_rslora", False), "use_rslora", path, yaml_path),
        fan_in_fan_out=_flag(doc.get("fan_in_fan_out", False), "fan_in_fan_out", path, yaml_path),
        rank_pattern=tuple(
            (k, _positive_int(v, f"rank_pattern[{k!r}]", path, yaml_path))
            for k, v in _pattern(doc.get("rank_pattern"), "rank_pattern", path, yaml_path).items()
        ),
        alpha_pattern=tuple(
            (k, _number(v, f"alpha_pattern[{k!r}]", path, yaml_path))
            for k, v in _pattern(doc.get("alpha_pattern"), "alpha_pattern", path, yaml_path).items()
        ),
    )
    return settings, doc, raw


def _refuse_options(doc: Mapping[str, Any], path: Path, yaml_path: str) -> None:
    for key, what in _REFUSED_OPTIONS.items():
        if _is_set(doc.get(key)):
            raise _error(path, yaml_path, f"describes {what}, which resumerge cannot merge exactly",
                         hint="merge it with PEFT's merge_and_unload and reference the merged folder")
    init = doc.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise _error(
            path, yaml_path, f"has init_lora_weights {init!r}, whose factors only fit a base rewritten at init",
            hint="convert it to a plain LoRA adapter first (PEFT save_pretrained with "
                 "path_initial_model_for_weight_conversion)",
        )
    if not (isinstance(init, bool) or (isinstance(init, str) and init.lower() in _SAFE_INITS)):
        raise _error(path, yaml_path, f"has an unknown init_lora_weights {init!r}")
    for key, value in doc.items():
        if key not in _IGNORED_KEYS and key not in _READ_KEYS and key not in _REFUSED_OPTIONS and _is_set(value):
            raise _error(
                path, yaml_path, f"sets {key!r}, a PEFT option resumerge does not know; refusing to guess its effect",
                hint="if it does not change the weights, remove it from adapter_config.json",
            )


def _pattern_matches(key: str, module: str) -> bool:
    return re.match(rf"(.*\.)?({key})$", module) is not None


def _is_set(value: object) -> bool:
    return value not in (None, False, "", [], {})


def _error(path: Path, yaml_path: str, what: str, *, hint: str | None = None) -> ModelInputError:
    return ModelInputError(f"{path} {what}", yaml_path=yaml_path, path=str(path), hint=hint)


def _positive_int(value: object, key: str, path: Path, yaml_path: str) -> int:
    if type(value) is not int or value <= 0:
        raise _error(path, yaml_path, f"must give {key} as a positive integer, not {value!r}")
    return value


def _number(value: object, key: str, path: Path, yaml_path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _error(path, yaml_path, f"must give {key} as a finite number, not {value!r}")
    return value


def _flag(value: object, key: str, path: Path, yaml_path: str) -> bool:
    if not isinstance(value, bool):
        raise _error(path, yaml_path, f"must give {key} as true or false, not {value!r}")
    return value


def _pattern(value: object, key: str, path: Path, yaml_path: str) -> dict[str, object]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _error(path, yaml_path, f"must give {key} as an object, not {value!r}")
    for k in value:
        if not k or len(k) > _MAX_PATTERN_LENGTH or _NESTED_QUANTIFIER.search(k):
            raise _error(path, yaml_path, f"has a {key} key {k[:80]!r} that is empty, too long or a runaway regex")
        try:
            re.compile(k)
        except re.error as exc:
            raise _error(path, yaml_path, f"has a {key} key {k!r} that is not a regular expression ({exc})") from None
    return value

"""Layer indices in ``quantization_config``'s skip lists follow the output's layers (``architectures-2026.md`` §3).

Quantized checkpoints name the modules they left unquantized: compressed-tensors ``ignore`` (FP8 MoE models list
every layer's router, ``model.layers.0.mlp.gate`` … ``model.layers.47.mlp.gate``), ``modules_to_not_convert``
(bitsandbytes, MXFP4), ``ignored_layers``, ``skip_modules``. A new layer stack keeps each tensor in its source
layer's format, so the output's list must name the output layers made from listed source layers: an entry that
names source layer ``L`` of the model an output layer ``i`` was made from is written for ``i`` (once per such output
layer), and an entry naming a layer the output does not take is left out. Entries that name no layer index
(``lm_head``, wildcards, ``re:`` patterns, other stacks' layers) stay as they are, first and in their order. A
stack equal to the donor's own layers leaves the lists untouched. An indexed MTP layer carried to the output counts
as one more output layer, made from its source index.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

SKIP_LIST_KEYS = ("ignore", "modules_to_not_convert", "ignored_layers", "skip_modules")
# A language-model layer as the checkpoints' skip lists name it (not a vision tower's, not Qwen3-Next's ``mtp.*``).
_LAYER_REF = re.compile(r"^(?P<head>(?:model\.|model\.language_model\.|language_model\.model\.)?layers\.)"
                        r"(?P<index>\d+)(?=\.|$)")


def set_skipped_layers(
    out: dict[str, Any], configs: Mapping[str, Mapping[str, Any]], donor: str, origins: tuple[tuple[str, int], ...],
) -> None:
    """Rewrite the layer-indexed entries of ``out``'s ``quantization_config`` skip lists for the output layers
    ``origins`` (model key, source layer), each from its model's own list in ``configs`` (config.json by key)."""
    quant = out.get("quantization_config")
    if not isinstance(quant, dict) or origins == tuple((donor, i) for i in range(len(origins))):
        return
    for key in SKIP_LIST_KEYS:
        entries = quant.get(key)
        if not isinstance(entries, list):
            continue
        kept = [e for e in entries if _layer_of(e) is None]
        for index, (model, layer) in enumerate(origins):
            theirs = configs[model].get("quantization_config")
            listed = theirs.get(key) if isinstance(theirs, dict) else None
            for entry in listed if isinstance(listed, list) else ():
                match = _LAYER_REF.match(entry) if _layer_of(entry) == layer else None
                if match is not None:
                    kept.append(f"{match['head']}{index}{entry[match.end():]}")
        quant[key] = kept


def _layer_of(entry: object) -> int | None:
    """The layer index a skip-list entry names, or None (not a string, a ``re:`` pattern, or no index)."""
    if not isinstance(entry, str) or entry.startswith("re:"):
        return None
    match = _LAYER_REF.match(entry)
    return int(match["index"]) if match else None

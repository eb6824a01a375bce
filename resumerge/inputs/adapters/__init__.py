"""LoRA adapters (mergekit's ``model+adapter`` references), merged tensor by tensor without loading a model.

1. :func:`open_adapter` reads a PEFT adapter folder's ``adapter_config.json`` and safetensors header into an
   :class:`Adapter`: per base tensor, where the two factors are and the scale (:class:`LoraTarget`), plus full
   tensors it replaces and tokenizer files it ships. Hub-hosted adapters go through
   :func:`resumerge.inputs.hub.adapters.open_hub_adapter` first.
2. :func:`check_adapter` checks it against the base model's tensor names, dtypes and shapes.
3. :func:`apply_lora` (whole tensor) or :func:`apply_lora_rows` (a row chunk) merges one tensor the way PEFT's
   ``merge_and_unload`` does, with bits that do not depend on the chunking.
"""

from resumerge.inputs.adapters.adapter import WEIGHTS_NAME, Adapter, LoraTarget, open_adapter
from resumerge.inputs.adapters.apply import apply_lora, apply_lora_rows
from resumerge.inputs.adapters.check import check_adapter
from resumerge.inputs.adapters.settings import CONFIG_NAME

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "Adapter",
    "LoraTarget",
    "apply_lora",
    "apply_lora_rows",
    "check_adapter",
    "open_adapter",
]

"""Where bytes come from: local model folders, Hugging Face Hub repos (``hub/``), LoRA adapters (``adapters/``), the
safetensors format, and the input source the engine reads tensors through.

A model is opened from its config and headers alone; weights are read later, tensor by tensor, through an
:class:`~resumerge.inputs.source.InputSource` whose implementation the engine never sees.

May import: errors, config.
"""

__all__ = [
    "adapters",
    "catalog",
    "files",
    "hub",
    "model",
    "safetensors_format",
    "tensorio",
    "torch_bin",
]

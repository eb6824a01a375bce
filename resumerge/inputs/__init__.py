"""Where bytes come from: local model folders, Hugging Face Hub repos (``hub/``), LoRA adapters (``adapters/``), the
safetensors format, and the input source the engine reads tensors through.

A model is opened from its config and headers alone; weights are read later, tensor by tensor, through an
:class:`~resumerge.inputs.source.InputSource` whose implementation the engine never sees, and decoded by the
tensor's codec (``codecs/``: one class per stored format, plain dtypes or quantized, the quantized ones over the
kernels and format recognition of ``quant/``, run on the decoding thread alone: ``kernels``).

May import: errors, config, machine.
"""

__all__ = [
    "adapters",
    "catalog",
    "codecs",
    "files",
    "hub",
    "kernels",
    "model",
    "quant",
    "safetensors_format",
    "spans",
    "tensorio",
    "torch_bin",
]

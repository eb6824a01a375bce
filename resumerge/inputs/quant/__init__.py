"""Quantized checkpoints' tensor formats: pure decode/encode kernels and the recognition of a checkpoint's format.

One file per format, torch only, no file access: :mod:`.fp8_block` (DeepSeek-style block FP8),
:mod:`.compressed_tensors` (llm-compressor's pack-, float- and naive-quantized), :mod:`.mxfp4` (gpt-oss experts),
:mod:`.nvfp4` (NVFP4 of ModelOpt and compressed-tensors, with the recognition of its weights both share).
Each decodes stored codes and their scales to float32 and encodes float32 back, in row chunks where the format
allows; :mod:`.grid`, :mod:`.byte_tables` and :mod:`.int_pack` are the pieces they share. A kernel runs on its
inputs' device (``--device cuda`` encodes a merged tensor where it was computed): its scratch, tables and results
are made there, and the bytes are the CPU's for the same values.
Each format's codec (:mod:`resumerge.inputs.codecs`) recognises its own ``quant_method`` from the checkpoint's
``quantization_config`` and safetensors headers (never a payload) into a :class:`.verdict.Checkpoint` (compressed-
tensors through :mod:`.recognise_ct`); what they share, and every format resumerge refuses, is :mod:`.refusals`, one
line naming a tensor and the fix.

May import: errors, machine.
"""

__all__ = [
    "byte_tables",
    "compressed_tensors",
    "fp8_block",
    "grid",
    "int_pack",
    "mxfp4",
    "nvfp4",
    "recognise_ct",
    "refusals",
    "verdict",
]

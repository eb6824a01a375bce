"""Tests of the quantized formats' kernels and recognition (resumerge.inputs.quant), against independent decoders."""

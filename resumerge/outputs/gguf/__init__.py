"""GGUF (llama.cpp's format) as an output: the encoder of each tensor (:mod:`.outcodec`, :mod:`.stackcodec` for a
mixture of experts' stacked projections; the block-encode kernels: :mod:`.encoders`, the K-quants' :mod:`.kquants`,
the 4-bit i-quants' :mod:`.iquants`), the file's bytes planned before a tensor is written (:mod:`.layout`), and the
``tokenizer.*`` keys built from a Hugging Face tokenizer folder (:mod:`.hfvocab`)."""

from resumerge.outputs.gguf.outcodec import GgufOutCodec
from resumerge.outputs.gguf.stackcodec import GgufStackCodec

__all__ = ["GgufOutCodec", "GgufStackCodec"]

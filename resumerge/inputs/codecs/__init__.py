"""Tensor codecs: how each stored input tensor (with its companion tensors) is decoded to the value a merge method
sees, and how each output tensor is encoded into the tensors it is stored as.

``protocol`` defines :class:`TensorDecoder` and :class:`TensorEncoder` (a stored format's two directions;
:class:`TensorCodec`: both), the roles of stored tensors and :class:`SharedScale` (an encoder whose tensor-wide
scale a group of output tensors shares); ``plain`` is the codec of a tensor stored in its own dtype; ``fp8_block``
(with ``fp4``, DeepSeek-V4's FP4 experts it recognises), ``compressed``, ``mxfp4`` and ``nvfp4`` are the quantized
formats' codecs over the kernels of :mod:`resumerge.inputs.quant` (``quantized``: what they share); ``table`` holds
the per-run :class:`CodecTable` the planner recognises formats with, and :data:`CODECS`, the default one.
"""

from resumerge.inputs.codecs.compressed import CompressedTensorsCodec
from resumerge.inputs.codecs.fp8_block import BlockFp8Codec
from resumerge.inputs.codecs.mxfp4 import Mxfp4Codec
from resumerge.inputs.codecs.nvfp4 import Nvfp4Codec
from resumerge.inputs.codecs.plain import PLAIN, PlainCodec
from resumerge.inputs.codecs.protocol import (
    MAIN,
    Claim,
    OutPart,
    Role,
    SharedScale,
    TensorCodec,
    TensorDecoder,
    TensorEncoder,
)
from resumerge.inputs.codecs.quantized import QuantizedCodec
from resumerge.inputs.codecs.table import CODECS, CodecTable, StoredFormats

__all__ = [
    "CODECS",
    "MAIN",
    "PLAIN",
    "BlockFp8Codec",
    "Claim",
    "CodecTable",
    "CompressedTensorsCodec",
    "Mxfp4Codec",
    "Nvfp4Codec",
    "OutPart",
    "PlainCodec",
    "QuantizedCodec",
    "Role",
    "SharedScale",
    "StoredFormats",
    "TensorCodec",
    "TensorDecoder",
    "TensorEncoder",
]

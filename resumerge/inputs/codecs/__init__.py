"""Tensor codecs: how each stored input tensor (with its companion tensors) is decoded to the value a merge method
sees, and how each output tensor is encoded into the tensors it is stored as.

``protocol`` defines :class:`TensorCodec` (one class per stored format) and the roles of stored tensors; ``plain``
is the codec of a tensor stored in its own dtype; ``table`` holds the per-run :class:`CodecTable` the planner
recognises formats with, and :data:`CODECS`, the default one.
"""

from resumerge.inputs.codecs.plain import PLAIN, PlainCodec
from resumerge.inputs.codecs.protocol import MAIN, Claim, OutPart, Role, TensorCodec
from resumerge.inputs.codecs.table import CODECS, CodecTable, StoredFormats

__all__ = [
    "CODECS",
    "MAIN",
    "PLAIN",
    "Claim",
    "CodecTable",
    "OutPart",
    "PlainCodec",
    "Role",
    "StoredFormats",
    "TensorCodec",
]

"""What the quantized codecs share: a model's stored tensors judged by :func:`~resumerge.inputs.quant.recognise.
recognise` (from its ``quantization_config`` and headers alone), and each quantized weight of one kind as a claim.

Every quantized codec asks for the same verdict, so whichever format the table tries first refuses a checkpoint
that none of them decodes (bitsandbytes, GPTQ, AWQ, an unknown ``quant_method``...), before any weight is read; a
:class:`~resumerge.inputs.codecs.table.CodecTable` computes it once per model and hands it to the others (a
92k-tensor checkpoint's headers are judged once, not once per quantized format).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from resumerge.errors import ModelInputError
from resumerge.inputs.codecs.protocol import MAIN, Claim, TensorDecoder
from resumerge.inputs.quant.recognise import recognise
from resumerge.inputs.quant.verdict import Checkpoint, Kind, QuantizedTensor

if TYPE_CHECKING:
    from resumerge.inputs.files import TensorSource

# Part names of the companions every quantized codec may have (an extra is named by its stored suffix).
SCALE = "scale"
ZERO_POINT = "zero_point"
SHAPE = "shape"


def quantized_claims(config: Mapping[str, Any], tensors: Mapping[str, TensorSource], kinds: tuple[Kind, ...],
                     codec: Callable[[QuantizedTensor], TensorDecoder], shared: dict[object, Any] | None = None,
                     ) -> tuple[Claim, ...]:
    """The claims of every quantized weight of one of ``kinds`` among ``tensors`` (a model's stored tensors), each
    decoded by ``codec(weight)``; the model's verdict is taken from ``shared`` when another format computed it
    (see :meth:`~resumerge.inputs.codecs.protocol.TensorDecoder.recognise_among`), and left there otherwise. Raises
    :class:`~resumerge.errors.ModelInputError` (one line) for a checkpoint resumerge cannot decode, whatever its
    format."""
    shared = {} if shared is None else shared
    verdict = shared.get(recognise)
    if not isinstance(verdict, Checkpoint):
        headers = {name: (found.entry.dtype, found.entry.shape) for name, found in tensors.items()}
        verdict = shared[recognise] = recognise(config.get("quantization_config"), headers)
    claims = []
    interned: dict[TensorDecoder, TensorDecoder] = {}  # equal codecs as one instance: 45k weights have a handful
    for weight in verdict.quantized.values():
        if weight.scheme.kind not in kinds:
            continue
        parts = [(MAIN, weight.codes), (SCALE, weight.scale)]
        if weight.zero_point is not None:
            parts.append((ZERO_POINT, weight.zero_point))
        if weight.shape_tensor is not None:
            parts.append((SHAPE, weight.shape_tensor))
        for extra in weight.extras:
            # Carried with the weight (a static activation scale), never decoded; read as its one value.
            shape = tuple(tensors[extra].entry.shape)
            if len(shape) > 1 or any(d != 1 for d in shape):
                raise ModelInputError(f"{extra} of shape {list(shape)}: resumerge carries only "
                                      "one-value activation scales", tensor=extra)
            parts.append((extra_part(weight.name, extra), extra))
        made = codec(weight)
        claims.append(Claim(weight.name, tuple(parts), interned.setdefault(made, made)))
    return tuple(claims)


def extra_part(weight: str, stored: str) -> str:
    """The part name of extra companion ``stored`` of ``weight``: its suffix after the module (``input_scale``)."""
    return stored.removeprefix(weight.removesuffix("weight")).lstrip(".")


def is_extra(part: str) -> bool:
    """Whether ``part`` is an extra companion (one value, not used to decode)."""
    return part not in (MAIN, SCALE, ZERO_POINT, SHAPE)

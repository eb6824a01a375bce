"""What the quantized safetensors codecs share: :class:`QuantizedCodec`, a format that recognises the weights of its
own ``quant_method`` from ``quantization_config`` and the headers alone (:meth:`QuantizedCodec.weights`, in its own
codec file), and each of them as a claim.

A model with no ``quantization_config`` gets the verdict every quantized format shares
(:func:`~resumerge.inputs.quant.refusals.refuse_unconfigured`: a checkpoint none of them decodes, bitsandbytes,
GPTQ, AWQ..., refused before any weight is read); a :class:`~resumerge.inputs.codecs.table.CodecTable` computes a
model's verdict once and hands it to the other formats it asks (a 92k-tensor checkpoint's headers are judged once,
not once per quantized format). A model with one asks only the format that claims it.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from resumerge.errors import ModelInputError
from resumerge.inputs.codecs.protocol import MAIN, Claim, TensorCodec, TensorDecoder
from resumerge.inputs.quant.refusals import HeaderMap, refuse_unconfigured
from resumerge.inputs.quant.verdict import Checkpoint, QuantizedTensor

if TYPE_CHECKING:
    from resumerge.inputs.files import TensorSource

# Part names of the companions every quantized codec may have (an extra is named by its stored suffix).
SCALE = "scale"
ZERO_POINT = "zero_point"
SHAPE = "shape"


class QuantizedCodec(TensorCodec):
    """A quantized safetensors format, read and written: a frozen dataclass whose ``claims`` name its
    ``quant_method``; it finds its own weights (:meth:`weights`) and makes the codec of each (:meth:`codec_of`)."""

    @classmethod
    @abstractmethod
    def weights(cls, quantization: Mapping[str, Any], headers: HeaderMap, source: str) -> dict[str, QuantizedTensor]:
        """Every quantized weight of a checkpoint in this format, by logical name, from its ``quantization``
        (``config.json``'s ``quantization_config``, whose ``quant_method`` this format claims) and ``headers``
        (every shard's tensors: name -> (dtype, shape)). Raises the one-line refusal
        (:func:`~resumerge.inputs.quant.refusals.refuse`) for anything it cannot decode, naming ``source``."""

    @classmethod
    @abstractmethod
    def codec_of(cls, tensors: Mapping[str, TensorSource]) -> Callable[[QuantizedTensor], TensorDecoder]:
        """What makes the codec of each recognised weight of the model whose stored tensors are ``tensors``."""

    @classmethod
    def recognise(cls, config: Mapping[str, Any], tensors: Mapping[str, TensorSource]) -> tuple[Claim, ...]:
        return quantized_claims(config, tensors, cls)

    @classmethod
    def recognise_among(cls, config: Mapping[str, Any], tensors: Mapping[str, TensorSource],
                        shared: dict[object, Any]) -> tuple[Claim, ...]:
        return quantized_claims(config, tensors, cls, shared)


def recognise(fmt: type[QuantizedCodec], quantization: Mapping[str, Any] | None, headers: HeaderMap,
              source: str = "") -> Checkpoint:
    """What format ``fmt`` finds in a checkpoint (``quantization``: its ``quantization_config``, None or empty when
    config.json has none; ``headers``: every shard's tensors): its weights when the checkpoint is in ``fmt``, none
    when in another format, and the shared verdict (a refusal, or nothing) when it names no format."""
    if not quantization:
        refuse_unconfigured(headers, source)
        return Checkpoint(None, {}, tuple(headers))
    method = str(quantization.get("quant_method", "")).lower()
    found = fmt.weights(quantization, headers, source) if method in fmt.claims else {}
    return Checkpoint(method if found else None, found, tuple(headers))


def quantized_claims(config: Mapping[str, Any], tensors: Mapping[str, TensorSource], fmt: type[QuantizedCodec],
                     shared: dict[object, Any] | None = None) -> tuple[Claim, ...]:
    """The claims of every weight format ``fmt`` finds among ``tensors`` (a model's stored tensors), each decoded by
    the codec :meth:`QuantizedCodec.codec_of` makes; a verdict another format of the table computed for the same
    question is taken from ``shared`` (see
    :meth:`~resumerge.inputs.codecs.protocol.TensorDecoder.recognise_among`), and left there otherwise. Raises
    :class:`~resumerge.errors.ModelInputError` (one line) for a checkpoint resumerge cannot decode."""
    shared = {} if shared is None else shared
    quantization = config.get("quantization_config")
    method = str(quantization.get("quant_method", "")).lower() if isinstance(quantization, Mapping) else None
    if method is not None and method not in fmt.claims:
        return ()  # another format's checkpoint
    key = (recognise, method)
    verdict = shared.get(key)
    if not isinstance(verdict, Checkpoint):
        headers = {name: (found.entry.dtype, found.entry.shape) for name, found in tensors.items()}
        verdict = shared[key] = recognise(fmt, quantization, headers)
    claims = []
    codec = fmt.codec_of(tensors)
    interned: dict[TensorDecoder, TensorDecoder] = {}  # equal codecs as one instance: 45k weights have a handful
    for weight in verdict.quantized.values():
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

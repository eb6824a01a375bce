"""Quantization formats resumerge refuses, and the one line each refusal prints.

A refused checkpoint stops the run at exit 2 (:class:`~resumerge.errors.ModelInputError`) before any weight is
read or written, with one line naming the format, a tensor that shows it, and what to do: dequantize the
checkpoint with the tool that made it, then merge that copy. Formats are named from ``quantization_config``'s
``quant_method`` (every method transformers knows: ``utils/quantization_config.py QuantizationMethod``) and, when
a checkpoint has no ``quantization_config``, from tensor names only its format uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from resumerge.errors import ModelInputError

__all__ = ["GGUF_MAGIC", "HeaderMap", "refuse", "refuse_gguf", "refuse_method", "refuse_unconfigured", "telltale"]

# name -> (safetensors dtype, shape): the whole checkpoint's headers, every shard together.
HeaderMap = Mapping[str, tuple[str, tuple[int, ...]]]

GGUF_MAGIC = b"GGUF"

_DEQUANTIZE = "dequantize it with its own tool first and merge that copy"

# quant_method -> (the format's name, what dequantizes it, tensor-name endings only that format stores; one ending
# in "." matches anywhere in a name).
_AWQ = ("AWQ", "transformers or AutoAWQ: load, dequantize, save", (".qweight", ".qzeros"))
_AUTO_ROUND = ("AutoRound", "auto-round or transformers: load, dequantize, save", (".qweight", ".qzeros"))
KNOWN: Mapping[str, tuple[str, str, tuple[str, ...]]] = MappingProxyType({
    "bitsandbytes": ("bitsandbytes", "transformers: load it, model.dequantize(), save_pretrained",
                     (".absmax", ".quant_map", ".quant_state.", ".nested_absmax", ".SCB", ".weight_format")),
    "gptq": ("GPTQ", "GPTQModel or transformers with optimum: load, dequantize, save",
             (".qweight", ".qzeros", ".g_idx")),
    "awq": _AWQ,
    "autoawq": _AWQ,
    "llm-awq": _AWQ,
    "auto-round": _AUTO_ROUND,
    "intel/auto-round": _AUTO_ROUND,
    "hqq": ("HQQ", "hqq or transformers: load, dequantize, save", (".W_q",)),
    "torchao": ("torchao", "torchao: load, dequantize, save", ()),
    # ModelOpt's NVFP4 is decoded (codecs/nvfp4.py); without a quantization_config or hf_quant_config.json its
    # scale 2 still shows it, refused below as a companion without settings.
    "modelopt": ("NVIDIA ModelOpt", "TensorRT Model Optimizer: export unquantized weights", ()),
    "nvfp4": ("NVFP4", "its producer (ModelOpt, llm-compressor): export unquantized weights", ()),
    "mxfp8": ("MXFP8", "transformers: load, dequantize, save", ()),
    "fbgemm_fp8": ("fbgemm FP8", "transformers: load, dequantize, save", ()),
    "quanto": ("optimum-quanto", "optimum-quanto: load, dequantize, save", ()),
    "eetq": ("EETQ", "transformers: load, dequantize, save", ()),
    "aqlm": ("AQLM", "aqlm: load, dequantize, save", (".codebooks",)),
    "vptq": ("VPTQ", "vptq: load, dequantize, save", ()),
    "higgs": ("HIGGS", "transformers: load, dequantize, save", ()),
    "spqr": ("SpQR", "spqr: load, dequantize, save", ()),
    "bitnet": ("BitNet", "transformers: load, dequantize, save", ()),
    "quark": ("AMD Quark", "quark: export unquantized weights", ()),
    "fp_quant": ("FP-Quant", "fp_quant: load, dequantize, save", ()),
    "gguf": ("GGUF", "llama.cpp's convert tools or transformers (gguf_file=...): save unquantized", ()),
})

# Endings only the companions of the formats resumerge decodes have: found without a quantization_config, refused.
_COMPANION_MARKS = ("_scale_inv", ".weight_scale", ".weight_packed", ".weight_scale_2", ".weight_global_scale")


def refuse(source: str, what: str, tensor: str | None, hint: str = _DEQUANTIZE) -> ModelInputError:
    """The exit-2 error for a checkpoint resumerge will not decode: ``what`` it is, the ``tensor`` that shows it
    (its one line: ``source: what: tensor — hint``)."""
    message = f"{what}: {tensor}" if tensor else what
    return ModelInputError(message, hint=hint, path=source or None, tensor=tensor)


def telltale(names: Iterable[str], endings: tuple[str, ...]) -> str | None:
    """The first name (sorted) that ends with one of ``endings`` (or contains one that ends in "."), or None."""
    if not endings:
        return None
    inner = tuple(e for e in endings if e.endswith("."))
    # The least match, not the first of a sorted copy: a 92k-name checkpoint is scanned once, never sorted.
    return min((name for name in names if name.endswith(endings) or any(e in name for e in inner)), default=None)


def refuse_method(method: str, headers: Iterable[str], source: str, decoded: tuple[str, ...]) -> ModelInputError:
    """The refusal for ``quant_method`` ``method`` (of a model whose stored tensors are named ``headers``): a known
    unsupported format, or an unknown method; ``decoded`` lists the methods the run decodes."""
    label, tool, fragments = KNOWN.get(method.lower(), (None, "", ()))
    tensor = telltale(headers, fragments) or min(headers, default="(no tensors)")
    if label is None:
        listed = f"{', '.join(decoded[:-1])} and {decoded[-1]}" if len(decoded) > 1 else "".join(decoded) or "none"
        return refuse(source, f"unknown quantization method {method!r} in config.json, which resumerge cannot "
                              f"decode (it decodes {listed})", tensor)
    return refuse(source, f"quantized with {label}, which resumerge cannot decode", tensor,
                  f"{_DEQUANTIZE} ({tool})")


def refuse_gguf(head: bytes, path: str) -> None:
    """Raise the GGUF refusal if a weight file's first bytes are GGUF's magic in a model folder (it is not
    safetensors): a GGUF is read when the config names the file itself."""
    if head[:4] == GGUF_MAGIC:
        raise refuse(path, "a GGUF file, not safetensors, in a model folder", None,
                     f"name the file itself as the model (model: {path})")


def refuse_unconfigured(headers: HeaderMap, source: str) -> None:
    """The verdict every quantized format shares on a checkpoint whose config.json has no ``quantization_config``
    (``headers``: every shard's tensors): refused in one line when its tensor names show a format resumerge
    cannot decode, or a quantization companion it could decode but cannot tell how; else nothing to say."""
    # One scan of every name for all the formats' telltales at once; each format's own only when one is there.
    every = tuple(f for _, _, fragments in KNOWN.values() for f in fragments)
    for _, tool, fragments in KNOWN.values() if telltale(headers, every) is not None else ():
        name = telltale(headers, fragments)
        if name is not None:
            # GPTQ, AWQ and AutoRound store the same names: name every format that could have written it.
            labels = " or ".join(dict.fromkeys(label for label, _, f in KNOWN.values() if telltale([name], f)))
            raise refuse(source, f"looks quantized with {labels} (config.json has no quantization_config), which "
                                 "resumerge cannot decode", name, f"dequantize it with its own tool first ({tool})")
    name = telltale(headers, _COMPANION_MARKS)
    name = name or min((n for n, (dtype, _) in headers.items() if n.endswith("_blocks") and dtype == "U8"),
                       default=None)
    if name is not None:
        raise refuse(source, "a quantization companion but no quantization_config in config.json, so resumerge "
                             "cannot tell how to decode it", name, "add the producer's quantization_config or "
                             "dequantize the checkpoint first")

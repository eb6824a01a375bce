"""A GGUF model input (one file, or a ``-00001-of-0000N.gguf`` split set) as resumerge's inputs see a model: a
synthesized ``config.json``, every tensor under its Hugging Face name at its byte range in the file, and the files.

A quantized tensor is stored as ``U8`` rows of its blocks (blocks never cross rows, ``gguf.md`` §2), so a row chunk
of the value is the same rows of the stored bytes; each expert of a stacked experts tensor is a tensor of its own
(a contiguous slice). The GGUF codec (:mod:`.codec`) claims every tensor of such a model through the synthesized
``quantization_config`` (``quant_method: gguf``), which records each tensor's ggml type and the family.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from resumerge.errors import ModelInputError
from resumerge.inputs.files import TensorSource
from resumerge.inputs.gguf.ggmltypes import F32, TYPES
from resumerge.inputs.gguf.header import GgufHeader, GgufTensor, read_gguf_header
from resumerge.inputs.gguf.names import family, hf_config, hf_names
from resumerge.inputs.safetensors_format import TensorEntry

METHOD = "gguf"
INSTALL = "pip install -c constraints.txt -e '.[gguf]' (the gguf package reads GGUF files)"
_SPLIT = re.compile(r"(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")


def plain_dtype(ggml_type: int) -> str:
    """The safetensors dtype ``ggml_type`` is stored as where it is a plain type ("": rows of blocks, U8)."""
    row = TYPES.get(ggml_type)
    return "" if row is None else row.stored


def gguf_module() -> Any:
    """gguf-py, or the one-line refusal (exit 2) with the install line when it is not installed."""
    try:
        import gguf
    except ImportError:
        raise ModelInputError("reading or writing a GGUF needs the gguf package, which is not installed",
                              hint=INSTALL) from None
    return gguf


def split_names(name: str, where: str) -> list[str]:
    """The file names of the GGUF named ``name``: itself, or each file of the split set it is the first of (a
    later part is refused in one line: ``where`` names it)."""
    found = _SPLIT.fullmatch(name)
    if found is None:
        return [name]
    count = int(found["count"])
    if int(found["no"]) != 1:
        raise ModelInputError(f"{name} is part {int(found['no'])} of a split GGUF", path=where,
                              hint=f"name its first part, {found['prefix']}-00001-of-{found['count']}.gguf")
    return [f"{found['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def split_files(path: Path) -> list[Path]:
    """Every file of the GGUF at ``path``: itself, or each file of the split set it is the first of."""
    files = [path.with_name(name) for name in split_names(path.name, str(path))]
    if len(files) == 1:
        return files
    for file in files:
        if not file.is_file():
            raise ModelInputError(f"split GGUF part {file.name} is missing", path=str(file),
                                  hint="download every part of the split set")
    return files


@dataclass(frozen=True)
class GgufModel:
    """What :func:`open_gguf` read: the synthesized config, the tensors by HF name, each file's header."""

    config: dict[str, Any]
    tensors: dict[str, TensorSource]
    headers: tuple[tuple[str, GgufHeader], ...]

    @property
    def metadata(self) -> dict[str, Any]:
        """The model's metadata (the first file's: later split parts carry only ``split.*``)."""
        return self.headers[0][1].metadata


def open_gguf(path: Path) -> GgufModel:
    """Read the headers of the GGUF at ``path`` (and of the rest of its split set). Raises
    :class:`ModelInputError` (exit 2) for a family, tensor or quant type resumerge cannot map or decode, or when
    gguf-py is not installed; :class:`~resumerge.errors.HostileFileError` for a damaged file."""
    sizes = decodable_sizes()
    return gguf_model(tuple((file.name, read_gguf_header(file, sizes)) for file in split_files(path)), str(path))


def gguf_model(headers: tuple[tuple[str, GgufHeader], ...], where: str) -> GgufModel:
    """The model of the GGUF whose files' parsed ``headers`` these are, by file name (a hub GGUF's read by range,
    each named by its path in the repo); ``where`` names it in errors. Raises as :func:`open_gguf`."""
    gguf = gguf_module()
    sizes = decodable_sizes()
    metadata = headers[0][1].metadata
    arch = family(metadata, where)
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or any(t.name == "rope_freqs.weight" for _, h in headers for t in h.tensors):
        # Llama 3.1's scaling is stored as a rope_freqs tensor, not its parameters: a config.json rebuilt without
        # them would run the model with the wrong positions.
        raise ModelInputError("a GGUF with scaled rope (rope_freqs or rope.scaling keys), whose config.json "
                              "resumerge cannot rebuild yet", path=where,
                              hint="convert it to safetensors with transformers (gguf_file=...) and merge that")
    experts = int(metadata.get(f"{arch}.expert_count", 0) or 0)
    tensors: dict[str, TensorSource] = {}
    types: dict[str, str] = {}
    embed_rows, tied = 0, True
    for file, header in headers:
        for info in header.tensors:
            if info.name == "token_embd.weight":
                embed_rows = info.shape[0]
            tied = tied and info.name != "output.weight"
            for hf, expert in _hf_names(arch, info, experts, where):
                if hf in tensors:
                    raise ModelInputError(f"GGUF tensor {info.name} maps to {hf} twice", path=where, tensor=hf)
                tensors[hf] = TensorSource(file, _entry(hf, info, sizes[info.ggml_type], expert, experts))
                types[hf] = f"{gguf.GGMLQuantizationType(info.ggml_type).name}:{info.name}"
    config = hf_config(arch, metadata, embed_rows, tied)
    config["quantization_config"] = {"quant_method": METHOD, "architecture": arch, "tensor_types": types}
    return GgufModel(config, tensors, headers)


# An NVFP4 tensor's companions as llama.cpp's converter stores them (reference/kquants.md §7): ModelOpt's
# weight_scale_2 as ``<name>.scale`` (F32, multiplied at run time) and its input_scale as ``<name>.input_scale``;
# named after the weight's HF module as ModelOpt names them.
NVFP4_COMPANIONS = MappingProxyType({"scale": "weight_scale_2", "input_scale": "input_scale"})


def _hf_names(arch: str, info: GgufTensor, experts: int, where: str) -> list[tuple[str, int | None]]:
    """:func:`~resumerge.inputs.gguf.names.hf_names` of ``info``, an NVFP4 weight's F32 companion named after
    its weight's module."""
    base, _, suffix = info.name.rpartition(".")
    if suffix in NVFP4_COMPANIONS and info.ggml_type == F32 and base.startswith("blk."):
        return [(hf.removesuffix("weight") + NVFP4_COMPANIONS[suffix], expert)
                for hf, expert in hf_names(arch, f"{base}.weight", experts, where)]
    return hf_names(arch, info.name, experts, where)


def decodable_sizes() -> dict[int, tuple[int, int]]:
    """(values, bytes) per block of each ggml type id resumerge decodes (the header parser's ``sizes``)."""
    gguf = gguf_module()
    return {int(t): size for t, size in gguf.GGML_QUANT_SIZES.items() if _decodable(gguf, t)}


def _decodable(gguf: Any, ggml_type: int) -> bool:
    """Whether gguf-py decodes ``ggml_type``: asked of one zero block (Q8_1, Q8_K, Q1_0 and the integer types
    raise NotImplementedError in 0.19.0; a tensor of one is refused by the header parser)."""
    import numpy as np

    if plain_dtype(ggml_type):
        return True
    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[ggml_type][1]), np.uint8), ggml_type)
    except (NotImplementedError, ValueError, TypeError):
        return False
    return True


def _entry(hf: str, info: GgufTensor, size: tuple[int, int], expert: int | None, experts: int) -> TensorEntry:
    """The stored entry of HF tensor ``hf`` in GGUF tensor ``info``: expert ``expert`` of a stacked tensor (its
    slice), else all of it; quantized types as ``U8`` rows of blocks."""
    shape = info.shape
    start, end = info.start, info.end
    if expert is not None:
        if shape[0] != experts:
            raise ModelInputError(f"GGUF tensor {info.name} stacks {shape[0]} experts, the metadata says {experts}",
                                  tensor=info.name)
        step = (end - start) // experts
        start, end, shape = start + expert * step, start + (expert + 1) * step, shape[1:]
    if hf.endswith("shared_expert_gate.weight") and len(shape) == 1:
        shape = (1, *shape)  # ggml drops a trailing ne of 1 (gguf.md §1)
    dtype = plain_dtype(info.ggml_type)
    if not dtype:
        block, type_size = size
        shape, dtype = (*shape[:-1], shape[-1] // block * type_size), "U8"
    return TensorEntry(hf, dtype, tuple(shape), start, end)

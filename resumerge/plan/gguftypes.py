"""Each tensor's type in a GGUF output, as llama.cpp's quantizer picks it for the file type asked (``--gguf-type``),
and what resumerge writes where it has no encoder for that type.

The reference is ``src/llama-quant.cpp`` (``tensor_allows_quantization``, ``llama_tensor_get_type_impl``,
``tensor_type_fallback``), no importance matrix, no overrides, not ``--pure``. For the file types resumerge writes:

- F32, F16 and BF16 files are not quantized: every matrix has the file's type.
- Never quantized: 1-D tensors, ``*_norm.weight`` and the routers (``ffn_gate_inp``): F32, as the converter stores
  them.
- ``output.weight``, and ``token_embd.weight`` of a model without one (tied embeddings: the one matrix is both),
  get Q6_K in a Q4_0, Q4_1, Q5_0 or Q5_1 file (Q8_0 in a Q8_0 file), falling back to Q8_0 when a row is not whole
  256-value blocks (SmolLM2's 576). A file of a model with exactly 8 experts (Mixtral) gets Q8_0 for ``attn_v``
  and ``attn_k``. Every other matrix gets the file's type.
- A row that is not whole 32-value blocks cannot hold a legacy type: llama.cpp refuses such a tensor; resumerge
  writes it F16.

resumerge encodes F32, F16, BF16 and the legacy block types, not the K-quants: where llama.cpp picks Q6_K it writes
Q8_0 (more bits, never fewer), and the plan's notes say so (:func:`type_notes`). Without these rules a ``q4_0``
output's tied embedding was Q4_0, where llama.cpp's is Q8_0: SmolLM2-135M-Instruct merged with itself into q4_0 and
checked against its float32 weights gave a KL of 0.608 against 0.595, an NLL of 3.220 against 3.126 (3.033 in
float32), a top-1 agreement of 65.1 % against 67.8 %.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from resumerge.inputs.gguf.blocks import BF16, BLOCK_BYTES, F16, F32, Q4_0, Q4_1, Q5_0, Q5_1, Q6_K, Q8_0
from resumerge.outputs.gguf.outcodec import GgufOutCodec
from resumerge.plan.merge_plan import TensorPlan

_NAMES = {F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1",
          Q6_K: "Q6_K", Q8_0: "Q8_0"}
# The types resumerge encodes (inputs.gguf.blocks), and what it writes for one llama.cpp picks that it does not.
WRITTEN = frozenset({F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0})
INSTEAD = {Q6_K: Q8_0}
# llama.cpp's tensor_type_fallback for a row that is not whole blocks of the type picked (the legacy types have
# none there: llama.cpp refuses the tensor).
_FALLBACK = {Q6_K: Q8_0}
# The substrings llama.cpp's tensor_get_category looks for, in its order (the first found wins).
_ATTN_V = ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight")
_ATTN_K = "attn_k.weight"


@dataclass(frozen=True)
class TensorType:
    """The type llama.cpp's quantizer gives a tensor (``llama``) and the one resumerge writes (``written``: the
    same, or its substitute where resumerge has no encoder or the row is not whole blocks)."""

    llama: int
    written: int


def kept_float(name: str, dims: int) -> bool:
    """Whether llama.cpp never quantizes the tensor ``name`` of ``dims`` dimensions (stored F32 by the converter)."""
    return dims < 2 or name.endswith(("norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))


def tensor_type(name: str, shape: tuple[int, ...], file_type: int, *, tied: bool, experts: int) -> TensorType:
    """The type of the GGUF tensor ``name`` of (Hugging Face, row-major) ``shape`` in a file of ``file_type`` (a
    ggml type id), of a model whose embedding is its head (``tied``) and that has ``experts`` experts per layer."""
    if kept_float(name, len(shape)):
        return TensorType(F32, F32)
    if file_type not in BLOCK_BYTES:  # F32, F16, BF16: nothing is quantized
        return TensorType(file_type, file_type)
    row = shape[-1]
    picked = file_type
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        picked = Q8_0 if row % BLOCK_BYTES[file_type][0] else (Q6_K if file_type != Q8_0 else Q8_0)
    elif experts == 8 and (name.endswith(_ATTN_V) or name.endswith(_ATTN_K)):
        picked = Q8_0
    if row % BLOCK_BYTES[picked][0] and picked in _FALLBACK:
        picked = _FALLBACK[picked]
    written = INSTEAD.get(picked, picked)
    if row % BLOCK_BYTES[written][0]:
        written = F16
    return TensorType(picked, written)


def type_notes(tensors: Mapping[str, TensorPlan]) -> list[str]:
    """The notes of a GGUF output that writes another type than llama.cpp's quantizer picks: the types it has no
    encoder for, and rows that are not whole blocks; none for another output."""
    swapped: dict[tuple[int, int], list[str]] = {}
    for tp in tensors.values():
        codec = tp.out_codec
        if isinstance(codec, GgufOutCodec) and codec.llama_type not in (-1, codec.ggml_type):
            swapped.setdefault((codec.llama_type, codec.ggml_type), []).append(codec.gguf_name)
    notes = []
    for (llama, written), names in sorted(swapped.items()):
        shown = ", ".join(sorted(set(names))[:3]) + (f" and {len(set(names)) - 3} more" if len(set(names)) > 3 else "")
        why = ("resumerge has no encoder for it, and writes the next type with more bits"
               if llama not in WRITTEN else "its rows are not whole blocks of that type, which llama.cpp refuses")
        notes.append(f"GGUF types: llama.cpp's quantizer gives {shown} {_NAMES.get(llama, str(llama))}; {why}: "
                     f"{_NAMES.get(written, str(written))}")
    return notes

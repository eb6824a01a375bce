"""``sce``: Select high-variance positions, Calculate weights from task-vector energy, Erase sign conflicts.

Reference: https://arxiv.org/abs/2408.07990 (FuseChat 2.0). Defined once, by its row stream
(:mod:`resumerge.merge.methods.sce_stream`, whose output pass states the formula); the whole tensor is its one chunk.
"""

from __future__ import annotations

from resumerge.merge.methods.footprint import block_scratch, measured
from resumerge.merge.methods.sce_steps import _VARIANCE_BLOCK
from resumerge.merge.methods.sce_stream import sce_stream
from resumerge.merge.methods.spec import BasePolicy, MethodSpec, ParamSpec, Scope, one_chunk

SPEC = MethodSpec(
    name="sce",
    title="SCE",
    summary=(
        "select the task-vector entries that vary most across models, weight each model by its "
        "energy, and erase sign conflicts."
    ),
    reference="https://arxiv.org/abs/2408.07990",
    fn=one_chunk(sce_stream),  # the stream is the definition; the whole tensor is its one chunk
    # Working memory measured by bench/method_footprint.py --fit (float32, bfloat16, float16, float64).
    footprint=measured(
        (-4, 8, 40, 0, None, (0.25, 4)),
        (-8, 8, 40, 0, None, (1, 2)),
        (-8, 8, 40, 0, None, (0, 2)),
        (-8, 16, 39.75, 0, None, (0.25, 8)),
        scratch=block_scratch(_VARIANCE_BLOCK),
    ),
    params=(
        ParamSpec("int8_mask", Scope.GLOBAL, bool, default=False),
        ParamSpec("select_topk", Scope.GLOBAL, float, default=1.0, minimum=0.0, maximum=1.0),
    ),
    base=BasePolicy.REQUIRED,
    min_inputs=1,
    streamed=sce_stream,
)

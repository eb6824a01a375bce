"""Imports every built-in method module so that each registers itself (one line per module)."""

from resumerge.methods import (  # noqa: F401
    arcee_fusion,
    karcher,
    linear,
    model_stock,
    multislerp,
    nearswap,
    nuslerp,
    passthrough,
    ram,
    sce,
    slerp,
    task_arithmetic,
)

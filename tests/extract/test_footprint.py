"""The factor units' declared footprint covers what the decomposition allocates: the governor admits each module by
it, so it must never understate the SVD workspace (measured by the profiler replay the merge methods' footprint
tests use), whichever of exact and randomized truncation, rank and weight dtype."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from methods.footprint_cases import peaks

from resumerge.extract.decompose import factors, truncate
from resumerge.extract.factors import FACTOR_A, FACTOR_B
from resumerge.methods import get_method
from resumerge.methods.footprint import working_bytes

NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@pytest.mark.parametrize("shape", [(256, 256), (192, 512), (512, 192)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_declared_footprint_covers_the_decomposition(shape: tuple[int, int], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(shape, generator=g).to(dtype)
    ft = (base.float() + 0.01 * torch.randn(shape, generator=g)).to(dtype)
    calls = [lambda exact=exact, rank=rank: factors(truncate(ft - base, rank, exact=exact, seed=1), rank, True)
             for exact in (True, False) for rank in (8, 64)]
    measured = max(peaks(calls))
    for name in (FACTOR_A, FACTOR_B):
        spec = get_method(name)
        assert spec is not None and spec.footprint is not None and spec.footprint.of_inputs
        # Per element of the module's weight (the planner passes the input's shape for these units).
        reserved = working_bytes(spec.footprint, NAMES[dtype], shape, 2, base=True)
        assert measured <= reserved, (name, measured, reserved)


def test_a_factor_unit_is_admitted_by_its_weight(pair: Callable[[str], tuple[Path, Path]], tmp_path: Path) -> None:
    """The unit of a rank-4 factor reserves the workspace of the whole weight it factors, not of its 4 rows."""
    from resumerge.extract.prepare import prepare_extraction
    from resumerge.extract.spec import ExtractSpec, spec_text
    from resumerge.plan.merge_plan import PlanOptions
    from resumerge.plan.workunits import estimate_bytes

    base, ft = pair("llama")
    spec_text_ = spec_text(ExtractSpec(model=str(ft), base_model=str(base), max_rank=4))
    plan, _ = prepare_extraction(spec_text_, PlanOptions(), state_dir=tmp_path)
    tp = next(t for t in plan.tensors.values() if t.method == FACTOR_A)
    spec = get_method(FACTOR_A)
    assert spec is not None and spec.footprint is not None
    weight = tp.inputs[0].shape
    assert tp.shape[0] == 4 and weight[0] > 4
    assert estimate_bytes(tp, spec) >= working_bytes(spec.footprint, "float32", weight, 2, base=True)

"""The expert stacks' declared footprints against what their calls allocate (torch's profiler, replayed).

The internal MoE methods have no config cases in ``tests/methods/footprint_cases.py``; their figures are held here
the same way: never below the measurement, and the plain stack (``moe_fused_copies``, whose result is the output
buffer the engine counts) not far above it.
"""

from __future__ import annotations

import math

import pytest
import torch
from methods.footprint_cases import peaks

from resumerge.merge.methods import MergeContext, get_method
from resumerge.merge.methods.footprint import CALL_BYTES, MARGIN, working_bytes
from resumerge.runs.moe.experts import COPY_PLAIN, FUSED, FUSED_COPIES, UNITS

NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _stack(method: str, part: str, dtype: torch.dtype, out: str, noise: bool) -> tuple[int, int, int]:
    """(measured peak of one call, the engine's count beyond the stored inputs — output buffer plus the method's
    working set —, the output's bytes) for two experts' ``part`` stack of 64 x 32 inputs of ``dtype``."""
    spec = get_method(method, UNITS)
    assert spec is not None and spec.footprint is not None
    per = 2 if part == "gate_up" else 1
    inputs = [torch.randn(64, 32).to(dtype) for _ in range(2 * per)]
    params = [{"noise_scale": 0.01, "residual_scale": 0.5} if noise else {} for _ in inputs]
    generator = torch.Generator().manual_seed(1) if noise else None
    ctx = MergeContext(tensors=inputs, base_index=None, model_params=params, params={"part": part, "dtype": out},
                       generator=generator)
    (peak,) = peaks([lambda: spec.fn(ctx)])
    out_bytes = 2 * per * 64 * 32 * torch.empty(0, dtype=getattr(torch, out)).element_size()
    work = working_bytes(spec.footprint, NAMES[dtype], (2, per * 64, 32), len(inputs), base=False)
    return peak, out_bytes + work, out_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out", ["float32", "bfloat16"])
@pytest.mark.parametrize("part", ["gate_up", "down"])
def test_a_plain_stack_is_counted_as_its_output_alone(dtype: torch.dtype, out: str, part: str) -> None:
    peak, counted, out_bytes = _stack(FUSED_COPIES, part, dtype, out, noise=False)
    # The call makes its result and nothing else (casting each input into its place allocates no copy) ...
    assert out_bytes <= peak <= out_bytes + CALL_BYTES, (peak, out_bytes)
    # ... so the engine's count (the output buffer, which is that result) covers it without a second tensor.
    assert peak <= counted <= math.ceil(out_bytes * MARGIN) + CALL_BYTES, (peak, counted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("part", ["gate_up", "down"])
def test_a_noised_stack_is_covered(dtype: torch.dtype, part: str) -> None:
    peak, counted, _ = _stack(FUSED, part, dtype, NAMES[dtype], noise=True)
    assert peak <= counted, (peak, counted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out", ["float32", "bfloat16"])
def test_a_plain_copy_is_its_output_alone_and_never_its_input(dtype: torch.dtype, out: str) -> None:
    spec = get_method(COPY_PLAIN, UNITS)
    assert spec is not None and spec.footprint is not None
    tensor = torch.randn(64, 32).to(dtype)
    ctx = MergeContext(tensors=[tensor], base_index=None, model_params=[{}], params={"dtype": out})
    result = spec.fn(ctx)
    assert result.dtype == getattr(torch, out) and torch.equal(result, tensor.to(result.dtype))
    assert result.data_ptr() != tensor.data_ptr()  # an expert used twice must not share storage in the output
    (peak,) = peaks([lambda: spec.fn(ctx)])
    out_bytes = result.nbytes
    counted = out_bytes + working_bytes(spec.footprint, NAMES[dtype], (64, 32), 1, base=False)
    assert out_bytes <= peak <= counted <= math.ceil(out_bytes * MARGIN) + CALL_BYTES, (peak, counted)

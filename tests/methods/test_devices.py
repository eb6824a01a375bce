"""Every method keeps its work on the inputs' device (``--device cuda`` moves the inputs, never the method).

No GPU is needed: inputs on PyTorch's ``meta`` device make any tensor created on the CPU by mistake fail with
"... is not on the expected device" (exactly what CUDA inputs would hit), while data-dependent steps that a real
device runs fine (``float(t)``, ``.item()``) fail on meta with their own message, which is allowed here.
"""

from __future__ import annotations

import pytest
import torch

from resumerge.merge.methods.registry import BasePolicy, MergeContext, Scope, get_method, method_names


def _context(name: str) -> MergeContext:
    method = get_method(name)
    assert method is not None
    n = max(method.min_inputs, 1 + (method.min_non_base or 0), 2)
    if method.max_inputs is not None:
        n = min(n, method.max_inputs)
    tensors = [torch.randn(8, 6, generator=torch.Generator().manual_seed(i)).to("meta") for i in range(n)]
    params: dict[str, object] = {}
    per_model: list[dict[str, object]] = [{} for _ in range(n)]
    for spec in method.params:
        value = spec.default if spec.default is not None else 0.5
        if spec.scope is Scope.GLOBAL:
            params[spec.name] = value
        else:
            for model in per_model:
                model[spec.name] = value
    return MergeContext(
        tensors=tensors,
        base_index=None if method.base is BasePolicy.FORBIDDEN else 0,
        model_params=per_model,
        params=params,
        # meta has no generator of its own; random ops on meta tensors ignore a CPU one
        generator=torch.Generator().manual_seed(0) if method.randomized else None,
    )


@pytest.mark.parametrize("name", method_names())
def test_method_creates_nothing_off_the_inputs_device(name: str) -> None:
    method = get_method(name)
    assert method is not None
    try:
        out = method.fn(_context(name))
    except RuntimeError as exc:
        assert "meta tensor" in str(exc), f"{name}: {exc}"  # data-dependent, fine on a real device
        return
    assert out.device.type == "meta" and tuple(out.shape) == (8, 6)

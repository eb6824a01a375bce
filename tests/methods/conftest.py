"""Shared fixture for the merge-method tests: one way to call a registered method on plain tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import pytest
import torch

from resumerge.merge.methods import MergeContext, get_method


class Merge(Protocol):
    """Signature of the ``merge`` fixture."""

    def __call__(
        self,
        method: str,
        tensors: Sequence[torch.Tensor],
        *,
        base: int | None = None,
        params: Mapping[str, Any] | None = None,
        per_model: Mapping[str, Sequence[Any]] | None = None,
        seed: int | None = 0,
    ) -> torch.Tensor: ...


def _merge(
    method: str,
    tensors: Sequence[torch.Tensor],
    *,
    base: int | None = None,
    params: Mapping[str, Any] | None = None,
    per_model: Mapping[str, Sequence[Any]] | None = None,
    seed: int | None = 0,
) -> torch.Tensor:
    spec = get_method(method)
    assert spec is not None, f"{method} is not registered"
    model_params = [
        {name: values[i] for name, values in (per_model or {}).items() if values[i] is not None}
        for i in range(len(tensors))
    ]
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    # The planner binds every default before a method runs; so does this helper, the same way.
    bound_models, bound = spec.bind(model_params, params or {}, base)
    ctx = MergeContext(list(tensors), base, bound_models, bound, generator)
    return spec.fn(ctx)


@pytest.fixture(scope="session")
def merge() -> Merge:
    """Call a registered method: ``merge("ties", tensors, base=0, per_model={"weight": [None, 1.0]})``.

    ``per_model[name][i]`` becomes input i's parameter (``None`` leaves it unset, as for the base of a
    ``NON_BASE`` parameter). A generator seeded with ``seed`` is always passed (``seed=None`` passes none);
    deterministic methods ignore it. Session-scoped so that hypothesis tests may use it.
    """
    return _merge

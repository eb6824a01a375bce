"""What one run's units share travels in that run's resources, never in module globals: two runs (two plans) in
one process, each with its own MoE routers or its own extraction factors, each get their own.

Before: ``moe.routers.provide`` kept the routers of every forward pass in a module dict ("the last call wins"), and
``extract.factors`` one factor cache and one table of pending pairs for the whole process, which the next
extraction's planning (an estimate, even) replaced under a running one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resumerge.merge.methods.resources import NO_RESOURCES, Resources
from resumerge.merge.methods.spec import MergeContext
from resumerge.runs.extract import factors
from resumerge.runs.extract.factor_cache import FactorCache
from resumerge.runs.extract.factors import FactorStore, cache_key, factor_a, factor_b
from resumerge.runs.moe.routers import RouterSources, router_values

ROUTER_PARAMS = {"routers": "pass-key", "layer": 1, "first": 0, "stop": 2}
MODULE = {"module": "model.layers.0.mlp.up_proj", "source": "s", "rank": 2, "exact": True, "seed": 3,
          "sv_epsilon": 0.0, "distribute_scale": True, "embedding": False, "device": "cpu", "threads": 1}


def _routers(value: float) -> RouterSources:
    sources = RouterSources()
    sources.provide("pass-key", lambda: torch.full((2, 3, 4), value))
    return sources


def _router_ctx(resources: Resources) -> MergeContext:
    return MergeContext([], None, [], ROUTER_PARAMS, resources=resources)


def test_two_runs_get_the_routers_of_their_own_forward_pass() -> None:
    first, second = Resources((_routers(1.0),)), Resources((_routers(2.0),))
    assert torch.equal(router_values(_router_ctx(first)), torch.full((2, 4), 1.0))
    assert torch.equal(router_values(_router_ctx(second)), torch.full((2, 4), 2.0))
    assert torch.equal(router_values(_router_ctx(first)), torch.full((2, 4), 1.0))  # the later run took nothing


def test_a_router_unit_outside_a_run_that_provided_its_routers_is_refused() -> None:
    with pytest.raises(ValueError, match="not provided"):
        router_values(_router_ctx(NO_RESOURCES))
    with pytest.raises(ValueError, match="not provided"):
        router_values(_router_ctx(Resources((RouterSources(),))))


def _module_ctx(resources: Resources) -> MergeContext:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    return MergeContext([base, base + torch.randn(6, 5, generator=g)], 0, [{}, {}], MODULE, owned_inputs=True,
                        resources=resources)


def _cached(directory: Path, value: float) -> FactorStore:
    """A run's store whose cache holds factors of ``MODULE`` filled with ``value`` (a killed run's leftovers)."""
    cache = FactorCache(directory)
    cache.store(cache_key(MODULE), torch.full((2, 5), value), torch.full((6, 2), value), module=MODULE["module"])
    return FactorStore(cache)


def test_two_extractions_read_their_own_factor_caches(tmp_path: Path) -> None:
    first = Resources((_cached(tmp_path / "one", 1.0),))
    second = Resources((_cached(tmp_path / "two", 2.0),))
    assert torch.equal(factor_a(_module_ctx(first)), torch.full((2, 5), 1.0))
    assert torch.equal(factor_a(_module_ctx(second)), torch.full((2, 5), 2.0))
    # Each pair waits in its own run's store for its sibling: the B units collect their own run's.
    assert torch.equal(factor_b(_module_ctx(second)), torch.full((6, 2), 2.0))
    assert torch.equal(factor_b(_module_ctx(first)), torch.full((6, 2), 1.0))


def test_a_pair_is_computed_once_per_run_and_never_collected_by_another(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = factors.decompose

    def counted(ctx: MergeContext) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return real(ctx)

    monkeypatch.setattr(factors, "decompose", counted)
    first, second = Resources((FactorStore(),)), Resources((FactorStore(),))
    a = factor_a(_module_ctx(first))
    assert len(calls) == 1
    b_other = factor_b(_module_ctx(second))  # the other run computes its own pair: the first's is not its
    assert len(calls) == 2
    b = factor_b(_module_ctx(first))  # the sibling of the first run collects its run's pair
    assert len(calls) == 2
    expected_a, expected_b = real(_module_ctx(NO_RESOURCES))
    assert torch.equal(a, expected_a) and torch.equal(b, expected_b) and torch.equal(b_other, expected_b)

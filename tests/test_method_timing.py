"""Compute-time estimates from samples of the plan's own tensors."""

from __future__ import annotations

import time

import pytest
import torch

from resumerge.analyses.estimate.method_timing import ComputeRate, Timing, measure_rate
from resumerge.merge.methods import MergeContext, MethodSpec, get_method

SLEEP = 0.02


def _sleepy(ctx: MergeContext) -> torch.Tensor:
    time.sleep(SLEEP)
    return ctx.tensors[0].clone()


def _needs_generator(ctx: MergeContext) -> torch.Tensor:
    assert ctx.generator is not None
    return torch.rand(ctx.tensors[0].shape, generator=ctx.generator)


def test_rate_is_the_fastest_time_per_output_element() -> None:
    spec = MethodSpec(name="sleepy", fn=_sleepy)
    samples = [[torch.zeros(10, 10)], [torch.zeros(30, 10)]]
    rate = measure_rate(spec, samples, base_index=None, model_params=[{}], params={}, timing=Timing(repeats=2))
    assert rate.method == "sleepy" and rate.sample_elements == 400
    assert rate.threads == torch.get_num_threads()
    # two samples of one sleep each over 400 elements: at least 2·SLEEP/400, and nowhere near ten times that
    assert 2 * SLEEP / 400 <= rate.seconds_per_element < 20 * SLEEP / 400
    assert rate.seconds_for(4000) == pytest.approx(10 * rate.seconds_for(400))


def test_rate_is_the_fastest_call_a_busy_spell_does_not_count() -> None:
    """Interference only slows a call down: one call that lost its core for ten times its cost changes nothing."""
    calls: list[float] = []

    def once_slow(ctx: MergeContext) -> torch.Tensor:
        time.sleep(10 * SLEEP if not calls else SLEEP)
        calls.append(SLEEP)
        return ctx.tensors[0].clone()

    spec = MethodSpec(name="once_slow", fn=once_slow)
    rate = measure_rate(spec, [[torch.zeros(10, 10)]], base_index=None, model_params=[{}], params={},
                        timing=Timing(repeats=3, warmup=False))
    # The mean of the three calls (4·SLEEP per 100 elements) would fail the bound: only the fastest passes it.
    assert len(calls) == 3 and SLEEP / 100 <= rate.seconds_per_element < 2 * SLEEP / 100


def test_randomised_methods_get_a_generator() -> None:
    spec = MethodSpec(name="random", fn=_needs_generator, randomized=True)
    rate = measure_rate(spec, [[torch.zeros(4, 4)]], base_index=None, model_params=[{}], params={},
                        timing=Timing(repeats=1))
    assert rate.sample_elements == 16 and rate.seconds_per_element > 0


def test_registered_methods_are_found_by_name() -> None:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64, 96, generator=gen)
    tensors = [base, base + 0.01 * torch.randn(64, 96, generator=gen), base + 0.01 * torch.randn(64, 96, generator=gen)]
    ties = get_method("ties")
    assert ties is not None
    # As the planner resolves them: every parameter bound, defaults included.
    per_model, params = ties.bind([{}, {"weight": 0.5, "density": 0.3}, {"weight": 0.5, "density": 0.3}], {}, 0)
    rate = measure_rate(
        "ties", [[t[:21].contiguous() for t in tensors]], base_index=0, model_params=per_model, params=params
    )
    assert isinstance(rate, ComputeRate) and rate.method == "ties"
    assert rate.sample_elements == 21 * 96 and rate.seconds_per_element > 0


def test_bad_requests_are_refused() -> None:
    spec = MethodSpec(name="sleepy", fn=_sleepy)
    with pytest.raises(ValueError, match="unknown merge method"):
        measure_rate("no_such_method", [[torch.zeros(2)]], base_index=None, model_params=[{}], params={})
    with pytest.raises(ValueError, match="at least one sample"):
        measure_rate(spec, [], base_index=None, model_params=[{}], params={})
    with pytest.raises(ValueError, match="repeats"):
        measure_rate(spec, [[torch.zeros(2)]], base_index=None, model_params=[{}], params={}, timing=Timing(repeats=0))
    with pytest.raises(ValueError, match="no output elements"):
        measure_rate(spec, [[torch.zeros(0, 3)]], base_index=None, model_params=[{}], params={},
                     timing=Timing(repeats=1))


def test_warm_up_and_repeats_can_be_capped() -> None:
    calls: list[int] = []

    def counted(ctx: MergeContext) -> torch.Tensor:
        calls.append(ctx.tensors[0].numel())
        return ctx.tensors[0].clone()

    spec = MethodSpec(name="counted", fn=counted)
    samples = [[torch.zeros(2, 2)], [torch.zeros(3, 2)]]
    measure_rate(spec, samples, base_index=None, model_params=[{}], params={}, timing=Timing(repeats=5))
    assert calls == [4] + [4] * 5 + [6] * 5  # one warm-up on the first sample, then every repeat
    calls.clear()
    # No warm-up, and once the time budget is spent each sample still gets its one timed call.
    rate = measure_rate(spec, samples, base_index=None, model_params=[{}], params={},
                        timing=Timing(repeats=5, warmup=False, max_seconds=0.0))
    assert calls == [4, 6] and rate.sample_elements == 10
    calls.clear()
    # A window: calls go on until they took min_seconds together (here: until max_calls).
    measure_rate(spec, samples[:1], base_index=None, model_params=[{}], params={},
                 timing=Timing(repeats=1, warmup=False, min_seconds=60.0, max_calls=7))
    assert calls == [4] * 7

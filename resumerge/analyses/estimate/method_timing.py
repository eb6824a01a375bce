"""How long a merge method computes, measured on a small sample of the plan's own tensors.

A plan knows every output tensor's method, parameters and size, but not how fast the method runs on this machine:
linear is a few passes over memory, TIES a selection per task vector, DELLA a sort per row, SCE a variance in
double precision. :func:`measure_rate` times the registered method on a few row slices of the real inputs (a few
MB in all, so seconds at most) and returns seconds per output element; :meth:`ComputeRate.seconds_for` scales it
to a tensor, a shard or the whole plan. Slices keep whole rows (:mod:`resumerge.analyses.estimate.compute` takes the
leading rows), so methods that work per row (DELLA, row-wise nuslerp) are timed on rows of the real length.

The figure is for the thread count torch uses when it is measured; it is the fastest call of each sample (see
:func:`measure_rate`), so what else the machine is doing then changes it little. Rank-based methods cost slightly
more per element on large tensors than on samples (cache), so treat it as an estimate, not a bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.registry import MergeContext, MethodSpec, get_method

DEFAULT_SAMPLE_ELEMENTS = 1 << 20  # per sampled tensor: 4 MB of float32, a few milliseconds for most methods


@dataclass(frozen=True)
class ComputeRate:
    """A method's measured compute cost: ``seconds_per_element`` of output, from ``sample_elements`` outputs."""

    method: str
    seconds_per_element: float
    sample_elements: int
    threads: int

    def seconds_for(self, elements: int) -> float:
        """Estimated compute seconds for ``elements`` output elements."""
        return self.seconds_per_element * elements


@dataclass(frozen=True)
class Timing:
    """How :func:`measure_rate` times: each sample ``repeats`` times (and again while its calls together took less
    than ``min_seconds``, at most ``max_calls`` calls), after one untimed call unless ``warmup`` is false, stopping
    once ``max_seconds`` went into timing (each sample still gets one call); a randomised method's generator seeded
    with ``seed`` per call; ``clock`` reads each call's time."""

    repeats: int = 3
    seed: int = 0
    warmup: bool = True
    max_seconds: float | None = None
    min_seconds: float = 0.0
    max_calls: int = 1000
    clock: Callable[[], float] = time.perf_counter


def measure_rate(
    method: MethodSpec | str,
    samples: Sequence[Sequence[torch.Tensor]],
    *,
    base_index: int | None,
    model_params: Sequence[Mapping[str, Any]],
    params: Mapping[str, Any],
    timing: Timing = Timing(),
    merge: Callable[[Sequence[torch.Tensor]], int] | None = None,
) -> ComputeRate:
    """Time ``method`` on each sample and return its seconds per output element.

    ``samples`` holds one entry per sampled output tensor: its inputs in config order, already cast to the
    compute dtype and on the compute device (e.g. the same leading rows of each input). ``base_index``,
    ``model_params`` and ``params`` are the resolved parameters, as a :class:`MergeContext` takes them (one set for
    all samples); ``timing`` (:class:`Timing`) says how. Randomised methods get a fresh generator seeded with
    ``seed`` per call. After one untimed
    warm-up call, each sample is run ``repeats`` times, and again while its calls together took less than
    ``min_seconds`` (at most ``max_calls`` calls); the rate is the sum of each sample's fastest call over the sum of
    the output elements. The fastest call, not the mean or the median: interference (another process on the core,
    a scheduler slice lost, a second thread waiting for a busy core) only ever slows a call down, so the fastest
    of many short calls is the one nearest the method's own cost, and repeated plans agree on it — the mean over a
    window of DeepSeek-V3's FP8 sample gave 4.2–109 ns/element between paired plans at load 2 (bench/RESULTS.md,
    issue 45). ``warmup`` false skips the warm-up (a caller timing several sets of samples in a row warms up
    once); with ``max_seconds``, calls stop once that much time has gone into timing, so a slow method costs one
    timed call per sample (never fewer). CUDA work is synchronised before each clock reading. Raises
    ``ValueError`` for an unknown method name, no samples, ``repeats < 1`` or samples without any output element,
    and whatever the method raises for bad inputs. ``merge`` is what is timed on a sample's inputs, returning the
    output elements it made (default: the method's function on a context of them with the parameters above):
    ``plan`` times the engine's own compute step. ``clock`` times each call (``max_seconds`` is always wall
    time): ``time.thread_time`` times a computation whose kernels all run on the calling thread by the CPU it
    used, which the time it spent waiting for a core does not change.
    """
    spec = get_method(method) if isinstance(method, str) else method
    if spec is None:
        raise ValueError(f"unknown merge method {method!r}")
    if not samples:
        raise ValueError("measure_rate needs at least one sample")
    repeats, seed, clock, max_seconds = timing.repeats, timing.seed, timing.clock, timing.max_seconds
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")

    def run(tensors: Sequence[torch.Tensor]) -> int:
        if merge is not None:
            return merge(tensors)
        generator = torch.Generator(device=tensors[0].device).manual_seed(seed) if spec.randomized else None
        ctx = MergeContext(list(tensors), base_index, model_params, params, generator)
        return spec.fn(ctx).numel()

    # The first call pays one-off costs (lazy imports, allocator growth, first-touch page faults) that a long
    # merge amortises, so it is not timed.
    if timing.warmup:
        run(samples[0])
    seconds = 0.0
    elements = 0
    began = time.perf_counter()
    for tensors in samples:
        times: list[float] = []
        while len(times) < max(1, timing.max_calls) and (len(times) < repeats or sum(times) < timing.min_seconds):
            if times and max_seconds is not None and time.perf_counter() - began > max_seconds:
                break
            _synchronize(tensors)
            start = clock()
            produced = run(tensors)
            _synchronize(tensors)
            times.append(clock() - start)
        seconds += min(times)
        elements += produced
    if elements == 0:
        raise ValueError("the samples produced no output elements to time")
    return ComputeRate(spec.name, seconds / elements, elements, torch.get_num_threads())


def _synchronize(tensors: Sequence[torch.Tensor]) -> None:
    # CUDA kernels run asynchronously: without a barrier the clock would measure only the launches.
    device = tensors[0].device if tensors else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)

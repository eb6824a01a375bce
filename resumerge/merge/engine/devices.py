"""Where merge methods run: the CPU, or one CUDA GPU with a memory budget of its own.

The device is part of :class:`~resumerge.merge.plan.merge_plan.PlanOptions` (and so of the fingerprint): a GPU's kernels
may round differently from the CPU's, and an output must never mix tensors computed on both, so a resume keeps
the device the merge started with. Reading and writing always happen on the host; only the method's arithmetic moves.

The device names (:func:`normalise_device`, :func:`is_gpu`) are :mod:`resumerge.machine.memory.cuda`'s, the one owner
the forward pass reads too, re-exported here. torch is imported lazily, so this module is cheap to import for the
CLI's argument checks.
"""

from __future__ import annotations

import contextlib
import functools

from resumerge.errors import UsageError
from resumerge.machine.memory import CudaProbe, MemoryGovernor, MemoryProbe, Pacing, SystemProbe, default_budget
from resumerge.machine.memory.cuda import CPU, GPU_BUDGET_OPTION, GPU_FRACTION, is_gpu, normalise_device
from resumerge.machine.memory.sizes import format_size
from resumerge.machine.torch_import import when_loaded
from resumerge.merge.engine.footprint import run_baseline, smallest_run_budget
from resumerge.merge.engine.inflight import CONCURRENCY, HELD_PER_WORKER
from resumerge.merge.plan.merge_plan import Plan
from resumerge.merge.plan.workunits import Oversized, largest, oversized_units

__all__ = ["CPU", "GPU_BUDGET_OPTION", "GPU_FRACTION", "gpu_governor", "is_gpu", "make_governor", "normalise_device",
           "set_torch_threads"]


def set_torch_threads(count: int | None) -> None:
    """mergekit's ``-j/--num-threads``: torch's intra-op (and, while still settable, inter-op) thread count;
    None leaves torch's choice. Raises :class:`UsageError` for a count below 1.

    The count is taken now and applied when torch is imported (:func:`resumerge.machine.torch_import.when_loaded`),
    before its first kernel: importing it here would put its import (about 2 s of CPU) before a hub run's first
    download.
    """
    if count is not None and count < 1:
        raise UsageError("--num-threads must be at least 1")
    when_loaded(_THREADS, None if count is None else functools.partial(_apply_threads, count))


_THREADS = "num_threads"


def _apply_threads(count: int) -> None:
    import torch

    torch.set_num_threads(count)
    with contextlib.suppress(RuntimeError):  # only settable before the first parallel work of the process
        torch.set_num_interop_threads(count)


def gpu_governor(plan: Plan, device: str, max_gpu_memory: int | None,
                 probe: MemoryProbe | None = None) -> MemoryGovernor | None:
    """The governor of ``device``'s memory for ``plan``, or None when the merge runs on the CPU.

    ``probe`` defaults to a :class:`CudaProbe` of the device; that constructor raises :class:`UsageError`
    (exit 2) when torch sees no GPU — also on resume, where the recorded device cannot change. Raises
    :class:`UsageError` naming the smallest GPU budget that works when a tensor that must be held whole
    cannot fit.
    """
    if not is_gpu(device):
        return None
    if probe is None:
        probe = CudaProbe(device)
    budget = max_gpu_memory if max_gpu_memory is not None else default_budget(probe, GPU_FRACTION)
    _refuse_oversized(plan, budget, probe.rss(), device, memory="GPU memory", option=GPU_BUDGET_OPTION,
                      budget_name="GPU budget", other=", or use --device cpu")
    return MemoryGovernor(budget, probe, pool=device, budget_option=GPU_BUDGET_OPTION)


# How long the run's admissions reuse the governor's last memory reading (its sampler reads every 50 ms anyway):
# reading /proc and the cgroup for each of 90k tiny tensors cost more than merging them.
READING_REUSE = 0.02


def make_governor(plan: Plan, max_memory: int | None) -> MemoryGovernor:
    """A governor for ``plan`` under ``max_memory`` (or the default budget).

    Raises :class:`UsageError` (exit 2, before OUT is touched) when the budget is below the smallest the merge works
    under (:func:`~resumerge.merge.engine.footprint.smallest_run_budget`, the figure ``plan`` names), naming it.
    """
    probe = SystemProbe()
    budget = max_memory if max_memory is not None else default_budget(probe)
    baseline = run_baseline(plan)  # read from a cache but once per installation
    worst = smallest_run_budget(plan, baseline)
    if worst.needed > budget:
        raise UsageError(_too_small(worst, budget), tensor=worst.tensor or None,
                         hint=f"the smallest budget that works is {format_size(worst.needed)}; rerun with "
                         f"--max-memory {format_size(worst.needed, compact=True)} or more")
    # As many units in flight as the engine's line holds (each holds its reservation until written): the
    # governor's default 4 held a 7-type GGUF release's other worker behind each layer's down_proj.
    return MemoryGovernor(budget, probe, reuse_reading=READING_REUSE, baseline=baseline,
                          pacing=Pacing(max_in_flight=HELD_PER_WORKER * CONCURRENCY))


def _too_small(worst: Oversized, budget: int) -> str:
    what = f"tensor {worst.tensor} ({worst.method})" if worst.tensor else "the merge"
    return f"{what} needs more memory than the budget of {format_size(budget)}"


def _refuse_oversized(plan: Plan, budget: int, baseline: int, device: str | None, *, memory: str, option: str,
                      budget_name: str, other: str = "") -> None:
    """Raise :class:`UsageError` naming the smallest ``budget_name`` that works when a tensor of ``plan`` that
    must be held whole cannot fit under ``budget`` beside ``baseline`` on ``device`` (None: the plan's)."""
    too_big = oversized_units(plan, budget, baseline, device)
    if too_big:
        worst = largest(too_big)
        raise UsageError(
            f"tensor {worst.tensor} ({worst.method}) needs more {memory} than the budget of {format_size(budget)}",
            tensor=worst.tensor,
            hint=f"the smallest {budget_name} that works is {format_size(worst.needed)}; rerun with {option} "
            f"{format_size(worst.needed, compact=True)} or more{other}",
        )

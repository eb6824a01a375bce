"""Where a pass's layers run: the CPU, or one CUDA GPU (``--device cuda``), with a memory budget of its own.

On a GPU each decoder layer is moved there while it runs (read on the host, copied over, dropped after: the stream's
:meth:`~resumerge.forward.engine.stream.ModelStream.load`) and the hidden states stay there between layers, so a model
larger than the GPU's memory runs on it: what the GPU holds is one layer (a step of the pass) beside the hidden
states. The journal holds host tensors whatever the device (:class:`~resumerge.forward.job.journal.Journal`), so a pass
started on a GPU resumes on the CPU and the other way round, with the same files.

One owner for a pass's device: its name read as ``run`` reads ``--device``
(:func:`~resumerge.machine.memory.cuda.normalise_device`), the refusal where torch sees no GPU (one line, exit 2, the
probe's own words, as ``run``'s), and the GPU budget's arithmetic (:meth:`PassDevice.budget`: the largest step
beside the hidden states, refused before any weight is read, naming the smallest ``--max-gpu-memory`` that fits),
whose governor :class:`~resumerge.forward.job.admission.Admission` holds each step from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from resumerge.errors import UsageError
from resumerge.forward.engine.handed import HandingCall
from resumerge.machine.memory import MemoryGovernor, MemoryProbe, default_budget, format_size, parse_size
from resumerge.machine.memory.budget import smallest_budget_for
from resumerge.machine.memory.cuda import CPU, GPU_BUDGET_OPTION, GPU_FRACTION, CudaProbe, is_gpu, normalise_device
from resumerge.machine.torch_import import torch


@dataclass(frozen=True)
class GpuBudget:
    """A pass's GPU budget in force: ``budget`` bytes of the device ``device`` seen by ``probe``, each step (by
    name, as the RAM admission names them) holding ``steps`` bytes of it."""

    device: str
    budget: int
    steps: Mapping[str, int]
    probe: MemoryProbe = field(compare=False)

    def governor(self) -> MemoryGovernor:
        """The governor of the device's memory for the pass (``--max-gpu-memory`` named in its refusals)."""
        return MemoryGovernor(self.budget, self.probe, pool=self.device, budget_option=GPU_BUDGET_OPTION)


@dataclass(frozen=True)
class PassDevice:
    """Where a pass's layers run: ``name`` (``cpu`` or ``cuda:N``, as :meth:`of` reads it) and the GPU budget
    ``max_gpu_memory`` in bytes (None: :data:`~resumerge.machine.memory.cuda.GPU_FRACTION` of what the GPU has free)."""

    name: str = CPU
    max_gpu_memory: int | None = None

    @classmethod
    def of(cls, device: str = CPU, max_gpu_memory: int | str | None = None) -> PassDevice:
        """The device ``--device`` names, with ``--max-gpu-memory``; :class:`UsageError` (exit 2, before anything is
        read) for a device name ``run`` refuses too, for ``cuda`` where torch sees no GPU, and for a GPU budget
        without a GPU."""
        name = normalise_device(device)
        budget = parse_size(max_gpu_memory, option=GPU_BUDGET_OPTION) if isinstance(max_gpu_memory, str) \
            else max_gpu_memory
        if budget is not None and not is_gpu(name):
            raise UsageError(f"{GPU_BUDGET_OPTION} is the GPU's budget, and this pass runs on the CPU",
                             hint=f"give {GPU_BUDGET_OPTION} with --device cuda, or leave it out")
        if is_gpu(name):
            CudaProbe(name)  # refuses (exit 2) where torch sees no GPU: run's own words
        return cls(name, budget)

    @property
    def on_gpu(self) -> bool:
        return is_gpu(self.name)

    def budget(self, what: str, steps: Mapping[str, int], held: int, probe: MemoryProbe | None = None
               ) -> GpuBudget | None:
        """The GPU budget of a pass whose steps (by name) hold ``steps`` bytes each on the GPU beside ``held``
        bytes it keeps there throughout (the hidden states); None on the CPU. Raises :class:`UsageError` (exit 2,
        before any weight is read) naming the smallest ``--max-gpu-memory`` that fits, where the largest step does
        not fit beside them and what the device holds already; ``what`` names the pass ("the check"). ``probe``:
        the device's readings (a :class:`~resumerge.machine.memory.cuda.CudaProbe` of it unless given)."""
        if not self.on_gpu:
            return None
        probe = probe if probe is not None else CudaProbe(self.name)
        budget = self.max_gpu_memory if self.max_gpu_memory is not None else default_budget(probe, GPU_FRACTION)
        step = max(steps.values(), default=0)
        smallest = smallest_budget_for(step, baseline_bytes=held + probe.rss())
        if smallest > budget:
            option = f"{GPU_BUDGET_OPTION} {format_size(smallest, compact=True)} or more"
            raise UsageError(f"{what} needs {format_size(step + held)} of GPU memory on {self.name} (its largest "
                             f"step {format_size(step)} beside the hidden states' {format_size(held)}), more than "
                             f"the GPU budget of {format_size(budget)}",
                             hint=f"rerun with {option}, or use --device cpu")
        return GpuBudget(self.name, budget, dict(steps), probe)


# The pass on the host: the default of every client (a frozen value, shared safely).
HOST = PassDevice()


def moved(value: Any, device: torch.device, seen: dict[int, Any] | None = None) -> Any:
    """``value`` (a tensor, or tuples, lists and dicts of them: the hidden states and a layer's call) on ``device``,
    each tensor moved once however often it appears (a mask every layer's call shares stays one tensor there);
    ``value`` itself on the host, nothing copied. (Only the host itself, ``cpu``, is: ``cpu:0`` is moved to, as a
    GPU would be, copying each tensor, which is how the tests exercise a device's paths without a GPU.)"""
    if device == torch.device(CPU):
        return value
    seen = {} if seen is None else seen
    if isinstance(value, torch.Tensor):
        if id(value) not in seen:
            seen[id(value)] = value.to(device)
        return seen[id(value)]
    if isinstance(value, tuple):
        items = [moved(v, device, seen) for v in value]
        if isinstance(value, HandingCall):  # its slots kept: the values its layer hands on go there
            return value.remade(tuple(items))
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)  # a named tuple by its fields
    if isinstance(value, list):
        return [moved(v, device, seen) for v in value]
    if isinstance(value, dict):
        return {k: moved(v, device, seen) for k, v in value.items()}
    return value

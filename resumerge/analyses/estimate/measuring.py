"""What an estimate is told besides the plan: how it measures this machine (:class:`Measuring`, the merge's
start-up included) and the forward passes a run makes besides its merge (:class:`Passes`, and :class:`PassMakers`
that make them from a plan)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from resumerge.analyses.estimate.compute import SAMPLE_SECONDS
from resumerge.analyses.estimate.network import Bandwidth
from resumerge.machine.diskprobe import DEFAULT_PROBE_BYTES, DiskFree, free_bytes

if TYPE_CHECKING:
    from resumerge.analyses.estimate.firstpass import FirstPass
    from resumerge.inputs.catalog import Inputs
    from resumerge.merge.plan.merge_plan import Plan

# What a pass in a process of its own costs, given the inputs' read speed (None: unknown): its seconds from the
# run's start on a core of its own, its CPU seconds, its process's memory at its peak (as the budget counts it),
# whether it runs beside the merge rather than before it, the cores the run's processes may expect (None: not
# measured), and why the run would refuse it under the budget (None: it fits).
Prepass = Callable[[float | None], tuple[float, float, int, bool, float | None, str | None]]


@dataclass(frozen=True)
class Startup:
    """What the merge spends before its first tensor (imports, planning): ``seconds`` in all, ``import_seconds``
    the part of it that torch's import takes, which a run makes once its first bytes move
    (:mod:`resumerge.machine.torch_import`)."""

    seconds: float = 0.0
    import_seconds: float = 0.0


@dataclass(frozen=True)
class Measuring:
    """How an estimate measures this machine: ``probe_bytes`` sizes the disk speed probe (0 skips it, and the
    transfer-CPU and download probes too); ``disk_free`` reads a filesystem's free bytes (injectable for tests);
    ``compute_budget`` bounds the seconds spent timing the methods on samples of the pending tensors (0 skips it;
    see :mod:`resumerge.analyses.estimate.compute`); ``bandwidth`` is the link (``--bandwidth``) the network estimate
    uses (None: the download rate is measured on a hub input, the upload rate stays unknown; see
    :mod:`resumerge.analyses.estimate.network`); ``startup`` what the merge's process spends before its first
    tensor, as measured here (nothing: a notebook's warm process)."""

    probe_bytes: int = DEFAULT_PROBE_BYTES
    disk_free: DiskFree = free_bytes
    compute_budget: float = SAMPLE_SECONDS
    bandwidth: Bandwidth | None = None
    startup: Startup = Startup()


@dataclass(frozen=True)
class Passes:
    """The forward passes a run makes besides its merge, as an estimate counts them: ``prepass``, one in a process
    of its own beside the merge or before it (a mergekit-moe config's prompt forward pass), given the inputs' read
    speed; ``first_pass``, one the run's own process makes before the merge (``--imatrix-texts``'), whose seconds,
    memory and state-dir bytes are counted in."""

    prepass: Prepass | None = None
    first_pass: FirstPass | None = None


@dataclass(frozen=True)
class PassMakers:
    """How :func:`estimate_config` learns a run's :class:`Passes` from the plan it makes: ``prepass`` from the plan
    and its inputs (MoE's prompt forward pass), ``first_pass`` from the plan (``--imatrix-texts``')."""

    prepass: Callable[[Plan, Inputs], Prepass | None] | None = None
    first_pass: Callable[[Plan], FirstPass] | None = None

    def of(self, plan: Plan, inputs: Inputs) -> Passes:
        return Passes(self.prepass(plan, inputs) if self.prepass is not None else None,
                      self.first_pass(plan) if self.first_pass is not None else None)

"""What the prompt forward pass of the hidden-state gate modes will cost, for ``plan``: its seconds, what its
process holds at its peak, and whether it runs beside the merge (:func:`~resumerge.runs.moe.hiddenpass.beside_share`,
the run's own rule) or before it.

The pass's process is started once to learn what it holds and how long it takes to start (its imports, the
base's modules built without weights and its tokenizer: a process like the run's will, :mod:`.passmain`'s
``probe`` job); to that come its largest layer (:func:`~resumerge.runs.moe.forward.pass_bytes`) and the CPU of the
layers it runs. Meanwhile the CPU other processes take is measured: beside the merge the two processes share what
is left of the cores (:class:`resumerge.analyses.estimate.costs.TimeEstimate`), and on a shared machine that, not either
process alone, bounds the run. Nothing is computed and nothing is written.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from resumerge.config.locations import StateDir
from resumerge.config.settings import RunSettings
from resumerge.inputs.catalog import Inputs
from resumerge.inputs.codecs import CODECS
from resumerge.machine.memory import SystemProbe, default_budget, usable_cores
from resumerge.merge.plan.merge_plan import Plan, PlanOptions
from resumerge.merge.plan.prepared import Prepared
from resumerge.runs.moe.config import MoeConfig, prompt_texts
from resumerge.runs.moe.forward import pass_bytes
from resumerge.runs.moe.hiddenpass import beside_share
from resumerge.runs.moe.passproc import HIDDEN_MODES, run_child
from resumerge.runs.moe.passshare import share_problem
from resumerge.runs.moe.prepare import base_folder, prepare_moe, routers_dir
from resumerge.runs.moe.state import ROUTERS_NAME

# The pass's CPU per byte of the layers it reads, once its modules and tokenizer are loaded: each tensor cast to
# bfloat16 from a map of the file (0.4 s for 1.47 GB), the layer's bfloat16 forward over the prompt sets and the
# journaled hidden states; 1.5 s for the bench's 1.47 GB on its 2-core machine (the pass's CPU less the probe's).
_LAYER_CPU_PER_BYTE = 1.0e-9
# The run's process starts the pass's process once it has read the config (interpreter start, the CLI's imports,
# the YAML): 0.2-0.3 s on the bench's machine; the probe's own seconds count from its process's start.
_SPAWN_SECONDS = 0.3


# (seconds from the run's start on a core of its own, CPU seconds, peak of its process counted as the budget
# counts it, beside the merge, the cores the run's two processes may expect, why it would not fit or None):
# resumerge.analyses.estimate.estimate's Prepass
PrepassCost = tuple[float, float, int, bool, float | None, str | None]


def pass_estimate(config: MoeConfig, inputs: Inputs, state: StateDir,
                  max_memory: int | None) -> Callable[[float | None], PrepassCost] | None:
    """The estimate of ``config``'s prompt forward pass under ``max_memory`` (None: the default budget) as a
    function of the inputs' read speed, or None when its gate mode has none; nothing (all zero) when an earlier
    run finished it."""
    if config.gate_mode not in HIDDEN_MODES:
        return None
    base = inputs.models[config.base_model.key]

    def estimate(read_bytes_per_s: float | None) -> PrepassCost:
        del read_bytes_per_s  # the pass's reads follow the merge's of the same files: counted as CPU, below
        if (routers_dir(config, base, state) / ROUTERS_NAME).is_file():
            return 0.0, 0.0, 0, False, None, None
        with tempfile.TemporaryDirectory(prefix="resumerge-probe-") as scratch, _OthersCpu() as others:
            # The run's pass makes the same checks (resumerge.runs.moe.forward.pass_checks), before the merge starts.
            found = run_child({"job": "probe", "mode": config.gate_mode,
                               "weights_dir": str(base_folder(base, state)),
                               "prompts": prompt_texts(config)}, Path(scratch))
        layers = int(base.config["num_hidden_layers"])
        tensors = {name: (t.file, t.entry.start, t.entry.end, t.entry.dtype, t.entry.shape)
                   for name, t in base.tensors.items()}
        run = ["model.embed_tokens.", *(f"model.layers.{i}." for i in range(layers - 1))]
        read = sum(end - start for name, (_, start, end, _, _) in tensors.items() if name.startswith(tuple(run)))
        # What other processes took while the probe ran is what the run's two processes will not have.
        cores = max(1.0, usable_cores() - others.cores)
        layer_cpu = read * _LAYER_CPU_PER_BYTE
        seconds = _SPAWN_SECONDS + float(found["seconds"]) + layer_cpu / min(1.0, cores)
        probe = SystemProbe()
        budget = max_memory if max_memory is not None else default_budget(probe)
        layer = pass_bytes(CODECS.recognise(base.config, base.tensors, where=str(base.directory)), layers)
        held = probe.rss()
        share = beside_share(budget, held, layer)
        # The run's own guard on the pass, with what its process holds counted as the run counts it.
        problem = share_problem(int(found["counted"]), layer, budget - held if share is None else share, held)
        return (seconds, float(found["cpu_seconds"]) + layer_cpu, int(found["counted"]) + layer, share is not None,
                cores, None if problem is None else f"memory: {problem.one_line()}")

    return estimate


class _OthersCpu:
    """The cores that processes other than this one and its children kept busy while the block ran (the
    machine's busy time from ``/proc/stat``, less this process's own and its waited children's)."""

    def __enter__(self) -> _OthersCpu:
        self._start = (time.monotonic(), _busy(), _own())
        self.cores = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.monotonic() - self._start[0]
        if wall > 0:
            self.cores = max(0.0, (_busy() - self._start[1] - (_own() - self._start[2])) / wall)


def _busy() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def _own() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def estimators(config: MoeConfig, options: PlanOptions, settings: RunSettings) -> tuple[Callable[[], Prepared],
                          Callable[[Plan, Inputs], Callable[[float | None], PrepassCost] | None]]:
    """``plan``'s planner of ``config`` (the pass is not run) and its estimate of the pass, for
    :func:`resumerge.analyses.estimate.estimate.estimate_config`."""

    def planner() -> Prepared:
        return prepare_moe(config, options, settings, forward=False)

    def prepass(_: Plan, inputs: Inputs) -> Callable[[float | None], PrepassCost] | None:
        return pass_estimate(config, inputs, settings.state, settings.max_memory)

    return planner, prepass

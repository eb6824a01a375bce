"""What the prompt forward pass of the hidden-state gate modes will cost, for ``plan``: its seconds and the RSS of
the run's processes together while it runs (the run's process waiting, the pass's process at its peak).

The pass's process is started once to learn what it holds and how long it takes to start (its imports and the
base's modules built without weights: a process like the run's will, :mod:`.passmain`'s ``probe`` job); to that
come its largest layer (:func:`~resumerge.moe.forward.pass_bytes`) and the time to read the layers it runs.
Nothing is computed and nothing is written.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import psutil

from resumerge.inputs.catalog import Inputs
from resumerge.moe.config import MoeConfig
from resumerge.moe.forward import ROUTERS_NAME, pass_bytes
from resumerge.moe.passproc import run_child
from resumerge.moe.prepare import HIDDEN_MODES, routers_dir

# Cast to bfloat16 and copied into the module: bytes per second of the float32 read, measured on the bench's
# 2-core machine (a cold read is slower, and is counted at the measured read speed instead).
_CAST_BYTES_PER_S = 1.5e9


def pass_estimate(config: MoeConfig, inputs: Inputs, state_dir: str | os.PathLike[str] | None
                  ) -> Callable[[float | None], tuple[float, int]] | None:
    """The estimate of ``config``'s prompt forward pass as a function of the inputs' read speed, or None when its
    gate mode has none; (0, 0) when an earlier run finished it (nothing runs)."""
    if config.gate_mode not in HIDDEN_MODES:
        return None
    base = inputs.models[config.base_model.key]

    def estimate(read_bytes_per_s: float | None) -> tuple[float, int]:
        if (routers_dir(config, base, state_dir) / ROUTERS_NAME).is_file():
            return 0.0, 0
        with tempfile.TemporaryDirectory(prefix="resumerge-probe-") as scratch:
            found = run_child({"job": "probe", "mode": config.gate_mode, "weights_dir": str(base.directory)},
                              Path(scratch))
        layers = int(base.config["num_hidden_layers"])
        tensors = {name: (t.file, t.entry.start, t.entry.end, t.entry.dtype, t.entry.shape)
                   for name, t in base.tensors.items()}
        run = ["model.embed_tokens.", *(f"model.layers.{i}." for i in range(layers - 1))]
        read = sum(end - start for name, (_, start, end, _, _) in tensors.items() if name.startswith(tuple(run)))
        seconds = float(found["seconds"]) + read / _CAST_BYTES_PER_S
        if read_bytes_per_s:
            seconds += read / read_bytes_per_s
        held = int(psutil.Process().memory_info().rss)
        return seconds, held + int(found["rss"]) + pass_bytes(tensors, layers)

    return estimate

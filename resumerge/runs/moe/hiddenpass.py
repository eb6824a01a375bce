"""The hidden-state gate modes' prompt forward pass of one run: started as soon as the config and the inputs'
headers are checked, in a process of its own (:mod:`.passproc`), so its start (an interpreter with torch and
transformers) overlaps the run's own work, and run beside the merge when the memory budget holds both.

The routers are the plan's last shard (:func:`resumerge.runs.moe.planner.build_moe_plan`), so every other tensor is
merged and committed while the pass computes; the engine's router units wait for it. Beside the merge the pass
takes its share out of the run's memory governor (a reservation held until its process ends); where the budget
is too small to give both their share, the run waits for the pass before the merge starts, and the merge gets the
whole budget after it, as the pass did before it. The routers reach the engine's router units through
:class:`~resumerge.runs.moe.routers.RouterSources` of its run; the pass journals every layer and its routers in the
state dir (:mod:`.forward`), so a killed run continues it and a later run never reruns it.

May import: errors, memory, moe (not its transformers-using modules).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from resumerge.machine.memory import MemoryGovernor, Reservation
from resumerge.machine.memory.budget import SAFETY_MARGIN
from resumerge.machine.torch_import import torch
from resumerge.runs.moe import routers
from resumerge.runs.moe.passproc import PassProcess

# What the pass's process holds before its first layer (torch, transformers, the tokenizer, the model's modules
# built without weights), counted as the governor counts it: 300 MB measured (transformers 5.2, torch 2.13 on
# Linux). Its share beside the merge allows for two and a half times that, so another version's imports do not
# make the pass refuse its share while the merge runs.
PASS_PROCESS_BYTES = 768 * 1024 * 1024


def beside_share(budget: int, held: int, layer_bytes: int) -> int | None:
    """The pass's share of ``budget`` when it runs beside the merge (``held``: what the run's process holds now;
    ``layer_bytes``: the pass's largest layer), or None when the budget cannot give the merge as much as the pass
    beside it (then the pass runs first, with the budget less ``held``)."""
    share = int((PASS_PROCESS_BYTES + layer_bytes) / (1 - SAFETY_MARGIN))
    return share if budget - held >= 2 * share else None


class HiddenPass:
    """One run's forward pass ``key``: running in ``process`` (None: an earlier run finished it) into
    ``workdir``, holding ``share`` bytes of the run's budget beside the merge (None: the run waits for it); its
    routers are provided to the run's router units through ``provided``."""

    def __init__(self, key: str, workdir: Path, layers: int, provided: routers.RouterSources,
                 process: PassProcess | None = None, share: int | None = None) -> None:
        self.key, self.workdir, self.layers = key, workdir, layers
        self.process, self.share = process, share
        self._lock = threading.Lock()
        self._routers: torch.Tensor | None = None
        provided.provide(key, self.routers)

    def routers(self) -> torch.Tensor:
        """Every layer's routers ``(layers, gated experts, hidden)``, waiting for the pass when it runs."""
        with self._lock:
            if self._routers is None:
                if self.process is not None:
                    self.process.result()
                from safetensors.torch import load_file

                from resumerge.runs.moe.state import ROUTERS_NAME

                data = load_file(str(self.workdir / ROUTERS_NAME))
                self._routers = torch.stack([data[f"layers.{i}"] for i in range(self.layers)])
            return self._routers

    def degenerate_notes(self) -> tuple[str, ...]:
        """mergekit-moe's warning about routers that cannot tell the experts apart, when it applies (waits for
        the pass)."""
        note = routers.degenerate_note(routers.degenerate_layers(self.routers()), self.layers)
        return (note,) if note else ()

    # -- beside the merge (resumerge.merge.engine.session.Beside) -------------------------------------------------

    def hold(self, governor: MemoryGovernor) -> None:
        """Take the pass's share out of ``governor`` until its process ends."""
        if self.share is None or self.process is None or not self.process.running():
            return
        held = governor.acquire(min(self.share, governor.budget), what="the prompt forward pass")
        threading.Thread(target=self._release_at_end, args=(held,), name="resumerge-prompt-pass-share",
                         daemon=True).start()

    def _release_at_end(self, held: Reservation) -> None:
        assert self.process is not None
        self.process.wait()
        held.release()

    def notes(self) -> tuple[str, ...]:
        """What the pass found that the user must hear, once the merge's tensors are done (the plan was made
        before the pass ended)."""
        return self.degenerate_notes() if self.share is not None else ()

    def stop(self) -> None:
        """End the pass's process if it still runs (the run ended without its routers)."""
        if self.process is not None:
            self.process.stop()


def routers_job(mode: str, directory: Path, config: Mapping[str, Any],
                prompts: Sequence[tuple[Sequence[str], Sequence[str] | None]], tensors: Mapping[str, Any], *,
                share: int, held: int, threads: int | None, locks: Path) -> dict[str, Any]:
    """The pass's job for :mod:`.passmain`: the base's folder (its config.json, tokenizer and the ``tensors``'
    files) and its ``config`` as the run read it (a GGUF base's says how the codecs read its tensors); ``locks``:
    the folder of the passes' locks (:attr:`~resumerge.config.locations.StateDir.router_locks_dir`)."""
    return {"job": "routers", "mode": mode, "tokenizer_dir": str(directory), "prompts": [list(p) for p in prompts],
            "weights_dir": str(directory), "config": dict(config), "tensors": dict(tensors), "share": share,
            "parent_bytes": held, "threads": threads,
            "locks": str(locks)}

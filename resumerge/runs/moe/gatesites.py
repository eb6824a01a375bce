"""Where a run's hidden-state gate pass runs, as the run's executor places a forward pass
(:meth:`~resumerge.merge.engine.executors.PlacesPasses.place_pass`, :mod:`resumerge.config.passplace`):
:class:`StartsGates` starts it. :class:`InItsProcess`: the prompt work's own process on this machine, beside the merge
where the budget holds both (where the executor's site runs a pass in its own process:
:meth:`~resumerge.forward.placing.sites.PassSite.places` gives None); :class:`PlacedBy`: the base's layers where the
executor's site places them (an actor per model on a Ray cluster), this process driving the pass before the merge.
A new executor needs nothing here: its site says which.

May import: config, errors, forward (placement's protocol, lazily its driver), inputs, memory, moe (not its
transformers-using modules up front).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from resumerge.runs.moe.config import MoeConfig, prompt_texts
from resumerge.runs.moe.hiddenpass import PASS_PROCESS_BYTES, HiddenPass, beside_share, routers_job
from resumerge.runs.moe.passproc import PassProcess, start_child
from resumerge.runs.moe.routers import Encoded, RouterSources

if TYPE_CHECKING:
    from resumerge.config.settings import RunSettings
    from resumerge.forward.job.placement import Places
    from resumerge.inputs.model import ModelInput


@dataclass(frozen=True)
class GatesPass:
    """The gate pass a run needs: its ``config``, the base as the run opened it (``base``) and its folder of
    config, tokenizer and tensors (``folder``), the pass's content key and folder (``key``, ``workdir``), its
    decoder ``layers``, what its largest layer holds (``layer_bytes``), and where its routers are ``provided`` to
    the run's router units."""

    config: MoeConfig
    base: ModelInput
    folder: Path
    key: str
    workdir: Path
    layers: int
    layer_bytes: int
    provided: RouterSources


class StartsGates(Protocol):
    """Starts the gate pass where it runs: :meth:`start` it for a run under ``settings`` (``beside``: the caller hands
    the pass to the engine, which merges beside it; ``early``: the prompt work's process, started already)."""

    def start(self, gates: GatesPass, settings: RunSettings, *, beside: bool,
              early: PassProcess | None) -> HiddenPass: ...


@dataclass(frozen=True)
class InItsProcess:
    """The pass in the prompt work's own process on this machine (:mod:`.passmain`: this one never imports
    transformers), under a share of the run's budget: beside the merge where the budget holds both, else first,
    the merge waiting for its routers."""

    def start(self, gates: GatesPass, settings: RunSettings, *, beside: bool,
              early: PassProcess | None) -> HiddenPass:
        """The pass started; returned once it made plan's checks (beside: what plan refuses, run refuses before a
        weight), or once it ended (first)."""
        from resumerge.machine.memory import SystemProbe, default_budget

        probe = SystemProbe()
        probe.reclaim()
        held = probe.rss()
        budget = settings.max_memory if settings.max_memory is not None else default_budget(probe)
        tensors = {name: [t.file, t.entry.start, t.entry.end, t.entry.dtype, list(t.entry.shape)]
                   for name, t in gates.base.tensors.items()}
        config = gates.config
        share = beside_share(budget, held, gates.layer_bytes) if beside else None
        job = routers_job(config.gate_mode, gates.folder, gates.base.config, prompt_texts(config), tensors,
                          share=share if share is not None else max(0, budget - held), held=held,
                          threads=settings.num_threads, locks=settings.state.router_locks_dir)
        process = start_child(job, gates.workdir, early)
        running = HiddenPass(gates.key, gates.workdir, gates.layers, gates.provided, process, share)
        if share is None:
            running.routers()  # the merge waits for it
        else:  # the merge starts once the pass has made plan's checks
            process.checked()
        return running


@dataclass(frozen=True)
class PlacedBy:
    """The base's layers where ``places`` puts them (the run's executor: an actor on a Ray node, which reads the
    base and imports transformers), driven from this process before the merge starts (its routers then travel
    with the run's resources): the prompts tokenised in the prompt work's process (``early``, else a new one),
    the base opened from its folder as the run read it, its part of the pass declared as one layer, the prompt
    sets' hidden states five times over and the process the local pass would start
    (:data:`~resumerge.runs.moe.hiddenpass.PASS_PROCESS_BYTES`: the node imports transformers)."""

    places: Places

    def start(self, gates: GatesPass, settings: RunSettings, *, beside: bool,
              early: PassProcess | None) -> HiddenPass:
        """The pass driven to its end (:func:`~resumerge.runs.moe.forward.placed_routers`)."""
        from resumerge.forward.opening.opened import PassModel
        from resumerge.runs.moe.forward import placed_routers

        config, base = gates.config, gates.base
        job = {"job": "encode", "mode": config.gate_mode, "tokenizer_dir": str(gates.folder),
               "prompts": prompt_texts(config)}
        answer = start_child(job, gates.workdir, early).result()
        sets = tuple((frozen(p), frozen(n) if n is not None else None) for p, n in answer["encoded"])
        width = int(base.config.get("hidden_size", 0))
        states = sum(len(ids) * len(ids[0]) for pair in sets for ids, _ in (s for s in pair if s is not None)) * width
        opened = PassModel(role="base", path=str(gates.folder), weight=None,
                           opened=replace(base, directory=gates.folder))
        placed_routers(self.places, opened, gates.layers, PASS_PROCESS_BYTES + gates.layer_bytes + 5 * 4 * states,
                       config.gate_mode, sets, gates.workdir, locks=settings.state.router_locks_dir)
        return HiddenPass(gates.key, gates.workdir, gates.layers, gates.provided)


IN_ITS_PROCESS = InItsProcess()


@dataclass(frozen=True)
class Starting:
    """How a run starts its gates' pass: where (``site``, as the run's executor places a forward pass), beside the
    merge where the budget holds both (``beside``: the caller hands the pass to the engine and stops it when the run
    ends; else it is finished first), and in the process the caller started already (``early``:
    :func:`~resumerge.runs.moe.passproc.started_early`)."""

    site: StartsGates = IN_ITS_PROCESS
    beside: bool = False
    early: PassProcess | None = None


def frozen(encoded: Any) -> Encoded:
    """A prompt set's (ids, mask) as the prompt work's process answered it (JSON lists), as tuples of ints."""
    ids, mask = encoded
    return (tuple(tuple(int(i) for i in row) for row in ids), tuple(tuple(int(m) for m in row) for row in mask))

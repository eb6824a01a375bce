"""Where an evaluation's passes run their decoder layers, as the executor placed them
(:mod:`resumerge.forward.placing.sites`): :class:`EvalLayers` asks the pass's site, whichever it is, to place the pass
(this process, one layer at a time, each admitted by the pass's reserve; or an actor on a node of the Ray cluster, the
head here). What an evaluation cannot do with its layers away from this process (a merge never written, merged in this
process as its layers are read; a generation task, which holds the whole model here) is the site's refusal."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from resumerge.config.passplace import HERE, PassPlace
from resumerge.forward.job.placement import Placement
from resumerge.forward.placing.sites import PassSite, Told, site_of

if TYPE_CHECKING:
    from resumerge.analyses.evaluation.scorer import Places
    from resumerge.config.locations import StateDir
    from resumerge.forward.compared.needs import StepBytes
    from resumerge.forward.engine.stream import ModelStream
    from resumerge.forward.job.layerpass import Reserve
    from resumerge.forward.opening.opened import PassModel


@dataclass(frozen=True)
class EvalLayers:
    """Where an evaluation's passes run their decoder layers: its ``site``."""

    site: PassSite

    @property
    def here(self) -> bool:
        """Whether this process holds the layers (else only the head: what the budget judges)."""
        return self.site.here

    def refuse_unwritten(self) -> None:
        """Raise :class:`~resumerge.errors.UsageError` (exit 2), before any weight is read, where a merge never
        written cannot be evaluated so (it is merged in this process as its layers are read)."""
        self.site.refuse_away("eval", "reads a written model on a Ray node; a merge config is merged in this "
                              "process as its layers are read",
                              hint="leave out --executor ray, or evaluate the written merge")

    def refuse_generating(self, generating: list[str]) -> None:
        """Raise :class:`~resumerge.errors.UsageError` (exit 2), before any weight is read, where the generation
        tasks ``generating`` (named) cannot run so: a generation (held whole or layer-streamed, :mod:`.streamgen`)
        runs its layers in this process, against a KV cache kept here between token steps, which the Ray actors
        the log-likelihood passes use (one forward per layer, hidden states handed back) have no place for."""
        if generating:
            self.site.refuse_away("eval", f"places the log-likelihood passes; the generation task(s) "
                                  f"{', '.join(generating)} run every layer in this process (each token step's "
                                  "layers read here against the KV cache kept here; no Ray actor holds a cache)",
                                  hint="leave out --executor ray for them (--device cuda runs their layers on this "
                                       "machine's GPU)")

    def places(self, model: PassModel, stream: ModelStream, sizes: StepBytes, state: StateDir) -> Places:
        """Where a pass over ``model`` (its modules ``stream``, its steps' ``sizes``) runs its layers, placed now
        (refused, exit 2, where nothing can hold them), before any weight is read."""

        def needs() -> list[int]:
            from resumerge.forward.placing.rayactor import actor_bytes

            return actor_bytes(sizes)[:1]

        seats = self.site.seat(needs, "evaluation", state)

        def placed(reserve: Reserve, told: Callable[[int], None]) -> AbstractContextManager[Placement]:
            return seats.models([replace(model, role="model")], [stream],
                                Told(model=lambda layer, m: told(layer), layer=lambda layer, nodes: told(layer)),
                                reserve=reserve)

        return placed


class LayersHere(EvalLayers):
    """The layers in this process, whatever the executor (a text task's, a parent beside the model)."""

    def __init__(self) -> None:
        super().__init__(site_of(HERE))


def eval_layers(placement: PassPlace) -> EvalLayers:
    """Where ``placement`` runs an evaluation's decoder layers."""
    return EvalLayers(site_of(placement))

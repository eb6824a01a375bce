"""Where an evaluation's passes run their decoder layers, as the executor placed them
(:mod:`resumerge.config.passplace`): :class:`LayersHere` (this process, one layer at a time, each admitted by the
pass's reserve) for :class:`~resumerge.config.passplace.Here`, :class:`LayersOnRay` (an actor on a node of the Ray
cluster, the head here) for :class:`~resumerge.config.passplace.OnRay`. What an evaluation cannot do with its layers
on a node (a merge never written, merged in this process as its layers are read; a generation task, which holds the
whole model here) is the placement's refusal. Another executor is another class in :data:`_PLACED`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from resumerge.config.passplace import Here, OnRay, PassPlacement
from resumerge.errors import UsageError
from resumerge.forward.placement import Placement, Streams

if TYPE_CHECKING:
    from resumerge.analyses.evaluation.scorer import Places
    from resumerge.config.locations import StateDir
    from resumerge.forward.layerpass import Reserve
    from resumerge.forward.needs import StepBytes
    from resumerge.forward.opened import PassModel
    from resumerge.forward.stream import ModelStream


class EvalLayers(Protocol):
    """Where an evaluation's passes run their decoder layers."""

    @property
    def here(self) -> bool:
        """Whether this process holds the layers (else only the head: what the budget judges)."""

    def refuse_unwritten(self) -> None:
        """Raise :class:`~resumerge.errors.UsageError` (exit 2), before any weight is read, where a merge never
        written cannot be evaluated so."""

    def refuse_generating(self, generating: list[str]) -> None:
        """Raise :class:`~resumerge.errors.UsageError` (exit 2), before any weight is read, where the generation
        tasks ``generating`` (named) cannot run so."""

    def places(self, model: PassModel, stream: ModelStream, sizes: StepBytes, state: StateDir) -> Places:
        """Where a pass over ``model`` (its modules ``stream``, its steps' ``sizes``) runs its layers, placed now
        (refused, exit 2, where nothing can hold them), before any weight is read."""


@dataclass(frozen=True)
class LayersHere:
    """The layers in this process, one at a time, each admitted by the pass's reserve."""

    here: bool = True

    def refuse_unwritten(self) -> None:
        """Nothing refused: this process merges a merge's tensors as its layers are read."""

    def refuse_generating(self, generating: list[str]) -> None:
        """Nothing refused: this process holds a generation's whole model (where it fits)."""

    def places(self, model: PassModel, stream: ModelStream, sizes: StepBytes, state: StateDir) -> Places:
        def placed(reserve: Reserve, told: Callable[[int], None]) -> AbstractContextManager[Placement]:
            return nullcontext(Streams([stream], on_model=lambda layer, m: told(layer), reserve=reserve))

        return placed


@dataclass(frozen=True)
class LayersOnRay:
    """The layers on an actor of the Ray cluster ``ray`` names (its kept workers' idle time ``ray.keep``,
    :func:`~resumerge.forward.onray.kept_hosts`), the head here: the same answers, journaled alike."""

    ray: OnRay
    here: bool = False

    def refuse_unwritten(self) -> None:
        """Refused: a merge never written is merged in this process as its layers are read."""
        raise UsageError("eval --executor ray reads a written model on a Ray node; a merge config is merged in "
                         "this process as its layers are read", hint="leave out --executor ray, or evaluate the "
                                                                      "written merge")

    def refuse_generating(self, generating: list[str]) -> None:
        """Generation tasks refused: they hold the whole model in this process."""
        if generating:
            raise UsageError(f"eval --executor ray places the log-likelihood passes; the generation task(s) "
                             f"{', '.join(generating)} hold the whole model in this process",
                             hint="leave out --executor ray for them")

    def places(self, model: PassModel, stream: ModelStream, sizes: StepBytes, state: StateDir) -> Places:
        """The cluster joined and the pass's actor placed (refused, exit 2, where no node holds it)."""
        from resumerge.forward.onray import ray_places
        from resumerge.forward.rayactor import ActorTerms, actor_bytes, ray_models

        where = ray_places(self.ray.address, actor_bytes(sizes)[:1], what="evaluation")
        given = None if state.given is None else str(state.root)  # --state-dir, as a node opens it

        def placed(reserve: Reserve, told: Callable[[int], None]) -> AbstractContextManager[Placement]:
            return ray_models([replace(model, role="model")], where, stream.layers,
                              lambda layer, nodes: told(layer), terms=ActorTerms(given, keep=self.ray.keep))

        return placed


def _on_ray(placement: PassPlacement) -> EvalLayers:
    assert isinstance(placement, OnRay)
    return LayersOnRay(placement)


def _here(placement: PassPlacement) -> EvalLayers:
    return LayersHere()


# Each executor's placement, as an evaluation's passes run their layers.
_PLACED: Mapping[type, Callable[[PassPlacement], EvalLayers]] = MappingProxyType({Here: _here, OnRay: _on_ray})


def eval_layers(placement: PassPlacement) -> EvalLayers:
    """Where ``placement`` runs an evaluation's decoder layers (refused, exit 2, for an executor that places no
    evaluation)."""
    found = _PLACED.get(type(placement))
    if found is None:
        raise UsageError(f"eval cannot place its passes with the {placement.name} executor",
                         hint="use --executor local or ray")
    return found(placement)

"""Where an executor places a forward pass (``check``, ``measure``, ``eval``, ``evolve``'s generations, the MoE
gates): :meth:`~resumerge.merge.engine.executors.PlacesPasses.place_pass` gives a placement, one small frozen value per
executor, and the refusals of a pass the executor cannot place as asked are the placement's own
(:meth:`PassPlacement.refuse`). :class:`Here`: every model in this process, one after another (the local executor,
and the default); :class:`OnRay`: an actor per model on a Ray cluster. A third executor is one more such class, and
one more method of :class:`Kinds`: what runs a pass so lives in the forward engine
(:func:`resumerge.forward.sites.site_of`), which this package may not import, so each placement names its own kind
(:meth:`PassPlacement.made`) rather than a layer above asking which class it is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

from resumerge.errors import UsageError

_T_co = TypeVar("_T_co", covariant=True)


class Kinds(Protocol[_T_co]):
    """What a layer above makes of each placement, one method a placement class (:meth:`PassPlacement.made`)."""

    def here(self, placement: Here) -> _T_co: ...

    def on_ray(self, placement: OnRay) -> _T_co: ...


class PassPlacement(Protocol):
    """Where a forward pass's models run. ``name`` names it in messages (``local``, ``ray``)."""

    @property
    def name(self) -> str: ...

    def refuse(self, what: str, device: str, on_gpu: bool) -> None:
        """Raise :class:`~resumerge.errors.UsageError` (exit 2), before anything is read, where ``what`` (the pass
        in words: ``the check``) cannot be placed so with its layers on ``device`` (``on_gpu``: a GPU of this
        machine)."""

    def made(self, kinds: Kinds[_T_co]) -> _T_co:
        """What ``kinds`` makes of this placement (its own method of it)."""


@dataclass(frozen=True)
class Here:
    """Every model of the pass in this process, one layer of one model at a time."""

    name: ClassVar[str] = "local"

    def refuse(self, what: str, device: str, on_gpu: bool) -> None:
        """Nothing to refuse: this process runs the layers wherever the device is."""

    def made(self, kinds: Kinds[_T_co]) -> _T_co:
        return kinds.here(self)


@dataclass(frozen=True)
class OnRay:
    """An actor per model on the Ray cluster at ``address`` (None: ``RAY_ADDRESS``, else a Ray started here), hosted
    by the nodes' kept workers that wait idle ``keep`` seconds once the pass ends (0: fresh actors, ended with
    it); ``stream``: the class, by name (``"module:Class"``), a kept worker made for the pass computes a later
    merge's shards with, as the executor names it (empty: no kept worker, fresh actors)."""

    address: str | None = None
    keep: float = 0.0
    stream: str = ""
    name: ClassVar[str] = "ray"

    def refuse(self, what: str, device: str, on_gpu: bool) -> None:
        """A GPU of this machine refused: the layers run on the cluster's nodes."""
        if on_gpu:
            raise UsageError(f"--device {device} runs {what}'s layers on this machine's GPU, and --executor ray runs "
                             "each model on a node of the cluster", hint="leave out one of the two")

    def made(self, kinds: Kinds[_T_co]) -> _T_co:
        return kinds.on_ray(self)


HERE = Here()

"""Where the run's executor places a forward pass, as the pass asks it (``check``, ``measure``, ``eval``,
``evolve``, the MoE gates): a :class:`PassSite`, the class the executor's row of
:data:`~resumerge.config.passplace.EXECUTORS` names, made from the :class:`~resumerge.config.passplace.PassPlace` the
executor gave (:func:`site_of`; :mod:`resumerge.config.passplace` may not import this engine). :class:`InProcess`
(``local``, and any executor whose passes run in this process): every model in this process, one layer of one model
at a time (:class:`~resumerge.forward.job.placement.Streams`); :class:`OnCluster` (``ray``): an actor per model on a Ray
cluster (:mod:`resumerge.forward.placing.rayactor`). A pass asks its site what differs between executors (a refusal,
how its hub reads bind, where its models' actors go, the :class:`~resumerge.forward.job.placement.Placement` of its
models, the words that name it in a command) and never which it is: a new executor's passes are its row, naming one
of these sites, or a class here where they run another way.

A site is asked in two steps, as a pass is judged then run: :meth:`PassSite.seat` before any weight is read (on a
cluster: joined, each model's actor placed, refused where it cannot hold them), giving :class:`Seats`; then
:meth:`Seats.models`, the models' placement for the pass's loop, ended with the block. A pass that runs each model as a
placement of its own, each at its own layer (``measure``'s, whose actors record each layer's Grams with a
:class:`~resumerge.forward.job.placement.NodeWatch`), runs them with :meth:`Seats.each` (here one after another, on a
cluster side by side) and is judged by what :meth:`Seats.held` says this process holds of them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from resumerge.config import passplace
from resumerge.config.passplace import HERE, PassPlace
from resumerge.errors import UsageError
from resumerge.forward.job.layerpass import Reserve, unreserved

if TYPE_CHECKING:
    from resumerge.config.locations import StateDir
    from resumerge.forward.compared.passes import Fold, PassModels
    from resumerge.forward.engine.stream import ModelStream
    from resumerge.forward.job.placement import NodeWatch, Placement, Places
    from resumerge.forward.opening.hubreads import PassReads
    from resumerge.forward.opening.opened import PassModel
    from resumerge.forward.placing.onray import Place, Read
    from resumerge.forward.text.vocabs import SharedVocab

_T = TypeVar("_T")


@dataclass(frozen=True)
class Told:
    """What a pass is told as its placed models run, each placement telling what it knows: ``model(layer, m)``
    before model ``m``'s layer is read in this process; ``layer(layer, nodes)`` before each layer run on nodes,
    with the node each model runs on; ``reads(m, found)``: the ranges of its hub files model ``m``'s node read, as
    (file, start, end, sha256), for the pass's journal (None: not asked of the nodes)."""

    model: Callable[[int, int], None] | None = None
    layer: Callable[[int, list[str]], None] | None = None
    reads: Callable[[int, list[Read]], None] | None = None


@dataclass(frozen=True)
class EachModel:
    """A pass that runs each of its ``models`` as a placement of its own, each at its own layer with its own journal
    (``measure``'s, :meth:`Seats.each`): ``layers[m]`` decoder layers each, ``watches[m]`` recording model ``m``'s
    layers where they run, ``here(m)`` model ``m``'s placement in this process (opened and closed in turn),
    ``what`` the pass as its refusals name it, ``reads(m, found)`` told what model ``m``'s node read of its hub
    files (as :class:`Told`'s ``reads``)."""

    models: Sequence[PassModel]
    layers: Sequence[int]
    watches: Sequence[NodeWatch]
    here: Callable[[int], AbstractContextManager[Placement]]
    what: str
    reads: Callable[[int, list[Read]], None] | None = None


@dataclass(frozen=True)
class Held:
    """What this process holds of a pass run by :meth:`Seats.each` at its largest: ``bytes``, judged against the
    budget; ``named``, what that is as the pass's refusal names it (the largest model's pass; ``on Ray``: every
    model's hidden states at once, their layers run on the nodes); what one ``step`` reserves of the RAM governor;
    the hidden ``states`` a GPU of this machine keeps between layers."""

    bytes: int
    named: str
    step: int
    states: int


class Seats(Protocol):
    """Where a pass's models were placed (:meth:`PassSite.seat`), before any weight was read."""

    def models(self, models: Sequence[PassModel], streams: Sequence[ModelStream], told: Told, *,
               reserve: Reserve = unreserved, workdir: Path | None = None, fold: Fold | None = None,
               vocab: SharedVocab | None = None) -> AbstractContextManager[PassModels]:
        """The placement of ``models`` (their modules ``streams``, built here) for the pass's loop, ended with the
        block: each layer admitted by ``reserve`` where it is read here; ``workdir`` where the heads keep their
        log-probabilities; ``fold``: the static figures taken from the layers' reads (only where they are read
        here); ``vocab``: how the models' vocabularies meet, where they differ."""

    def held(self, names: Sequence[str], peaks: Sequence[int], steps: Sequence[int]) -> Held:
        """What this process holds of a pass run by :meth:`each` at its largest, from each model's ``peaks`` (its
        pass's largest step with its hidden states) and the part of it one step (its layer) reserves (``steps``);
        ``names``: each model as a refusal names it."""

    def each(self, pass_: EachModel, run: Callable[[int, Placement], _T]) -> list[_T]:
        """``run(m, placement)`` for each model of ``pass_``, on a placement of that model alone; the results in
        the models' order."""


class PassSite(Protocol):
    """Where the executor places a pass's models, as its ``placement`` says; ``name`` names it in messages and
    commands (``local``, ``ray``: the executor's)."""

    @property
    def placement(self) -> PassPlace: ...

    @property
    def name(self) -> str: ...

    @property
    def here(self) -> bool:
        """Whether this process reads and runs the models' layers (else only their hidden states are held here:
        what the pass's budget judges)."""

    def refuse(self, what: str, device: str, on_gpu: bool) -> None:
        """Raise :class:`~resumerge.errors.UsageError` (exit 2), before anything is read, where ``what`` (the pass
        in words: ``the check``) cannot be placed so with its layers on ``device`` (``on_gpu``: a GPU of this
        machine)."""

    def words(self) -> list[str]:
        """The flags that place a pass so in a command that continues it (none: this process)."""

    def available(self) -> None:
        """Raise :class:`~resumerge.errors.UsageError` (exit 2), before anything is read, where what places the
        models is not installed."""

    def refuse_away(self, what: str, why: str, hint: str) -> None:
        """Raise :class:`~resumerge.errors.UsageError` (exit 2) where the models' layers run away from this process
        and ``what`` (the command) needs them here: ``"{what} --executor {name} {why}"``, with ``hint``."""

    def bind(self, reads: PassReads, models: Sequence[PassModel], fresh: bool) -> list[PassModel]:
        """``models`` bound to the pass's hub reads (:meth:`~resumerge.forward.opening.hubreads.PassReads.bind`): what
        this process reads twice kept for the second read, where it runs the layers itself."""

    def seat(self, needs: Callable[[], Sequence[int]], what: str, state: StateDir) -> Seats:
        """The pass's models placed before any weight is read (``needs()``: the memory each model's actor
        declares; ``what``: the pass, as refusals name it; ``state``: the state dir the pass runs under), refused
        (exit 2) where they cannot be."""

    def places(self, state: str | None, what: str) -> Places | None:
        """Where a pass that does not learn where it runs (the MoE hidden-state gates') places its models, asked
        as it starts (``state``: the state dir given with ``--state-dir``; ``what``: the pass, as refusals name it);
        None: in the pass's own process."""


class _Named:
    """What every site takes from its executor's ``placement``: the executor's name, and the words of a command that
    places a pass so."""

    placement: PassPlace

    @property
    def name(self) -> str:
        return self.placement.name

    def words(self) -> list[str]:  # no address: the cluster RAY_ADDRESS names, or one started here
        if self.placement.name == HERE.name:  # the default: no flag
            return []
        address = self.placement.address
        return ["--executor", self.name, *(["--ray-address", address] if address else [])]


@dataclass(frozen=True)
class InProcess(_Named):
    """Every model of the pass in this process, one layer of one model at a time."""

    placement: PassPlace
    here: bool = True

    def refuse(self, what: str, device: str, on_gpu: bool) -> None:
        """Nothing to refuse: this process runs the layers wherever the device is."""

    def available(self) -> None:
        """Nothing to install."""

    def refuse_away(self, what: str, why: str, hint: str) -> None:
        """Nothing refused: the layers run here."""

    def bind(self, reads: PassReads, models: Sequence[PassModel], fresh: bool) -> list[PassModel]:
        return reads.bind(models, fresh=fresh, again=True)

    def seat(self, needs: Callable[[], Sequence[int]], what: str, state: StateDir) -> Seats:
        return _HereSeats()

    def places(self, state: str | None, what: str) -> Places | None:
        return None


@dataclass(frozen=True)
class _HereSeats:
    """The models in this process: nothing placed ahead."""

    def models(self, models: Sequence[PassModel], streams: Sequence[ModelStream], told: Told, *,
               reserve: Reserve = unreserved, workdir: Path | None = None, fold: Fold | None = None,
               vocab: SharedVocab | None = None) -> AbstractContextManager[PassModels]:
        from resumerge.forward.compared.passes import LocalModels

        return nullcontext(LocalModels(streams, workdir, told.model, reserve, fold, vocab))

    def held(self, names: Sequence[str], peaks: Sequence[int], steps: Sequence[int]) -> Held:
        """The largest model's pass: the models run one after another, each layer read and run here."""
        largest = max(range(len(peaks)), key=lambda m: peaks[m])
        return Held(peaks[largest], names[largest], max(steps), max(p - s for p, s in zip(peaks, steps)))

    def each(self, pass_: EachModel, run: Callable[[int, Placement], _T]) -> list[_T]:
        """One model after another, each placement opened and closed in turn."""
        found = []
        for m in range(len(pass_.models)):
            with pass_.here(m) as placement:
                found.append(run(m, placement))
        return found


@dataclass(frozen=True)
class OnCluster(_Named):
    """An actor per model on the Ray cluster ``placement`` names (:mod:`resumerge.forward.placing.rayactor`); this
    process holds every model's hidden states and journals the pass as it does here, so a pass started on one resumes on
    the other with the same bytes."""

    placement: PassPlace
    here: bool = False

    def refuse(self, what: str, device: str, on_gpu: bool) -> None:
        """A GPU of this machine refused: the layers run on the cluster's nodes."""
        if on_gpu:
            raise UsageError(f"--device {device} runs {what}'s layers on this machine's GPU, and --executor ray runs "
                             "each model on a node of the cluster", hint="leave out one of the two")

    def places(self, state: str | None, what: str) -> Places | None:
        from resumerge.forward.placing.rayactor import placing

        return placing(self.placement.address, state, what)

    def available(self) -> None:
        from resumerge.machine.rayconnect import check_ray

        check_ray()

    def refuse_away(self, what: str, why: str, hint: str) -> None:
        raise UsageError(f"{what} --executor {self.name} {why}", hint=hint)

    def bind(self, reads: PassReads, models: Sequence[PassModel], fresh: bool) -> list[PassModel]:
        # the nodes run the layers: this process reads each byte once, for its file's proof, and keeps none
        return reads.bind(models, fresh=fresh, again=False)

    def seat(self, needs: Callable[[], Sequence[int]], what: str, state: StateDir) -> Seats:
        from resumerge.forward.placing.onray import ray_places

        placed = ray_places(self.placement.address, needs(), what=what)
        given = None if state.given is None else str(state.root)  # --state-dir, as a node opens a model under it
        return _NodeSeats(placed, given, self.placement.keep, self.placement.stream)


@dataclass(frozen=True)
class _NodeSeats:
    """Each model's actor placed on its node (``placed``), hosted as :class:`~resumerge.config.passplace.PassPlace`'s
    ``keep`` and ``stream`` say."""

    placed: Sequence[Place]
    state: str | None
    keep: float
    stream: str

    def models(self, models: Sequence[PassModel], streams: Sequence[ModelStream], told: Told, *,
               reserve: Reserve = unreserved, workdir: Path | None = None, fold: Fold | None = None,
               vocab: SharedVocab | None = None) -> AbstractContextManager[PassModels]:
        from resumerge.forward.placing.rayactor import ActorTerms, ray_models

        return ray_models(models, list(self.placed), streams[0].layers, told.layer, told.reads, vocab,
                          ActorTerms(self.state, keep=self.keep, stream=self.stream))

    def held(self, names: Sequence[str], peaks: Sequence[int], steps: Sequence[int]) -> Held:
        """Every model's hidden states in and out at once (the passes run side by side), no layer: those run on
        the nodes."""
        return Held(sum(p - s for p, s in zip(peaks, steps)), "on Ray", 0, 0)

    def each(self, pass_: EachModel, run: Callable[[int, Placement], _T]) -> list[_T]:
        """Each model on its actor (:func:`~resumerge.forward.placing.rayactor.ray_each`, recording with its watch), the
        models side by side, a thread of this process driving each (the layers compute on the nodes); the first
        error raised once every thread ended."""
        from resumerge.forward.placing.rayactor import ActorTerms, ray_each

        terms = [ActorTerms(self.state, what=pass_.what, keep=self.keep, stream=self.stream,
                             watch=watch) for watch in pass_.watches]
        with ray_each(pass_.models, self.placed, pass_.layers, pass_.reads, terms) as placements, \
                ThreadPoolExecutor(max_workers=len(placements), thread_name_prefix=pass_.what) as pool:
            futures = [pool.submit(run, m, placement) for m, placement in enumerate(placements)]
            return [future.result() for future in futures]


def site_of(placement: PassPlace) -> PassSite:
    """Where ``placement`` runs a pass's models, as the pass asks it: the site its executor's row names
    (:data:`~resumerge.config.passplace.EXECUTORS`)."""
    site: PassSite = passplace.named(passplace.EXECUTORS[placement.name].site)(placement)
    return site

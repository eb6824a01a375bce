"""A check's forward pass on a Ray cluster (``--executor ray``): each model's pass on a node of its own, so a check of
a giant merge against its parents takes about the time of one model's pass.

The models are independent until the comparison: an actor per model
(:class:`~resumerge.forward.placing.modelnode.ModelNode`, made on its node as every pass's object is:
:func:`~resumerge.forward.placing.onray.on_place`), placed one per node where the cluster has the nodes (models shared
round-robin where it has fewer), opens its model from its path (which every node
must see, as for a merge on Ray; a hub model is read by range from the node, with the node's own token, under the node's
name: :func:`~resumerge.forward.placing.onray.on_node`, the sha256 of each range it read held to the driver's journal
after each step, as a merge's nodes' reads are: :mod:`resumerge.forward.opening.hubreads`) and computes with the pass's
thread count (:mod:`~resumerge.forward.job.threads`: the one its driver recorded and computes with; the CPUs the actor
declares are what Ray reserves for it, not what it computes with), so a pass started on a cluster resumes on another, or
here, with the same bits. The merge's actor keeps the first layer it reads to learn whether the family takes padded
batches for the pass's first layer, so an actor reads each byte of its model once (a tied head's embeddings, and a
family that runs one sequence at a time, aside); the driver reads every model once more, for the static figures (which
compare the models' tensors with each other) and each hub file's proof: every tensor, those no figure compares too (the
tables of a merge of another vocabulary), so that each file is read whole there and checked against the hub's checksum,
as in a local check (:func:`~resumerge.analyses.check.static.static_pass`'s ``whole``). The driver (this process) holds
every model's hidden states, as a local check does: per layer it sends the reference's input to the layer (the base's,
else the first parent's) to every actor at once (one object in Ray's store), each actor runs its layer on its own hidden
states (it keeps its last output) and on that input, and returns both; the driver computes the layer's figures with the
local pass's own functions and journals it exactly as a local check does
(:func:`~resumerge.forward.compared.passes.run_pass` drives both), so a check started on Ray resumes locally, and the
other way round. The heads too: the merge's and the base's actors return their log-probabilities as objects in Ray's
store (never fetched by the driver), each other actor compares its own with them and returns its per-position figures.

Each actor holds one layer of its model and its hidden states, and declares that memory to Ray (:func:`actor_bytes`,
from the figures the local check's budget is found from), so that Ray places no more on a node than it holds; a
cluster none of whose nodes holds one (or that cannot hold them all at once) is refused before any weight is read
(exit 2). A node lost mid-pass costs only its models' part of the step it was in: each gets a new actor on a node
left with room for it, as a merge's Ray executor gives a lost worker's shards to the workers left (the pass
journaled so far stays; :class:`RayModels`); where no node has room, the check ends as unreachable (exit 3), and run
again it resumes at the layer journaled last. Ray is joined through :mod:`resumerge.machine.rayconnect` (the
merge executor's own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from resumerge.errors import UnreachableError
from resumerge.forward.compared.heads import HeadTotals
from resumerge.forward.compared.needs import StepBytes
from resumerge.forward.compared.passes import ModelHead, totals
from resumerge.forward.engine import handed
from resumerge.forward.job.placement import NodeWatch, Placement, Places
from resumerge.forward.opening.opened import PassModel
from resumerge.forward.placing.modelnode import ModelNode
from resumerge.forward.placing.onray import (
    Lost,
    Place,
    Read,
    cpus_of,
    driver_token,
    end_actors,
    got,
    kept_hosts,
    on_place,
    sent,
)
from resumerge.forward.text.vocabs import SharedVocab, own_batches
from resumerge.machine.memory.sizes import format_size
from resumerge.machine.torch_import import IMPORT_RESERVE, torch

if TYPE_CHECKING:  # torch loads on first use (the annotations are strings)
    Hidden = list[torch.Tensor]
Batches = Sequence[Sequence[Sequence[int]]]

# The times a check replaces the actors of lost nodes before it stops (exit 3): a merge's Ray executor re-issues a
# lost worker's shard as often (resumerge.merge.engine.cluster.driver.REISSUES).
REPLACES = 3
# How long a replacement actor may take to start (be scheduled, import torch, open its model) before the check stops.
PLACE_SECONDS = 120.0


def _resume_hint(what: str) -> str:
    return f"check the cluster's nodes, then run the {what} again: it resumes at the last layer journaled"


def actor_bytes(sizes: StepBytes) -> list[int]:
    """The memory each model's actor declares (the merge's first), from the figures the local check's budget is
    found from (:mod:`resumerge.forward.compared.needs`): torch's imports
    (:data:`~resumerge.machine.torch_import.IMPORT_RESERVE`, as a merge's Ray workers declare), its hidden states five
    times (entering the first layer, kept with the layers' calls; its own and the reference's, each in and out) and the
    larger of one layer of its model in float32 and its heads step (its log-probabilities and the merge's and the base's
    held whole)."""
    return [IMPORT_RESERVE + 5 * sizes.states + max(layer, heads)
            for layer, heads in zip(sizes.layers, sizes.held_heads)]


@dataclass(frozen=True)
class ActorTerms:
    """How the pass's actors are made: ``state``, the state dir a node opens a model under (``--state-dir``; None:
    the default); ``dtype`` and ``what`` (the pass, as its refusals name it): see :class:`ModelNode`; ``beside``:
    beside a run's workers (see :class:`RayModels`); ``keep``: the seconds a node's kept worker that hosts an
    actor waits idle for the next run or pass (0: fresh actors, ended with the pass), and ``stream`` the class, by
    name, one made for the pass computes a merge's shards with (:class:`~resumerge.config.passplace.PassPlace`);
    ``watch``: what each actor computes of its model's layers on its node
    (:class:`~resumerge.forward.job.placement.NodeWatch`; this one is told what they found); ``threads``: the thread
    count the actors compute with, the pass's (None: the one the thread making them computes with, which under a pass's
    driver is the count recorded in its folder:
    :func:`~resumerge.forward.job.threads.pass_threads`)."""

    state: str | None = None
    dtype: torch.dtype | None = None
    what: str = "check"
    beside: bool = False
    keep: float = 0.0
    stream: str = ""
    watch: NodeWatch | None = None
    threads: int | None = None


CHECK_ACTORS = ActorTerms()


class RayModels:
    """The pass's models on a Ray cluster (see the module's docstring); ``on_layer(index, nodes)`` is told before
    each layer, with the node each model runs on.

    A model whose actor is lost (its process or node died) gets a new one on a node not lost that has the CPUs and
    memory the lost one declared free (of the check's own actors' holdings), computing with the pass's count as
    every actor does (the same figures); the step goes on there, from the hidden states the driver holds: only the
    lost models' part of a layer is run again, the heads step whole. At most :data:`REPLACES` times a check; past
    that, or with no node left to take a model, :class:`~resumerge.errors.UnreachableError` (exit 3): the check run
    again resumes at the last layer journaled. ``terms``: how the actors are made (:class:`ActorTerms`); with
    ``beside`` the actors compute beside a run's workers, which hold the nodes' CPUs while they wait for the run's
    plan, which waits for this pass (the MoE gates'): each declares no CPU (else none could start) and
    computes with the pass's count all the same, and declares its memory."""

    def __init__(self, ray: Any, models: Sequence[PassModel], placed: list[Place], layers: int,
                 on_layer: Callable[[int, list[str]], None] | None = None,
                 on_reads: Callable[[int, list[Read]], None] | None = None, vocab: SharedVocab | None = None,
                 terms: ActorTerms = CHECK_ACTORS) -> None:
        self.ray, self.models, self.places, self.layers, self.on_layer = ray, models, placed, layers, on_layer
        state, dtype, what, beside = terms.state, terms.dtype, terms.what, terms.beside
        self.keep = 0.0 if beside else terms.keep  # beside a run's workers (which hold the nodes' CPUs): fresh actors
        self.stream = terms.stream
        self.state = state  # the state dir a node opens a model under (--state-dir; None: the default)
        self.vocab = vocab  # where the models' vocabularies differ: each reads its own ids, compared over the shared
        # asked of the actors after each step only where a model is read from the hub: a round trip per layer
        self.on_reads = on_reads if any(m.remote for m in models) else None
        # The pass's count, which its driver recorded and computes with (the driving thread's, as the actors are
        # made), never the CPUs an actor declares: a pass resumed on another cluster, or here, computes alike.
        count = terms.threads if terms.threads is not None else torch.get_num_threads()
        self.threads = [max(1, count) for _ in placed]
        if beside:
            self.places = [replace(place, cpus=0.0) for place in placed]
        self.actors: list[Any] = []
        self.hosts: list[Any] = []  # the kept workers hosting actors (:mod:`resumerge.machine.cluster.hosting`)
        self.nodes: list[str] = []
        self.lost: set[str] = set()  # nodes whose actor died: none is placed there again
        self.fresh: set[int] = set()  # models whose actor is a replacement holding no hidden states yet
        self.replaced = 0
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.handed: list[dict[str, torch.Tensor]] = [{} for _ in models]  # what each model's layers hand on
        # per model, the layers whose input its forward computes from earlier outputs (its actor's :meth:`enter`)
        self.computed: list[frozenset[int]] = [frozenset() for _ in models]
        self.seeded = False
        self.token = False  # whether the driver reads the hub models with a token (then their nodes need theirs)
        self.dtype, self.what, self.hint = dtype, what, _resume_hint(what)
        self.watch = terms.watch

    def start(self) -> None:
        """Start every model's actor, and wait for each to open its model (raises the error that kept one from it,
        and :class:`UnreachableError` where one's node was lost meanwhile)."""
        self.launch(kept_hosts(self.ray, self.places, self.keep, self.stream))
        self.opened()

    def launch(self, hosts: Sequence[Any]) -> None:
        """Start every model's actor, hosted by the kept worker of ``hosts`` where one is given (None: a fresh
        actor), without waiting for them (:meth:`opened`)."""
        self.token = any(model.remote for model in self.models) and driver_token()
        self.hosts = list(hosts)
        self.actors = [self._start(model, place, threads, host)
                       for model, place, threads, host in zip(self.models, self.places, self.threads, self.hosts)]

    def opened(self) -> None:
        """Wait for every actor :meth:`launch` started to open its model (see :meth:`start`)."""
        try:
            self.nodes = self._get([a.node.remote() for a in self.actors])
        except Lost as exc:
            raise UnreachableError(f"a Ray node of the {self.what} was lost as its actors started ({exc})",
                                   hint=self.hint) from None

    def _start(self, model: PassModel, place: Place, threads: int, host: Any = None) -> Any:
        """Model ``model``'s actor (:func:`~resumerge.forward.placing.onray.on_place`: hosted by the kept worker
        ``host`` where given, else by a fresh actor pinned to its node declaring its CPUs and memory, never restarted by
        Ray: the pass replaces it), its node told whether it needs a token of its own (:class:`ModelNode`)."""
        return on_place(self.ray, place, host, ModelNode, sent(model), threads, self.token, self.state, self.dtype,
                        self.what, self.watch)

    def end(self) -> None:
        end_actors(self.ray, self.actors, self.hosts)

    def _get(self, refs: Any) -> Any:
        return got(self.ray, refs)

    def _each(self, call: Callable[[int], Any]) -> list[Any]:
        """``call(m)`` (a remote call of model ``m``'s actor) for every model, its result; those of lost actors
        made again on their replacements (:meth:`_replace`)."""
        found: list[Any] = [None] * len(self.actors)
        todo = list(range(len(self.actors)))
        while todo:
            refs = [call(m) for m in todo]
            lost = []
            for m, ref in zip(todo, refs):
                try:
                    found[m] = self._get(ref)
                except Lost as exc:
                    lost.append((m, str(exc)))
            todo = [m for m, _ in lost]
            if todo:
                self._replace(lost[0][1])
        return found

    def _whole(self, step: Callable[[], Any]) -> Any:
        """``step()`` (remote calls, their results), made again whole after replacing the lost actors."""
        while True:
            try:
                return step()
            except Lost as exc:
                self._replace(str(exc))

    def _replace(self, why: str) -> None:
        """A new actor for each model whose actor died, on a node not lost (:meth:`_elsewhere`), its model opened
        and given the pass's batches; raises :class:`UnreachableError` past :data:`REPLACES`, or where no node
        can take one."""
        self.replaced += 1
        if self.replaced > REPLACES:
            raise UnreachableError(f"the Ray cluster kept losing the {self.what}'s nodes ({why})", hint=self.hint)
        dead = [m for m, actor in enumerate(self.actors) if not self._alive(actor)]
        self.lost.update(self.places[m].node_id for m in dead)
        for m in dead:
            self.places[m] = self._elsewhere(m, why)
            self.actors[m] = self._start(self.models[m], self.places[m], self.threads[m])
            self.fresh.add(m)
        for m in dead:
            ready, _ = self.ray.wait([ref := self.actors[m].node.remote()], timeout=PLACE_SECONDS)
            if not ready:
                raise UnreachableError(f"a Ray node of the {self.what} was lost ({why}), and its model's new actor "
                                       f"did not start within {PLACE_SECONDS:.0f} s", hint=self.hint)
            try:
                self.nodes[m] = self._get(ref)
                if self.batches is not None:
                    self._get(self.actors[m].enter.remote(own_batches(self.vocab, m, self.batches)))
                    self._get(self.actors[m].restore.remote(self.handed[m]))
            except Lost:
                raise UnreachableError(f"a Ray node of the {self.what} was lost ({why}), and so was its model's new "
                                       "actor", hint=self.hint) from None

    def _alive(self, actor: Any) -> bool:
        try:
            self._get(actor.node.remote())
        except Lost:
            return False
        return True

    def _elsewhere(self, m: int, why: str) -> Place:
        """Where model ``m``'s new actor runs: the alive node not lost with the most CPUs that the check's other
        actors leave free, where they leave the memory it declares free too; it declares the CPUs its lost actor
        did (fewer where fewer are free)."""
        cpus: dict[str, float] = {}
        memory: dict[str, int] = {}
        for other, place in enumerate(self.places):
            if other != m and place.node_id not in self.lost:
                cpus[place.node_id] = cpus.get(place.node_id, 0.0) + place.cpus
                memory[place.node_id] = memory.get(place.node_id, 0) + place.memory
        need = self.places[m]
        free = sorted(((float(n["Resources"].get("CPU", 0)) - cpus.get(n["NodeID"], 0.0), n["NodeID"])
                       for n in self.ray.nodes() if n.get("Alive") and n["NodeID"] not in self.lost
                       and int(n["Resources"].get("memory", 0)) - memory.get(n["NodeID"], 0) >= need.memory),
                      key=lambda n: (-n[0], n[1]))
        if not free or free[0][0] < 0.01:
            raise UnreachableError(f"a Ray node of the {self.what} was lost ({why}), and no node left has the CPUs "
                                   f"and {format_size(need.memory)} of memory free for the {self.models[m].role}'s "
                                   "actor",
                                   hint=self.hint)
        return Place(free[0][1], cpus_of(min(need.cpus, free[0][0])), need.memory)

    def _checked(self) -> None:
        """Hand what each actor read of its hub files since the last step to ``on_reads`` (which raises on bytes
        other than the check's journal holds)."""
        if self.on_reads is None:
            return
        found: list[list[Read]] = self._each(lambda m: self.actors[m].reads.remote())
        for m, reads in enumerate(found):
            if reads:
                self.on_reads(m, reads)

    def _own(self, m: int, hidden: list[Hidden]) -> Hidden | None:
        """Model ``m``'s hidden states to send its actor: none where it holds them (its last output)."""
        return None if self.seeded and m not in self.fresh else hidden[m]

    def enter(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Hidden]:
        self.seeded = False
        self.batches = batches
        found: list[tuple[Hidden, frozenset[int]]] = self._each(
            lambda m: self.actors[m].enter.remote(own_batches(self.vocab, m, batches)))
        self._checked()
        self.computed = [layers for _, layers in found]
        return [hidden for hidden, _ in found]

    def runs_batched(self) -> bool:
        batched = bool(self._whole(lambda: self._get(self.actors[0].runs_batched.remote())))
        self._checked()
        return batched

    def before(self) -> int:
        return int(self._whole(lambda: self._get(self.actors[0].before.remote())))

    def entered(self, index: int, hidden: list[Hidden], m: int) -> Hidden:
        """Model ``m``'s input to its layer ``index`` (:meth:`~resumerge.forward.job.placement.Placement.entered`):
        computed by its actor, which holds its earlier outputs, where its forward computes one (the layers its actor
        named as it entered the batches); else ``hidden[m]``, the actor not asked."""
        if index not in self.computed[m]:
            return hidden[m]
        found: Hidden = self._whole(lambda: self._get(self.actors[m].entered.remote(index, self._own(m, hidden))))
        return found

    def layer(self, index: int, hidden: list[Hidden], reference: int | None, same: Hidden | None = None
              ) -> tuple[list[Hidden], list[Hidden]]:
        if self.on_layer is not None:
            self.on_layer(index, self.nodes)
        if reference is not None and same is None:
            same = self.entered(index, hidden, reference)
        sent = self.ray.put(same) if same is not None else None
        before = list(self.nodes)
        done: list[tuple[Hidden, Hidden | None, dict[str, torch.Tensor], object]] = self._each(
            lambda m: self.actors[m].layer.remote(index, self._own(m, hidden), None if m == reference else sent))
        self._checked()
        self.seeded = True
        self.fresh.clear()
        self.handed = [values for _, _, values, _ in done]
        if self.watch is not None:  # what each node's copy of the watch found, for the pass's step
            for m, (*_, found) in enumerate(done):
                self.watch.put(m, found)
        if self.on_layer is not None and self.nodes != before:  # ``status`` names where the models run now
            self.on_layer(index, self.nodes)
        return [out for out, *_ in done], [out if theirs is None else theirs for out, theirs, *_ in done]

    def carried(self, index: int) -> dict[str, torch.Tensor]:
        """What the models' layers up to ``index`` hand later ones, as their actors sent it with the layer."""
        return {name: value for m, values in enumerate(self.handed)
                for name, value in handed.as_model(values, m).items()}

    def restore(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Put back in each model's actor (and keep, for a new actor) what :meth:`carried` journaled."""
        self.handed = [handed.of_model(tensors, m) for m in range(len(self.actors))]
        if any(self.handed):
            self._each(lambda m: self.actors[m].restore.remote(self.handed[m]))

    def heads(self, hidden: list[Hidden], batches: Batches, base: int | None) -> HeadTotals:
        def step() -> list[ModelHead]:
            lps = [actor.head.remote(batches, m in (0, base), self._own(m, hidden), self.vocab, m)
                   for m, actor in enumerate(self.actors)]
            merged, base_lp = lps[0], lps[base] if base is not None else None
            refs = [self.actors[0].compare.remote(None, None, batches, self.vocab, 0)]
            refs += [actor.compare.remote(merged, base_lp if base is not None and m > base else None, batches,
                                          self.vocab, m)
                     for m, actor in enumerate(self.actors) if m > 0]
            found: list[ModelHead] = self._get(refs)
            return found

        found: list[ModelHead] = self._whole(step)
        self._checked()
        return totals(found, sum(len(s) - 1 for batch in batches for s in batch))


@contextmanager
def ray_models(models: Sequence[PassModel], placed: list[Place], layers: int,
               on_layer: Callable[[int, list[str]], None] | None = None,
               on_reads: Callable[[int, list[Read]], None] | None = None, vocab: SharedVocab | None = None,
               terms: ActorTerms = CHECK_ACTORS) -> Iterator[RayModels]:
    """The pass's models as actors of the Ray cluster this process joined
    (:func:`~resumerge.forward.placing.onray.ray_places`), where ``placed`` says (``vocab``: how their vocabularies
    meet, where they differ; ``terms``: how the actors are made, :class:`ActorTerms`: the state dir a node opens a GGUF
    or hub model under, and on a cluster that outlives the pass how long a kept worker waits idle,
    :func:`~resumerge.forward.placing.onray.kept_hosts`); they end with the block."""
    from resumerge.machine.rayconnect import require_ray

    running = RayModels(require_ray(), models, list(placed), layers, on_layer, on_reads, vocab, terms)
    try:
        running.start()
        yield running
    finally:
        running.end()


@contextmanager
def ray_each(models: Sequence[PassModel], placed: Sequence[Place], layers: Sequence[int],
             on_reads: Callable[[int, list[Read]], None] | None, terms: Sequence[ActorTerms]
             ) -> Iterator[list[RayModels]]:
    """Each of ``models`` a placement of its own (an actor where ``placed`` says, ``layers[m]`` decoder layers,
    made as ``terms[m]`` says: :class:`ActorTerms`), for passes that run the models side by side, each at its own
    layer with its own journal (``measure``'s): the kept workers leased for them all at once
    (:func:`~resumerge.forward.placing.onray.kept_hosts`, ``terms[0].keep`` and ``stream``), every actor started before
    any is waited for; ``on_reads(m, reads)``: what model ``m``'s node read of its hub files. They end with the
    block."""
    from resumerge.machine.rayconnect import require_ray

    ray = require_ray()

    def told(m: int) -> Callable[[int, list[Read]], None] | None:
        if on_reads is None:
            return None
        return lambda _, found: on_reads(m, found)

    each = [RayModels(ray, [model], [place], count, None, told(m), None, term)
            for m, (model, place, count, term) in enumerate(zip(models, placed, layers, terms))]
    with ExitStack() as ending:
        for running in each:
            ending.callback(running.end)
        first = terms[0] if terms else ActorTerms()
        for running, host in zip(each, kept_hosts(ray, placed, first.keep, first.stream)):
            running.launch([host])
        for running in each:
            running.opened()
        yield each


def placing(address: str | None, state: str | None, what: str) -> Places:
    """The :class:`~resumerge.forward.job.placement.Places` of a pass the run's executor places on the Ray cluster at
    ``address`` (None: ``RAY_ADDRESS``, else a Ray started here) that does not learn where it runs (the MoE
    hidden-state gates'): the cluster joined and each model's actor placed when the pass asks, before it reads a
    weight (refused, exit 2, where no node holds one: :func:`~resumerge.forward.placing.onray.ray_places`), each actor
    declaring torch's imports and the model's part of the pass at its largest step (``needs``) and no CPU: the
    pass runs while the run's workers wait for its plan, holding the CPUs (:class:`RayModels`, ``beside``);
    ``state``: the state dir given with ``--state-dir``; ``what``: the pass, as its refusals name it."""

    def placed(models: Sequence[PassModel], layers: int, needs: Sequence[int],
               dtype: torch.dtype) -> AbstractContextManager[Placement]:
        from resumerge.forward.placing.onray import ray_places

        where = ray_places(address, [IMPORT_RESERVE + need for need in needs], what=what)
        return ray_models(models, where, layers, terms=ActorTerms(state, dtype, what, beside=True))

    return placed

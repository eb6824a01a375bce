"""``evolve --executor ray``: a generation's candidates spread over the Ray cluster's nodes.

The candidates still to score are cut into one group per node (in order, each a run of neighbours, the groups as
even as can be), and each group is scored on its node by the search's own scorer, working in a folder of the
group's own (:class:`SpreadOverNodes` wraps any :class:`~resumerge.runs.evolve.objective.ScoresGeneration`): for the
streamed pass, that node reads the parents' layers once for its group and merges and runs each of its candidates'
layers; for lm-eval tasks, its candidates are evaluated there. The group is a pass's object on its node
(:class:`NodeScores`), placed, made and ended as a pass's model actors are
(:func:`~resumerge.forward.placing.onray.places`,
:func:`~resumerge.forward.placing.onray.on_place`: one Ray actor class, the kept workers' host, for every pass). A
node's actor journals each candidate's figures into
STORAGE as it scores it (STORAGE on a path every node sees, as OUT for a merge on Ray), so a search killed anywhere
resumes, on Ray or locally; the driver then records the figures it was sent (the same bytes). A candidate's figures
are its own whichever group it was in (each candidate runs on its own hidden states), and each node's torch
computes with the thread count the search recorded as it first started (STORAGE's ``threads.json``; the CPUs its
actor declares where none is recorded): the table is the local search's, byte for byte, whatever the nodes' cores.
On a cluster that outlives the search, each node's group is scored by the node's
kept worker (:mod:`resumerge.machine.cluster.hosting`: leased for the generation, its CPUs reserved), which has
imported Ray, the engine and torch already, instead of a fresh process each search.

A node lost mid-generation stops the search as unreachable (exit 3): run again, it resumes with the candidates
journaled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.errors import UnreachableError
from resumerge.machine.threadcount import recorded_threads
from resumerge.runs.evolve import storage
from resumerge.runs.evolve.objective import ScoresGeneration

if TYPE_CHECKING:
    from resumerge.forward.placing.onray import Place

_HINT = "check the cluster's nodes, then run the search again: it resumes with the candidates journaled"


def groups_of(pending: Sequence[int], nodes: int) -> list[list[int]]:
    """``pending`` cut into at most ``nodes`` runs of neighbours, the first ones one longer where they do not
    divide evenly (none empty)."""
    count = min(nodes, len(pending))
    size, extra = divmod(len(pending), count) if count else (0, 0)
    found, start = [], 0
    for g in range(count):
        end = start + size + (1 if g < extra else 0)
        found.append(list(pending[start:end]))
        start = end
    return found


# Makes the search's scorer working in a folder (its passes' journals, its token cache): STORAGE for a local search,
# a folder of a node's own under STORAGE's work for a group of candidates on Ray (handed in by the API).
ScorerAt = Callable[[Path], ScoresGeneration]


def group_folder(store: Path, generation: int, group: Sequence[int]) -> Path:
    """Where a node scores the candidates ``group`` of ``generation``: named by them, so that a pass journaled for
    other candidates is never resumed as theirs (and is swept with the generation's work)."""
    return store / storage.WORK / f"generation-{generation:04d}-group-{'-'.join(map(str, group))}"


class NodeScores:
    """A node's group of candidates as its actor scores them (made there by
    :func:`~resumerge.forward.placing.onray.on_place`, as a pass's model actors are): the search's scorer ``make``
    working in the group's folder (:func:`group_folder`) under STORAGE ``store``, torch on ``threads`` threads."""

    def __init__(self, make: ScorerAt, store: Path, threads: int) -> None:
        # Applied around each call, on the thread that runs it, as a model's actor applies the pass's count
        # (a kept worker runs its calls on threads of its own, which a process-wide count set here would not reach).
        self.make, self.store, self.threads = make, store, max(1, threads)

    def score(self, generation: int, indexes: Sequence[int],
              configs: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
        """The candidates ``indexes`` of ``generation`` scored, each one's figures journaled into STORAGE as it is
        scored (and taken from there where a killed search had journaled them)."""
        store = self.store
        folder = group_folder(store, generation, indexes)
        folder.mkdir(parents=True, exist_ok=True)

        def done(k: int) -> dict[str, float] | None:
            return storage.journaled(store, generation, indexes[k])

        def record(k: int, figures: dict[str, float]) -> None:
            storage.journal(store, generation, indexes[k], figures)

        from resumerge.inputs.kernels import kernel_threads

        with kernel_threads(self.threads):
            return self.make(folder).score(generation, configs, done, record)


class SpreadOverNodes:
    """Scores a generation with the scorer ``make`` makes, its candidates spread over the nodes of the Ray cluster
    at ``address`` (None: ``RAY_ADDRESS``, else a Ray started here); see the module's docstring. ``keep``: the
    seconds the nodes' kept workers that score the groups wait idle after each generation (0: a fresh actor's
    process each), ``stream`` the class, by name, one made for it computes a merge's shards with
    (:class:`~resumerge.config.passplace.PassPlace`); ``say``: told where the generation is (None: ``progress.json`` in
    ``store`` alone)."""

    def __init__(self, make: ScorerAt, store: Path, address: str | None, keep: float = 0.0,
                 say: storage.Say | None = None, stream: str = "") -> None:
        self.make, self.store, self.address, self.keep, self.stream = make, store, address, keep, stream
        self.say: storage.Say = say or partial(storage.say, store)

    def score(self, generation: int, configs: Sequence[Mapping[str, Any]],
              done: Callable[[int], dict[str, float] | None],
              record: Callable[[int, dict[str, float]], None]) -> list[dict[str, float]]:
        from resumerge.forward.placing.onray import Lost, end_actors, got, kept_hosts, on_place
        from resumerge.machine.rayconnect import join

        found = {i: done(i) for i in range(len(configs))}
        pending = [i for i, figures in found.items() if figures is None]
        if pending:
            ray = join(self.address)
            placed = node_places(ray.nodes(), len(pending))
            groups = groups_of(pending, len(placed))
            # status shows the generation spread (each node's pass keeps its own progress in its group's folder)
            self.say(generation=generation, candidates=pending, layer=None, layers=None,
                     phase=f"scored on {len(groups)} Ray node(s)")
            hosts = kept_hosts(ray, placed, self.keep, self.stream)
            actors: list[Any] = []
            # The search's own count where it recorded one: a candidate's bits are then the same on any node
            recorded = recorded_threads(self.store, storage.THREADS)
            try:
                for place, host in zip(placed, hosts):
                    actors.append(on_place(ray, place, host, NodeScores, self.make, self.store,
                                           recorded or int(place.cpus)))
                scored = got(ray, [actor.score.remote(generation, group, [configs[i] for i in group])
                                   for actor, group in zip(actors, groups)])
            except Lost as exc:  # a node (or its actor's process) lost
                raise UnreachableError(f"a Ray node scoring the search's candidates was lost ({exc})",
                                       hint=_HINT) from None
            finally:
                end_actors(ray, actors, hosts)
            for group, figures in zip(groups, scored):
                for i, each in zip(group, figures):
                    record(i, each)
                    found[i] = each
        return [f for _, f in sorted(found.items()) if f is not None]


def node_places(nodes: Sequence[dict[str, Any]], pending: int) -> list[Place]:
    """Where a generation's ``pending`` candidates are scored: one group per alive node with CPUs (``ray.nodes()``),
    most CPUs first, as many as there are candidates at most, each taking all its node's CPUs
    (:func:`~resumerge.forward.placing.onray.places`, which refuses a cluster with none, exit 2)."""
    from resumerge.forward.placing.onray import places

    with_cpus = sum(1 for n in nodes if n.get("Alive") and n["Resources"].get("CPU", 0) > 0)
    return places(nodes, [0] * max(1, min(with_cpus, pending)), what="search")

"""``evolve --executor ray``: a generation's candidates spread over the Ray cluster's nodes.

The candidates still to score are cut into one group per node (in order, each a run of neighbours, the groups as
even as can be), and each group is scored on its node by the search's own scorer, working in a folder of the
group's own (:class:`SpreadOverNodes` wraps any :class:`~resumerge.runs.evolve.objective.ScoresGeneration`): for the
streamed pass, that node reads the parents' layers once for its group and merges and runs each of its candidates'
layers; for lm-eval tasks, its candidates are evaluated there. A node's task journals each candidate's figures into
STORAGE as it scores it (STORAGE on a path every node sees, as OUT for a merge on Ray), so a search killed anywhere
resumes, on Ray or locally; the driver then records the figures it was sent (the same bytes). A candidate's figures
are its own whichever group it was in (each candidate runs on its own hidden states), and each node's torch
computes with the thread count the search recorded as it first started (STORAGE's ``threads.json``; the CPUs its
task declares where none is recorded): the table is the local search's, byte for byte, whatever the nodes' cores.
On a cluster that outlives the search, each node's group is scored by the node's kept worker
(:mod:`resumerge.merge.engine.cluster.hosting`: leased for the generation, its CPUs reserved), which has imported
Ray, the engine and torch already, instead of a fresh process each search.

A node lost mid-generation stops the search as unreachable (exit 3): run again, it resumes with the candidates
journaled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from resumerge.errors import ResumergeError, UnreachableError, UsageError
from resumerge.merge.store.threadcount import recorded_threads
from resumerge.runs.evolve import storage
from resumerge.runs.evolve.objective import ScoresGeneration

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


def score_on_node(make: ScorerAt, store: Path, generation: int, indexes: Sequence[int],
                  configs: Sequence[Mapping[str, Any]], threads: int) -> list[dict[str, float]]:
    """What a node's task runs: the candidates ``indexes`` of ``generation`` scored by the search's scorer (made to
    work in :func:`group_folder`) with torch on ``threads`` threads, each one's figures journaled into STORAGE as
    it is scored (and taken from there where a killed search had journaled them)."""
    from resumerge.torch_import import torch

    torch.set_num_threads(max(1, threads))
    folder = group_folder(store, generation, indexes)
    folder.mkdir(parents=True, exist_ok=True)

    def done(k: int) -> dict[str, float] | None:
        return storage.journaled(store, generation, indexes[k])

    def record(k: int, figures: dict[str, float]) -> None:
        storage.journal(store, generation, indexes[k], figures)

    return make(folder).score(generation, configs, done, record)


class NodeScores:
    """A node's group scored in its kept worker (:mod:`resumerge.merge.engine.cluster.hosting`): :func:`score_on_node`
    with the search's scorer ``make`` and STORAGE ``store``."""

    def __init__(self, make: ScorerAt, store: Path) -> None:
        self.make, self.store = make, store

    def score(self, generation: int, indexes: Sequence[int], configs: Sequence[Mapping[str, Any]],
              threads: int) -> list[dict[str, float]]:
        return score_on_node(self.make, self.store, generation, indexes, configs, threads)


class SpreadOverNodes:
    """Scores a generation with the scorer ``make`` makes, its candidates spread over the nodes of the Ray cluster
    at ``address`` (None: ``RAY_ADDRESS``, else a Ray started here); see the module's docstring. ``keep``: the
    seconds the nodes' kept workers that score the groups wait idle after each generation (0: a fresh task's
    process each); ``say``: told where the generation is (None: ``progress.json`` in ``store`` alone)."""

    def __init__(self, make: ScorerAt, store: Path, address: str | None, keep: float = 0.0,
                 say: storage.Say | None = None) -> None:
        self.make, self.store, self.address, self.keep = make, store, address, keep
        self.say: storage.Say = say or partial(storage.say, store)

    def nodes(self) -> list[tuple[str, float]]:
        """The cluster's alive nodes with CPUs, as (id, CPUs), most CPUs first; refuses (exit 2) a cluster with
        none."""
        from resumerge.merge.engine.cluster.connect import join

        ray = join(self.address)
        found = sorted(((n["NodeID"], float(n["Resources"].get("CPU", 0))) for n in ray.nodes()
                        if n.get("Alive") and n["Resources"].get("CPU", 0) > 0), key=lambda n: (-n[1], n[0]))
        if not found:
            raise UsageError("the Ray cluster has no node with CPUs to score candidates on",
                             hint="add a node with CPUs, or run the search without --executor ray")
        return found

    def score(self, generation: int, configs: Sequence[Mapping[str, Any]],
              done: Callable[[int], dict[str, float] | None],
              record: Callable[[int, dict[str, float]], None]) -> list[dict[str, float]]:
        from resumerge.forward.onray import Place, end_actors, kept_hosts
        from resumerge.merge.engine.cluster.connect import require_ray
        from resumerge.merge.engine.cluster.launch import pinned

        found = {i: done(i) for i in range(len(configs))}
        pending = [i for i, figures in found.items() if figures is None]
        if pending:
            ray = require_ray()
            nodes = self.nodes()
            task = ray.remote(score_on_node)
            groups = groups_of(pending, len(nodes))
            # status shows the generation spread (each node's pass keeps its own progress in its group's folder)
            self.say(generation=generation, candidates=pending, layer=None, layers=None,
                     phase=f"scored on {len(groups)} Ray node(s)")
            hosts = kept_hosts(ray, [Place(node, cpus, 0) for _, (node, cpus) in zip(groups, nodes)], self.keep)
            refs = []
            recorded = recorded_threads(self.store, storage.THREADS)
            for group, (node, cpus), host in zip(groups, nodes, hosts):
                # The search's own count where it recorded one: a candidate's bits are then the same on any node
                asked = (generation, group, [configs[i] for i in group], recorded or int(cpus))
                if host is None:
                    refs.append(task.options(num_cpus=cpus, max_retries=0, scheduling_strategy=pinned(node))
                                .remote(self.make, self.store, *asked))
                else:
                    host.host(NodeScores, self.make, self.store)
                    refs.append(host.score.remote(*asked))
            try:
                scored = self._got(ray, refs)
            finally:
                end_actors(ray, [], hosts)
            for group, figures in zip(groups, scored):
                for i, each in zip(group, figures):
                    record(i, each)
                    found[i] = each
        return [f for _, f in sorted(found.items()) if f is not None]

    @staticmethod
    def _got(ray: Any, refs: list[Any]) -> list[list[dict[str, float]]]:
        try:
            found: list[list[dict[str, float]]] = ray.get(refs)
            return found
        except ray.exceptions.RayTaskError as exc:  # the node's own error, said as a local search says it
            if isinstance(exc.cause, ResumergeError):
                raise exc.cause from None
            raise
        except ray.exceptions.RayError as exc:  # a node (or its task's process) lost
            raise UnreachableError(f"a Ray node scoring the search's candidates was lost ({type(exc).__name__})",
                                   hint=_HINT) from None

"""STORAGE, the folder a search keeps everything in, and the one owner of its file names.

What the user reads: ``evaluations.jsonl`` (one JSON object per evaluated candidate: ``generation``,
``candidate`` (numbered from 1 in its generation, as every line and file a person reads numbers it), ``genotype``,
``config``, ``objective``, ``tasks``), ``evaluations.csv`` (the same, a row each), ``best.yml`` (the best
candidate's merge config, which ``resumerge run`` and mergekit-yaml both run) and ``objective.png`` (best,
median and spread per generation). What the search keeps: ``search.json`` (the config's fingerprint, the settings
and the genome's shape: a STORAGE holds one search), ``state.json`` (every generation told: the optimiser's state as
plain numbers, :mod:`.strategy`), ``journal/`` (each candidate's figures as it is scored, so a killed generation
resumes at its next candidate), ``work/`` (a candidate's merge while it is built and scored) and
``progress.json`` (where the search is, its process, the command that continues it and the time left it estimates:
``resumerge status STORAGE``, :mod:`.progress`),
``tokens/`` (the tasks' texts tokenized once) and ``threads.json`` (the torch thread count every candidate is scored
with, decided as the search first starts: a search resumed on a machine of other cores scores as the first did).

The user's files are written from ``state.json`` alone after each generation, durably (temp, fsync, rename), so a
search killed anywhere and resumed ends with the same bytes."""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

from resumerge.errors import UsageError
from resumerge.machine.durable import TEMP_SUFFIX, write_file_atomic
from resumerge.machine.killpoints import reach
from resumerge.machine.runlock import JobLock
from resumerge.machine.threadcount import THREADS_FILE

SEARCH = "search.json"
STATE = "state.json"
TABLE = "evaluations.jsonl"
CSV = "evaluations.csv"
BEST = "best.yml"
CHART = "objective.png"
PROGRESS = "progress.json"
JOURNAL = "journal"
WORK = "work"
TOKENS = "tokens"  # the tasks' texts tokenized once per search
# the log of a search to W&B or trackio (.tracking): its run's id and the generations logged, one file a library
LOGGED = MappingProxyType({"wandb": "logged-wandb.json", "trackio": "logged-trackio.json"})
LOCK = "lock"  # held by the one process running the search (its pid and command inside; emptied when it ends)
SHAPES = ("shapes.json", "front.json", "surrogate.json", "cache")  # a structure search's own (.shapes.search)
# a combined search's own (.combined): the stages' configs, their STORAGEs and the merge between them
COMBINED = ("parameters.yml", "structure.yml", "parameters", "merged", "structure")
THREADS = THREADS_FILE  # the torch thread count every pass of the search computes with, decided at its first start
_OURS = frozenset({
    SEARCH, STATE, TABLE, CSV, BEST, CHART, PROGRESS, JOURNAL, WORK, TOKENS, LOCK, THREADS, *LOGGED.values(), *SHAPES,
    *COMBINED,
})


@dataclass(frozen=True)
class Evaluated:
    """One scored candidate: where it is in the search, its genotype, the merge config it became, its figure per
    task and the objective (the weighted sum the optimiser minimises)."""

    generation: int
    index: int
    genotype: list[float]
    config: dict[str, Any]
    objective: float
    tasks: dict[str, float | None]  # None: a figure that was not finite (the merge broke), kept strict JSON

    @property
    def number(self) -> int:
        """The candidate's number in its generation as a person reads it (from 1; ``index`` is from 0)."""
        return self.index + 1

    def to_json(self) -> dict[str, Any]:
        """As ``state.json`` keeps it (what :func:`read_state` reads back)."""
        return {"generation": self.generation, "index": self.index, "genotype": self.genotype,
                "config": self.config, "objective": self.objective, "tasks": self.tasks}

    def to_row(self) -> dict[str, Any]:
        """As the user reads it (``evaluations.jsonl``, ``evolve --json``): the candidate numbered from 1."""
        return {"generation": self.generation, "candidate": self.number, "genotype": self.genotype,
                "config": self.config, "objective": self.objective, "tasks": self.tasks}


class Say(Protocol):
    """Says where a scorer's work is (:func:`say`'s words: ``generation``, ``candidates``, ``phase``, ``layer``,
    ``layers``): into ``progress.json`` alone, or through a search's progress, which tells its watcher too
    (:class:`~resumerge.runs.evolve.progress.SearchProgress`)."""

    def __call__(self, **where: Any) -> None: ...


def is_storage(path: Path) -> bool:
    """Whether ``path`` is a search's STORAGE (it holds :data:`SEARCH`)."""
    return (path / SEARCH).is_file()


def claim(storage: Path, identity: dict[str, Any]) -> bool:
    """Make ``storage`` this search's (``identity``: the config's fingerprint and the settings) and say whether it
    held it already (a resume). Raises :class:`UsageError` (exit 2, nothing read or written) where it holds another
    search, or files resumerge did not write."""
    if is_storage(storage):
        held = json.loads((storage / SEARCH).read_text(encoding="utf-8"))
        if held != identity:
            changed = sorted(k for k in {*held, *identity} if held.get(k) != identity.get(k))
            raise UsageError(f"STORAGE {storage} holds another search (its {', '.join(changed)} differ)",
                             hint="give the same config and options to resume it, or another STORAGE")
        return True
    if storage.exists() and (not storage.is_dir() or any(p.name not in _OURS for p in storage.iterdir())):
        raise UsageError(f"STORAGE {storage} holds files resumerge evolve did not write",
                         hint="give an empty or new folder")
    storage.mkdir(parents=True, exist_ok=True)
    write_file_atomic(storage / SEARCH, _dumps(identity))
    return False


def locked(storage: Path, command: str) -> JobLock:
    """The lock of the search in ``storage`` (claimed already: a refused STORAGE gets no lock file), held while it
    runs: two processes in one STORAGE would journal, sweep and rewrite each other's files (its generation's
    streamed pass deleting the other's layer files), so the second is refused (exit 4) naming the first
    (``command``: what the holder runs)."""
    # Imported here: `status` reads this module, and the forward package's first import pulls in every input codec.
    from resumerge.forward.job.folder import pass_lock

    return pass_lock(storage, f"the search in {storage}", command, name=LOCK,
                     hint="wait for it to finish, or stop it (run again, it resumes at the candidate it reached)")


def sweep(storage: Path) -> None:
    """Remove the temp files a killed search left beside its own files (``.NAME.<random>.tmp``: ours alone)."""
    for path in storage.iterdir():
        name = path.name
        if name.startswith(".") and name.endswith(TEMP_SUFFIX) and \
                name[1:-len(TEMP_SUFFIX)].rsplit(".", 1)[0] in _OURS:
            path.unlink(missing_ok=True)


def read_state(storage: Path) -> list[list[Evaluated]]:
    """The generations told so far, each its candidates in order."""
    path = storage / STATE
    if not path.is_file():
        return []
    doc = json.loads(path.read_text(encoding="utf-8"))
    return [[Evaluated(**row) for row in generation] for generation in doc["generations"]]


def write_state(storage: Path, generations: Sequence[Sequence[Evaluated]], figures: dict[str, Any]) -> None:
    """Record every generation told (durably) and the strategy's figures after them; then drop the journal of
    the generation now recorded, and what its candidates' merges left (a kill between a candidate's journal and
    its folder's removal)."""
    doc = {"generations": [[e.to_json() for e in g] for g in generations], "strategy": figures}
    write_file_atomic(storage / STATE, _dumps(doc))
    reach("after_evolve_generation")  # tests kill the search here: between generations
    shutil.rmtree(storage / JOURNAL, ignore_errors=True)
    shutil.rmtree(storage / WORK, ignore_errors=True)


def journaled(storage: Path, generation: int, index: int, part: str = "") -> dict[str, Any] | None:
    """The figures recorded for candidate ``index`` of ``generation`` (None: not scored yet); ``part``: those of
    one scorer of several (:mod:`.together`)."""
    path = _journal_path(storage, generation, index, part)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def journal(storage: Path, generation: int, index: int, figures: dict[str, Any], part: str = "") -> None:
    """Record a candidate's figures (``part``: one scorer's of several) durably, before the next candidate starts."""
    path = _journal_path(storage, generation, index, part)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, _dumps(figures))
    reach("after_evolve_candidate")  # tests kill the search here: inside a generation


def _journal_path(storage: Path, generation: int, index: int, part: str = "") -> Path:
    suffix = f"-{part}" if part else ""
    return storage / JOURNAL / f"generation-{generation:04d}" / f"candidate-{index:03d}{suffix}.json"


def work_dir(storage: Path, generation: int, index: int) -> Path:
    """Where candidate ``index`` of ``generation`` is merged while it is scored."""
    return storage / WORK / f"generation-{generation:04d}-candidate-{index:03d}"


def best_of(generations: Sequence[Sequence[Evaluated]]) -> Evaluated | None:
    """The candidate of lowest objective (the first of equals), or None before any."""
    found = [e for g in generations for e in g]
    return min(found, key=lambda e: e.objective) if found else None


def write_outputs(storage: Path, generations: Sequence[Sequence[Evaluated]], task_names: Sequence[str]) -> None:
    """The table, its CSV, ``best.yml`` and the chart, from the generations told (the same bytes whenever)."""
    import yaml

    from resumerge.runs.evolve.chart import objective_png

    rows = [e for g in generations for e in g]
    write_file_atomic(storage / TABLE, "".join(json.dumps(e.to_row()) + "\n" for e in rows).encode())
    write_file_atomic(storage / CSV, _csv(rows, task_names).encode())
    write_file_atomic(storage / CHART, objective_png([[e.objective for e in g] for g in generations]))
    best = best_of(generations)
    if best is not None:
        head = (f"# resumerge evolve: the best of {len(rows)} candidates (generation {best.generation}, candidate "
                f"{best.number}), objective {best.objective!r}\n")
        text = head + yaml.safe_dump(best.config, sort_keys=False)
        write_file_atomic(storage / BEST, text.encode(), point="during_best_write")


def _csv(rows: Sequence[Evaluated], task_names: Sequence[str]) -> str:
    out = io.StringIO()
    import csv  # here: status asks is_storage of every OUT

    writer = csv.writer(out, lineterminator="\n")
    width = len(rows[0].genotype) if rows else 0
    writer.writerow(["generation", "candidate", "objective", *task_names, *(f"x{i}" for i in range(width)), "config"])
    for e in rows:
        figures = (repr(e.tasks[t]) if e.tasks[t] is not None else "" for t in task_names)
        writer.writerow([e.generation, e.number, repr(e.objective), *figures,
                         *map(repr, e.genotype), json.dumps(e.config)])
    return out.getvalue()


def say(storage: Path, **where: Any) -> None:
    """Update ``progress.json`` with ``where`` (the generation, candidate, phase, layer...; what ``status`` shows).
    Not durable on purpose: it is a view, rewritten as the search goes, and rebuilt by the next update."""
    path = storage / PROGRESS
    try:
        doc = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except ValueError:
        doc = {}
    doc.update(where)
    temp = path.with_name(f".{path.name}.{os.getpid()}{TEMP_SUFFIX}")
    temp.write_text(json.dumps(doc), encoding="utf-8")
    os.replace(temp, path)


def progress(storage: Path) -> dict[str, Any]:
    """What ``progress.json`` says (empty where there is none yet)."""
    try:
        found = json.loads((storage / PROGRESS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, indent=1).encode()

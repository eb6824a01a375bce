"""A search logged to Weights & Biases (mergekit-evolve's ``--wandb``) or trackio (``--trackio``): one row per
candidate (its generation and number, genotype ``x0..xN``, figure per task and objective), a summary per generation
(the population's objective mean, standard deviation, best and worst, and the best so far), and the best merge config
(``best.yml``) as an artifact each time the best changes.

A search is killed and resumed; its log must not say a candidate twice, nor miss one. So the log follows the
search's own record: after a generation is made durable (``state.json``) its rows are logged and handed to the
library for good (:meth:`Backend.settle`), then ``logged-wandb.json`` (``logged-trackio.json``) in STORAGE says so
(temp, fsync, rename); a search resumed logs, to the same run (its id kept in that file before the run starts),
every told generation the file does not name, before it goes on. A kill between the
log and that file's rename would send the generation's rows again: the window is the logging call alone, where
W&B and trackio hold rows in their own queues anyway.

The logging libraries are optional (the ``logging`` extra), imported where a search asks for them."""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import statistics
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from resumerge.errors import UsageError
from resumerge.machine.durable import write_file_atomic
from resumerge.runs.evolve.storage import BEST, LOGGED, Evaluated

_EXTRA = "pip install wandb trackio (in the resumerge clone: pip install -c constraints.txt -e '.[logging]')"


@dataclass(frozen=True)
class Tracking:
    """Where a search is logged: ``kind`` (``wandb`` or ``trackio``), its ``project`` and (W&B) ``entity``."""

    kind: str
    project: str
    entity: str | None = None


class Backend(Protocol):
    """One logging library's calls."""

    def start(self, run: str, config: dict[str, Any]) -> None: ...

    def log(self, values: dict[str, float | int], step: int) -> None: ...

    def settle(self) -> None:
        """Every row logged so far kept by the library (a kill after this loses none of them)."""

    def artifact(self, path: Path, name: str, kind: str) -> None: ...

    def finish(self) -> None: ...


class WandbBackend:
    """W&B: the run ``run`` of the project, resumed where it exists (``resume="allow"``)."""

    def __init__(self, tracking: Tracking) -> None:
        self.tracking = tracking
        self.wandb: Any = _imported("wandb")
        self.run: Any = None  # while a run is open
        self.opened: tuple[str, dict[str, Any]] = ("", {})

    def start(self, run: str, config: dict[str, Any]) -> None:
        self.opened = (run, config)
        self._open()

    def _open(self) -> Any:
        if self.run is None:
            run, config = self.opened
            self.run = self.wandb.init(project=self.tracking.project, entity=self.tracking.entity, id=run,
                                       resume="allow", config=config)
        return self.run

    def log(self, values: dict[str, float | int], step: int) -> None:
        self._open().log(values, step=step)

    def settle(self) -> None:
        # W&B's records go through its own service process; only finish() waits until they are written (measured:
        # a generation's rows logged, the process killed seconds later, were missing from the offline run file), so
        # each generation ends the run and the next one resumes it (offline: one run folder per part, one run id).
        if self.run is not None:
            self.run.finish()
            self.run = None

    def artifact(self, path: Path, name: str, kind: str) -> None:
        artifact = self.wandb.Artifact(name, type=kind)
        artifact.add_file(str(path))
        self._open().log_artifact(artifact)

    def finish(self) -> None:
        self.settle()


class TrackioBackend:
    """trackio: the run named ``run`` of the project (its local store, or a Space where trackio is told one)."""

    def __init__(self, tracking: Tracking) -> None:
        self.tracking = tracking
        self.trackio: Any = _imported("trackio")
        self.opened: tuple[str, dict[str, Any]] | None = None  # the run and its config, while it is open

    def start(self, run: str, config: dict[str, Any]) -> None:
        self.opened = None
        self._open(run, config)

    def _open(self, run: str, config: dict[str, Any]) -> None:
        if self.opened is None:
            with _quiet():
                self.trackio.init(project=self.tracking.project, name=run, resume="allow", config=config)
            self.opened = (run, config)
        self.run, self.config = run, config

    def log(self, values: dict[str, float | int], step: int) -> None:
        self._open(self.run, self.config)
        self.trackio.log(dict(values), step=step)

    def settle(self) -> None:
        # trackio writes its rows from a queue every half second; only finish() waits for them to be written (its
        # public way), so each generation ends the run and the next one resumes it.
        if self.opened is not None:
            with _quiet():
                self.trackio.finish()
            self.opened = None

    def artifact(self, path: Path, name: str, kind: str) -> None:
        self._open(self.run, self.config)
        self.trackio.log_artifact(str(path), name=name, type=kind)

    def finish(self) -> None:
        self.settle()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """trackio's lines (it prints where a run starts and ends) on stderr: stdout is the command's (``--json``)."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _imported(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise UsageError(f"--{name} needs the {name} package", hint=_EXTRA) from None


def backend(tracking: Tracking) -> Backend:
    """The library ``tracking`` names, imported (UsageError, exit 2, where it is not installed)."""
    return WandbBackend(tracking) if tracking.kind == "wandb" else TrackioBackend(tracking)


class SearchLog:
    """The log of the search in ``store``: :meth:`told` after each generation is durable (and once on start, for
    what a killed search told and did not log), :meth:`close` when the search ends."""

    def __init__(self, store: Path, kind: str, backend: Backend, config: dict[str, Any]) -> None:
        self.store, self.backend, self.path = store, backend, store / LOGGED[kind]
        record = self._record()
        if record is None:  # the run's id is kept before the run exists: a kill after its start resumes it
            record = {"run": f"resumerge-evolve-{secrets.token_hex(4)}", "generations": [], "best": None}
            write_file_atomic(self.path, json.dumps(record, indent=1).encode())
        self.record = record
        backend.start(str(record["run"]), config)

    def _record(self) -> dict[str, Any] | None:
        found: dict[str, Any] | None = json.loads(self.path.read_text(encoding="utf-8")) \
            if self.path.is_file() else None
        return found

    def told(self, generations: Sequence[Sequence[Evaluated]]) -> None:
        """Log every generation of ``generations`` not logged yet, then record them durably."""
        logged = set(self.record["generations"])
        step = 0
        best: Evaluated | None = None
        for generation in generations:
            for row in generation:
                step += 1
                if best is None or row.objective < best.objective:
                    best = row
            if not generation or generation[0].generation in logged:
                continue
            first = step - len(generation) + 1
            for offset, row in enumerate(generation):
                self.backend.log(_row(row), first + offset)
            assert best is not None
            self.backend.log(_summary(generation, best), step)
            place = [best.generation, best.index]
            if self.record["best"] != place and (self.store / BEST).is_file():
                self.backend.artifact(self.store / BEST, "best_config", "merge_config")
                self.record["best"] = place
            self.backend.settle()
            self.record["generations"].append(generation[0].generation)
            write_file_atomic(self.path, json.dumps(self.record, indent=1).encode())

    def close(self) -> None:
        self.backend.finish()


def _number(value: float | None) -> float:
    return value if value is not None and math.isfinite(value) else math.nan


def _row(row: Evaluated) -> dict[str, float | int]:
    values: dict[str, float | int] = {"candidate/generation": row.generation, "candidate/number": row.number,
                                      "candidate/objective": _number(row.objective)}
    values.update({f"candidate/{task}": _number(value) for task, value in row.tasks.items()})
    values.update({f"candidate/x{i}": value for i, value in enumerate(row.genotype)})
    return values


def _summary(generation: Sequence[Evaluated], best: Evaluated) -> dict[str, float | int]:
    scores = [e.objective for e in generation if math.isfinite(e.objective)]
    values: dict[str, float | int] = {"population/generation": generation[0].generation,
                                      "best/objective": _number(best.objective),
                                      "best/generation": best.generation, "best/number": best.number}
    if scores:
        values.update({"population/objective_mean": statistics.fmean(scores),
                       "population/objective_std": statistics.pstdev(scores),
                       "population/objective_min": min(scores), "population/objective_max": max(scores)})
    return values

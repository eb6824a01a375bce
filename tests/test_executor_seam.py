"""An executor is an object the caller hands in (issue 56): a class of the caller's, named nowhere in resumerge,
computes a run through the API, with the local executor's bytes; the command line builds the same objects."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import pytest
from conftest import ModelFactory
from support import digests, linear_config, write_config

from resumerge import api
from resumerge.api.flagmap import executor_option
from resumerge.cli.commands import build_parser
from resumerge.cli.flags import api_options
from resumerge.config.settings import RunSettings
from resumerge.errors import UsageError
from resumerge.merge.engine.executors import Executor, LocalExecutor, RayExecutor
from resumerge.merge.engine.job import Job


@dataclass(frozen=True)
class _Counting:
    """A test's own executor: this process's threads, counting the jobs it ran and the early starts it made."""

    jobs: list[int] = field(default_factory=list)
    name = "counting"
    beside_ok = True
    starts_early = False

    def check(self) -> None:
        pass

    @contextlib.contextmanager
    def starting(self, settings: RunSettings, *, device: str | None, bounded: bool) -> Iterator[Executor]:
        yield self

    def run(self, job: Job) -> tuple[str, ...]:
        self.jobs.append(len(job.plan.shards))
        return LocalExecutor().run(job)


def test_a_callers_own_executor_runs_a_merge_with_the_local_bytes(tmp_path: Path, make: ModelFactory) -> None:
    cfg = write_config(tmp_path / "c.yml", linear_config(make("a", seed=1), make("b", seed=2)))
    api.run(cfg, tmp_path / "local", settings=api.Settings(output=api.Output(out_shard_size="30k")))
    mine = _Counting()
    api.run(cfg, tmp_path / "mine", settings=api.Settings(output=api.Output(out_shard_size="30k"), executor=mine))
    assert len(mine.jobs) == 1 and mine.jobs[0] > 1
    assert digests(tmp_path / "mine") == digests(tmp_path / "local")


def test_the_command_line_builds_the_executor_object() -> None:
    def executor(*argv: str) -> object:
        return api_options(build_parser().parse_args(["run", "c.yml", "out", *argv]), api.run)["settings"].executor

    assert executor() is None
    assert executor("--executor", "ray", "--ray-address", "10.0.0.1:6379", "--keep-workers", "5m") == RayExecutor(
        address="10.0.0.1:6379", keep_workers=300.0)
    with pytest.raises(UsageError, match="ray_address needs executor"):
        executor_option("local", ray_address="10.0.0.1:6379")
    with pytest.raises(UsageError, match="must be at least 0"):
        RayExecutor(keep_workers=-1).check()


def test_every_command_taking_an_executor_offers_the_names_of_the_one_table(monkeypatch: pytest.MonkeyPatch) -> None:
    # A new executor is a class and one row of EXECUTORS: every command's --executor offers it, with no other edit.
    import argparse

    from resumerge.config import passplace

    mine = MappingProxyType({**passplace.EXECUTORS, "mine": passplace.ExecutorRow(None, "m:Site")})
    monkeypatch.setattr(passplace, "EXECUTORS", mine)
    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    offered = {name: next(a.choices for a in parser._actions if a.dest == "executor")
               for name, parser in subs.choices.items() if any(a.dest == "executor" for a in parser._actions)}
    assert {"run", "resume", "plan", "check", "measure", "eval", "evolve"} <= set(offered), sorted(offered)
    assert all(tuple(choices) == ("local", "ray", "mine") for choices in offered.values()), offered


@pytest.mark.parametrize("function", [api.check, api.measure, api.estimate_measure])
def test_a_pass_takes_runs_resources_and_refuses_those_it_cannot_honour(tmp_path: Path, function: object) -> None:
    # check and measure take run's option groups; a resource they cannot honour is refused before anything is read
    # (the models named do not exist).
    assert callable(function)
    args = (tmp_path / "m",) if function is api.check else (tmp_path / "c.yml",) + (
        (tmp_path / "g",) if function is api.measure else ())
    with pytest.raises(UsageError, match=r"^num_threads does not apply to"):
        function(*args, settings=api.Settings(resources=api.Resources(num_threads=2), state_dir=tmp_path / "s"))
    with pytest.raises(UsageError, match=r"^max_memory must be positive"):
        function(*args, settings=api.Settings(resources=api.Resources(max_memory="0"), state_dir=tmp_path / "s"))
    assert not (tmp_path / "s").exists()

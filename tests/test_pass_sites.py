"""Where the executor places a forward pass, as the pass asks it (:mod:`resumerge.forward.placing.sites`): each
placement answers for itself (its refusals, how the pass's hub reads bind, where its models' actors go), so no pass asks
which placement it was handed. Nothing here starts Ray: the cluster's answer is stood in for."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import pytest
from conftest import ModelFactory

from resumerge.config.locations import StateDir
from resumerge.config.passplace import HERE, PassPlace
from resumerge.config.settings import RunSettings
from resumerge.errors import UsageError
from resumerge.forward.placing.onray import Place
from resumerge.forward.placing.sites import EachModel, Held, site_of
from resumerge.merge.engine.executors import LocalExecutor
from resumerge.merge.engine.job import Job


class _Reads:
    """A pass's hub reads, recording how the site bound them."""

    def __init__(self) -> None:
        self.again: list[bool] = []

    def bind(self, models: Sequence[Any], *, fresh: bool, again: bool = True) -> list[Any]:
        self.again.append(again)
        return list(models)


def test_each_placement_answers_a_pass_for_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import resumerge.forward.placing.onray as onray

    asked: list[tuple[str | None, list[int], str]] = []
    where = [Place("node-a", 2.0, 300)]

    def places(address: str | None, needs: Sequence[int], what: str = "check") -> list[Place]:
        asked.append((address, list(needs), what))
        return where

    monkeypatch.setattr(onray, "ray_places", places)
    state = StateDir.resolve()  # the default state dir: a node opens the models under its own default

    def needs() -> list[int]:
        pytest.fail("a pass placed in this process asked what its actors need")

    here, ray = site_of(HERE), site_of(PassPlace("ray", "10.0.0.1:6379", keep=30.0, stream="m:S"))
    assert (here.name, here.here, ray.name, ray.here) == ("local", True, "ray", False)
    # the words of a command that continues a pass so (a search's), and where a pass that does not learn it goes
    assert (here.words(), ray.words()) == ([], ["--executor", "ray", "--ray-address", "10.0.0.1:6379"])
    assert here.places(None, "prompt forward pass") is None and callable(ray.places(None, "prompt forward pass"))
    # here: nothing placed ahead, and what this process reads twice kept for its second read
    assert type(here.seat(needs, "measurement", state)).__name__ == "_HereSeats"
    here.refuse_away("measure", "needs the models here", hint="leave it out")
    here.available()
    reads = _Reads()
    here.bind(reads, [], fresh=True)  # type: ignore[arg-type]
    # on Ray: the cluster joined with what each actor needs, the state dir a node opens the models under
    assert vars(ray.seat(lambda: [300], "measurement", state)) == {"placed": where, "state": None, "keep": 30.0,
                                                                   "stream": "m:S"}
    assert asked == [("10.0.0.1:6379", [300], "measurement")]
    given = StateDir.resolve(tmp_path / "given")
    assert vars(ray.seat(lambda: [300], "check", given))["state"] == str(given.root)
    with pytest.raises(UsageError) as refused:
        ray.refuse_away("measure", "needs the models here", hint="leave it out")
    assert refused.value.one_line() == "measure --executor ray needs the models here — leave it out"
    ray.bind(reads, [], fresh=True)  # type: ignore[arg-type]
    assert reads.again == [True, False]  # the nodes run the layers: this process keeps nothing for a second read
    with pytest.raises(UsageError) as refused:
        ray.refuse("the check", "cuda", on_gpu=True)
    assert "--executor ray runs each model on a node" in refused.value.one_line()


def test_a_pass_of_one_placement_per_model_runs_them_in_turn_here_and_side_by_side_on_ray(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``measure``'s passes (:meth:`~resumerge.forward.placing.sites.Seats.each`): here each model's placement is
    opened, run and closed before the next one's is opened, and the budget judges the largest model's pass; on Ray every
    model's actor runs at once (each recording with its own watch, under the seats' state dir and kept workers),
    and the budget judges every model's hidden states at once, no layer."""
    import threading

    from resumerge.forward.placing import rayactor

    log: list[str] = []

    @contextmanager
    def here(m: int) -> Iterator[Any]:
        log.append(f"open {m}")
        yield f"placement {m}"
        log.append(f"close {m}")

    def run(m: int, placement: Any) -> str:
        log.append(f"run {placement}")
        return f"model {m}"

    watches = [object(), object()]
    each = EachModel(["a", "b"], [2, 3], watches, here, "measure")  # type: ignore[arg-type]
    seats = site_of(HERE).seat(lambda: [], "measurement", StateDir.resolve())
    assert seats.each(each, run) == ["model 0", "model 1"]
    assert log == ["open 0", "run placement 0", "close 0", "open 1", "run placement 1", "close 1"]
    assert seats.held(["a", "b"], [10, 30], [4, 5]) == Held(30, "b", 5, 25)

    made: list[Any] = []
    both = threading.Barrier(2, timeout=30)  # each model's pass waits for the other's: they run side by side

    @contextmanager
    def ray_each(models: Any, placed: Any, layers: Any, on_reads: Any, terms: Any) -> Iterator[list[str]]:
        made.append((list(models), list(placed), list(layers), terms))
        yield ["actor 0", "actor 1"]

    def together(m: int, placement: Any) -> str:
        both.wait()
        return f"{placement} ran"

    monkeypatch.setattr(rayactor, "ray_each", ray_each)
    where = [Place("node-a", 1.0, 300), Place("node-b", 1.0, 300)]
    monkeypatch.setattr("resumerge.forward.placing.onray.ray_places", lambda address, needs, what="check": where)
    seats = site_of(PassPlace("ray", keep=5.0, stream="m:S")).seat(lambda: [300, 300], "measurement",
                                                                    StateDir.resolve())
    assert seats.each(each, together) == ["actor 0 ran", "actor 1 ran"]
    ((models, placed, layers, terms),) = made
    assert (models, placed, layers) == (["a", "b"], where, [2, 3])
    assert [(t.watch, t.keep, t.stream, t.state, t.what) for t in terms] == [(w, 5.0, "m:S", None, "measure")
                                                                      for w in watches]
    assert seats.held(["a", "b"], [10, 30], [4, 5]) == Held(31, "on Ray", 0, 0)


_RAN: list[int] = []  # the shards of each job the toy executor ran


@dataclass(frozen=True)
class _Toy:
    """A new executor, whole: its merge side (this process's threads, counting the jobs it runs) and where it places
    a forward pass (named as it is; its row says the pass runs in this process)."""

    name: ClassVar[str] = "toy"
    beside_ok: ClassVar[bool] = True
    starts_early: ClassVar[bool] = False

    def check(self) -> None:
        """Nothing to check."""

    @contextmanager
    def starting(self, settings: RunSettings, *, device: str | None, bounded: bool) -> Iterator[_Toy]:
        yield self

    def run(self, job: Job) -> tuple[str, ...]:
        _RAN.append(len(job.plan.shards))
        return LocalExecutor().run(job)

    def place_pass(self) -> PassPlace:
        return PassPlace(self.name)


def test_a_new_executor_is_one_class_and_one_row(tmp_path: Path, make: ModelFactory,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A third executor (``toy``) is its class and one row of ``EXECUTORS``, naming the class and the site its passes
    run on (here: this process's): ``--executor toy`` makes it from that row and merges with it, and every pass
    client's question (a check's placement, the words of the command that continues a search, where the MoE gates'
    models go, where a search's generation is scored) is answered through that row, with no other edit (before
    issue 98: a class in config, one in forward, and a method in four visitors in three files; then two classes and
    two rows, ``api/flagmap.py:EXECUTORS`` and ``forward/placing/sites.py:SITES``)."""
    from types import SimpleNamespace

    from support import linear_config, write_config

    from resumerge.api.checked import check_placement
    from resumerge.api.evolution import _scoring
    from resumerge.api.flagmap import executor_option
    from resumerge.api.moe_kind import _site
    from resumerge.cli.commands import main
    from resumerge.config import passplace
    from resumerge.forward.placing import sites
    from resumerge.runs.moe.gatesites import IN_ITS_PROCESS

    row = passplace.ExecutorRow(f"{__name__}:_Toy", f"{sites.__name__}:InProcess")
    monkeypatch.setattr(passplace, "EXECUTORS", MappingProxyType({**passplace.EXECUTORS, "toy": row}))
    cfg = write_config(tmp_path / "c.yml", linear_config(make("a", seed=1), make("b", seed=2)))
    _RAN.clear()
    # its merge and its check, from the command line: the merge's shards computed by the toy, the check placed by it
    code = main(["run", str(cfg), str(tmp_path / "out"), "--executor", "toy", "--out-shard-size", "30k", "--check",
                 "--quiet"])
    assert code in (0, 5, 6) and len(_RAN) == 1 and _RAN[0] > 1  # the check's verdict, whichever it is
    with pytest.raises(UsageError, match=r"^ray_address needs executor ray$"):
        executor_option("toy", ray_address="10.0.0.1:6379")  # a setting its class has no field for
    placement = check_placement(_Toy())
    site = site_of(placement)
    assert type(site) is sites.InProcess and (site.name, site.here) == ("toy", True)
    assert site.words() == ["--executor", "toy"]  # a search's continuing command names it
    settings = SimpleNamespace(executor=_Toy(), state=StateDir.resolve(tmp_path / "state"))
    assert _site(settings) is IN_ITS_PROCESS  # type: ignore[arg-type]
    made: list[Path] = []

    def scorer(store: Path, say: object = None) -> Any:
        made.append(store)
        return "scorer"

    assert _scoring(placement, scorer, tmp_path, lambda **said: None) == "scorer" and made == [tmp_path]

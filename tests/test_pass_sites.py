"""Where the executor places a forward pass, as the pass asks it (:mod:`resumerge.forward.placing.sites`): each
placement answers for itself (its refusals, how the pass's hub reads bind, where its models' actors go), so no pass asks
which placement it was handed. Nothing here starts Ray: the cluster's answer is stood in for."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from resumerge.config.locations import StateDir
from resumerge.config.passplace import HERE, PassPlace
from resumerge.errors import UsageError
from resumerge.forward.placing.onray import Place
from resumerge.forward.placing.sites import EachModel, Held, site_of


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


def test_a_new_executor_s_passes_are_one_site_class_and_one_row(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A third executor (a caller's own, ``toy``): its ``place_pass`` names it, and its passes are one site class
    plugged in by one row of ``SITES``; every client's question (a pass's refusal, the words of the command that
    continues a search, where the MoE gates' models go, where a search's generation is scored) is answered by that
    class, with no other edit (before issue 98: a class in config, one in forward, and a method in four visitors
    in three files)."""
    from types import SimpleNamespace

    from resumerge.api.checked import check_placement
    from resumerge.api.evolution import _scoring
    from resumerge.api.moe_kind import _site
    from resumerge.forward.placing import sites
    from resumerge.runs.moe.gatesites import IN_ITS_PROCESS

    class _Toy:
        """The executor: what places its passes (its merges' side is the executor seam's, shown elsewhere)."""

        name = "toy"

        def place_pass(self) -> PassPlace:
            return PassPlace(self.name, address="toy-cluster")

    class _ToySite(sites.InProcess):
        """The toy's passes: in this process, refused on a GPU, named in a continuing command."""

        def refuse(self, what: str, device: str, on_gpu: bool) -> None:
            if on_gpu:
                raise UsageError(f"{what} runs on the toy executor's CPUs, not --device {device}")

        def words(self) -> list[str]:
            return ["--executor", self.name, "--ray-address", str(self.placement.address)]

    monkeypatch.setattr(sites, "SITES", MappingProxyType({**sites.SITES, "toy": _ToySite}))
    placement = check_placement(_Toy())
    site = sites.site_of(placement)
    assert type(site) is _ToySite and (site.name, site.here) == ("toy", True)
    assert site.words() == ["--executor", "toy", "--ray-address", "toy-cluster"]
    with pytest.raises(UsageError, match="the check runs on the toy executor's CPUs"):
        site.refuse("the check", "cuda", on_gpu=True)
    settings = SimpleNamespace(executor=_Toy(), state=StateDir.resolve(tmp_path / "state"))
    assert _site(settings) is IN_ITS_PROCESS  # type: ignore[arg-type]
    made: list[Path] = []

    def scorer(store: Path, say: object = None) -> Any:
        made.append(store)
        return "scorer"

    assert _scoring(placement, scorer, tmp_path, lambda **said: None) == "scorer" and made == [tmp_path]

"""Where the executor places a forward pass, as the pass asks it (:mod:`resumerge.forward.sites`): each placement
answers for itself (its refusals, how the pass's hub reads bind, where its models' actors go), so no pass asks
which placement it was handed. Nothing here starts Ray: the cluster's answer is stood in for."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from resumerge.config.locations import StateDir
from resumerge.config.passplace import HERE, OnRay
from resumerge.errors import UsageError
from resumerge.forward.onray import Place
from resumerge.forward.sites import SeatKinds, site_of


class _Reads:
    """A pass's hub reads, recording how the site bound them."""

    def __init__(self) -> None:
        self.again: list[bool] = []

    def bind(self, models: Sequence[Any], *, fresh: bool, again: bool = True) -> list[Any]:
        self.again.append(again)
        return list(models)


class _Kinds:
    """What a pass running its own actors makes of its seats: the seats, in words."""

    def here(self) -> tuple[str, ...]:
        return ("here",)

    def on_nodes(self, placed: Sequence[Place], state: str | None, keep: float) -> tuple[object, ...]:
        return ("nodes", tuple(placed), state, keep)


def test_each_placement_answers_a_pass_for_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import resumerge.forward.onray as onray

    asked: list[tuple[str | None, list[int], str]] = []
    where = [Place("node-a", 2.0, 300)]

    def places(address: str | None, needs: Sequence[int], what: str = "check") -> list[Place]:
        asked.append((address, list(needs), what))
        return where

    monkeypatch.setattr(onray, "ray_places", places)
    state = StateDir.resolve()  # the default state dir: a node opens the models under its own default
    kinds: SeatKinds[tuple[object, ...]] = _Kinds()

    def needs() -> list[int]:
        pytest.fail("a pass placed in this process asked what its actors need")

    here, ray = site_of(HERE), site_of(OnRay("10.0.0.1:6379", keep=30.0))
    assert (here.name, here.here, ray.name, ray.here) == ("local", True, "ray", False)
    # here: nothing placed ahead, and what this process reads twice kept for its second read
    assert here.seat(needs, "measurement", state).made(kinds) == ("here",)
    here.refuse_away("measure", "needs the models here", hint="leave it out")
    here.available()
    reads = _Reads()
    here.bind(reads, [], fresh=True)  # type: ignore[arg-type]
    # on Ray: the cluster joined with what each actor needs, the state dir a node opens the models under
    assert ray.seat(lambda: [300], "measurement", state).made(kinds) == ("nodes", (where[0],), None, 30.0)
    assert asked == [("10.0.0.1:6379", [300], "measurement")]
    given = StateDir.resolve(tmp_path / "given")
    assert ray.seat(lambda: [300], "check", given).made(kinds)[2] == str(given.root)
    with pytest.raises(UsageError) as refused:
        ray.refuse_away("measure", "needs the models here", hint="leave it out")
    assert refused.value.one_line() == "measure --executor ray needs the models here — leave it out"
    ray.bind(reads, [], fresh=True)  # type: ignore[arg-type]
    assert reads.again == [True, False]  # the nodes run the layers: this process keeps nothing for a second read
    with pytest.raises(UsageError) as refused:
        ray.refuse("the check", "cuda", on_gpu=True)
    assert "--executor ray runs each model on a node" in refused.value.one_line()

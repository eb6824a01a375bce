"""The forward engine's one journaled layer pass (resumerge.forward.job.layerpass), as a new client sees it: a
log-likelihood client written on public names only (the opener, the batches, the local placement, the pass, its
journal, the heads' streamed log-probabilities) gives the same NLL whether its pass runs whole or is stopped after
a layer and resumed from its journal; the journal keeps one layer's file (or each, where the client asks), and a
client's step can stop the pass."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.locations import StateDir
from resumerge.forward.compared.heads import logprobs
from resumerge.forward.compared.passes import streams_of
from resumerge.forward.job import layerpass
from resumerge.forward.job.journal import Journal, Restart
from resumerge.forward.job.layerpass import LayerPass, Step
from resumerge.forward.job.placement import Streams
from resumerge.forward.opening.opened import open_for_pass
from resumerge.forward.text.batches import Hidden, enter
from resumerge.machine.torch_import import torch

SPEC = ModelSpec(layers=3, hidden=32, intermediate=48, vocab=64)
TOKENS = [[1, 5, 9, 13, 2], [3, 4, 5], [7, 8, 9, 10, 11, 12, 2]]


class _Stopped(Exception):
    pass


class _LogLikelihood(Step[float]):
    """Each layer run by the placement; after the last, the summed NLL of every next token."""

    def __init__(self, streams: Streams, batches: Sequence[Sequence[Sequence[int]]]) -> None:
        self.streams, self.batches = streams, batches
        self.seen: list[int] = []

    def layer(self, index: int, hidden: Hidden) -> Hidden:
        self.seen.append(index)
        own, _ = self.streams.layer(index, hidden, None)
        return own

    def kept(self, index: int) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
        return {"seen": torch.tensor(self.seen)}, {"client": "ll"}

    def restore(self, restart: Restart) -> None:
        if "seen" in restart.tensors:
            self.seen = [int(i) for i in restart.tensors["seen"]]
            assert restart.metadata["client"] == "ll"

    def finish(self, hidden: Hidden) -> float:
        stream = self.streams.streams[0]
        total = 0.0
        for rows, batch in zip(logprobs(stream, hidden[0], self.batches), self.batches):
            for lp, tokens in zip(rows, batch):
                total -= float(lp.gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).sum())
        return total


def _pass(model: Path, state: StateDir, workdir: Path) -> tuple[float | None, list[int]]:
    opened = open_for_pass(str(model), "MODEL", state)
    (stream,) = streams_of([opened])
    try:
        streams = Streams([stream])
        with torch.no_grad():
            entered = enter(TOKENS, streams.enter, streams.runs_batched)
        step = _LogLikelihood(streams, entered.sequences(TOKENS))
        found = LayerPass(Journal(workdir), streams.layers, point="after_check_layer", carries=streams).run(
            step, entered.hidden, len(entered.batches))
        return found, step.seen
    finally:
        stream.close()


def test_a_client_s_pass_stopped_after_a_layer_resumes_from_its_journal_to_the_same_figure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    model = make_model(tmp_path / "m", SPEC, seed=3)
    state = StateDir.resolve(tmp_path / "state")
    whole, seen = _pass(model, state, tmp_path / "whole")
    assert whole is not None and whole > 0 and seen == [0, 1, 2]
    assert [p.name for p in (tmp_path / "whole").iterdir()] == ["layer-00002.safetensors"]  # the last one only

    def stop_after_layer_1(point: str, **_: object) -> None:
        if point == "after_check_layer" and (tmp_path / "part" / "layer-00001.safetensors").is_file():
            raise _Stopped

    with monkeypatch.context() as patched:
        patched.setattr(layerpass, "reach", stop_after_layer_1)
        with pytest.raises(_Stopped):
            _pass(model, state, tmp_path / "part")
    assert [p.name for p in (tmp_path / "part").iterdir()] == ["layer-00001.safetensors"]
    resumed, seen = _pass(model, state, tmp_path / "part")
    assert resumed == whole and seen == [0, 1, 2]  # layers 0 and 1 from the journal, layer 2 run again


def test_a_journal_keeps_each_layer_where_asked_and_a_step_may_stop_the_pass(tmp_path: Path) -> None:
    class Halving(Step[list[float]]):
        def __init__(self) -> None:
            self.ran: list[int] = []

        def stopped(self) -> bool:
            return len(self.ran) == 2

        def layer(self, index: int, hidden: Hidden) -> Hidden:
            self.ran.append(index)
            return [[h / 2 for h in model] for model in hidden]

        def finish(self, hidden: Hidden) -> list[float]:
            return [float(h.sum()) for h in hidden[0]]

    entering = [[torch.ones(1, 2, 4)]]
    kept = Journal(tmp_path / "kept", "step-", hidden="h.{s}", keeps_older=True)
    assert LayerPass(kept, 4, point="after_router_layer", carries=None).run(Halving(), entering, 1) is None
    assert sorted(p.name for p in kept.folder.iterdir()) == ["step-00000.safetensors", "step-00001.safetensors"]
    assert set(kept.read(1)) == {"h.0"} and float(kept.read(1)["h.0"].sum()) == 2.0
    restart = kept.restart(1, 1)
    assert restart.layer == 2 and restart.hidden is not None and float(restart.hidden[0][0].sum()) == 2.0
    kept.clear()
    assert not list(kept.folder.iterdir())

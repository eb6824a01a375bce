"""Each layer step of a forward pass (``check``, ``eval``, ``evolve``, ``measure``) runs with torch's generators
seeded by the layer's index and put back after it (resumerge.forward.job.placement): a layer that draws at random
draws the same numbers in every model and on a resumed pass (tests/check/test_reversible_layers.py, Reformer's LSH
attention). Only the generators the step puts back are seeded: ``torch.manual_seed`` seeds every kind of device's and
queues, for each one not yet initialised, the seed with its caller's formatted stack (2-6 ms a step, more than a tiny
model's layer; ``check`` of SmolLM2 makes 90 such steps for three models), and the seed it left for a GPU applied to
that GPU once first used after the pass."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from resumerge.forward.job import placement


def test_a_layer_step_draws_from_its_index_and_puts_the_generator_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def every_device(seed: int) -> Any:
        raise AssertionError("torch.manual_seed seeds (or queues seeds for) generators the step does not put back")

    monkeypatch.setattr(torch, "manual_seed", every_device)
    torch.rand(1)  # the process's generator somewhere past its start
    before = torch.get_rng_state()
    drawn = []
    for index in (5, 5, 6):
        with placement._seeded(cast(Any, SimpleNamespace(device=torch.device("cpu"))), index):
            drawn.append(torch.rand(4))
        assert torch.equal(torch.get_rng_state(), before)  # put back as it was
    assert torch.equal(drawn[0], torch.rand(4, generator=torch.Generator().manual_seed(5)))
    assert torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[0], drawn[2])

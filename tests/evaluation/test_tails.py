"""The continuations' answers streamed over the head's row blocks (:mod:`resumerge.analyses.evaluation.tails`)
equal those of the whole head's log-softmax: the running log-sum-exp and first maximum across blocks, the tokens
read at the positions that predict them, several continuations of one run."""

from __future__ import annotations

from pathlib import Path

import pytest

from resumerge.analyses.evaluation.tails import tail_answers
from resumerge.config.locations import StateDir
from resumerge.forward.compared import heads
from resumerge.forward.engine.reader import Weights
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.opening.opened import open_for_pass
from resumerge.machine.torch_import import torch
from tests.evaluation.evaltasks import tiny_model


def test_answers_over_head_blocks_equal_the_whole_heads_log_softmax(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    opened = open_for_pass(str(tiny_model(tmp_path / "model")), "the model", StateDir.resolve(tmp_path / "s")).opened
    stream = ModelStream(Weights.of(opened.directory, opened.tensors), opened.config, torch.float32,
                         what="the test", key="the model")
    hidden = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(0))
    lengths = [7, 5, 2]
    with stream.head() as head:
        whole = torch.log_softmax(head(hidden).float(), dim=-1)
    # a greedy continuation (every token the whole head's argmax) beside others
    greedy = [int(t) for t in whole[0, 4:7].argmax(-1)]
    wanted = [[(1, 2, 3), tuple(greedy), (9,)], [(4, 5)], [(60, 61)]]
    monkeypatch.setattr(heads, "HEAD_BLOCK_BYTES", 16 * 32 * 4)  # blocks of 16 rows: four over the 64 tokens
    assert len(heads.head_blocks(stream) or []) == 4
    found = tail_answers(stream, hidden, lengths, wanted)
    for r, (n, row) in enumerate(zip(lengths, wanted)):
        for c, (value, is_greedy) in zip(row, found[r]):
            expected = whole[r, n - len(c):n].gather(-1, torch.tensor(c)[:, None]).sum()
            assert value == pytest.approx(float(expected), abs=1e-5)
            assert is_greedy == bool((whole[r, n - len(c):n].argmax(-1) == torch.tensor(c)).all())
    assert found[0][1][1] and not found[0][0][1]
    stream.close()


def test_the_head_step_is_a_block_of_logits_not_the_batchs_whole_vocabulary(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from resumerge.analyses.evaluation.tails import tail_step_bytes

    opened = open_for_pass(str(tiny_model(tmp_path / "model")), "the model", StateDir.resolve(tmp_path / "s")).opened
    stream = ModelStream(Weights.of(opened.directory, opened.tensors), opened.config, torch.float32,
                         what="the test", key="the model")
    runs = [list(range(20))] * 40
    monkeypatch.setattr(heads, "HEAD_BLOCK_BYTES", 16 * 32 * 4)  # blocks of 16 of the 64 rows
    assert tail_step_bytes(stream, runs) == 2 * 16 * 32 * 4 + 2 * 800 * 16 * 4 + 32 * 800
    assert tail_step_bytes(stream, runs) < heads.head_step_bytes(stream, 800, 20)
    stream.close()

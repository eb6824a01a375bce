"""Issue 87: an extraction's bytes are its plan's alone. Every truncation computes on the one thread running it,
its MKL kernels included, whatever torch's thread count, ``-j`` or the process did before (MKL split the products,
QRs and SVD of a 1024 × 2816 truncation by a thread count that followed all three), so a resume is byte-identical
whatever the moment; ``-j`` stays out of the plan, and a run planned before the threads were pinned is refused."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from resumerge import api
from resumerge.cli import commands
from resumerge.cli.commands import main
from resumerge.errors import InterruptedMerge, PlanChangedError
from resumerge.merge.methods.spec import MergeContext
from resumerge.runs.extract import planner
from resumerge.runs.extract.factors import decompose


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """main() in this process: its signal handlers left alone, torch's thread count restored afterwards."""
    monkeypatch.setattr(commands, "installed_stop_flag", lambda: (lambda: False))
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _factors(base: torch.Tensor, ft: torch.Tensor) -> bytes:
    """A module's factors as the engine's unit computes them (the plan's parameters), as bytes."""
    params = {"rank": 8, "exact": False, "seed": 1, "sv_epsilon": 0.0, "distribute_scale": True, "embedding": False,
              "threads": 1}
    a, b = decompose(MergeContext([base, ft], 0, [{}, {}], params))
    return a.numpy().tobytes() + b.numpy().tobytes()


def test_a_truncation_gives_the_same_bytes_on_any_threads(in_process: None) -> None:
    """A task vector of a real projection's shape, whose truncation MKL splits by its thread count: one thread,
    two, three, and two workers computing at once (the engine's), all give one set of bytes (issue 87: before,
    torch's thread count chose among two)."""
    g = torch.Generator().manual_seed(0)
    base = 0.02 * torch.randn(1024, 2816, generator=g)
    ft = base + 0.001 * torch.randn(1024, 2816, generator=g)
    seen = set()
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        seen.add(_factors(base, ft))
    torch.set_num_threads(2)
    both: list[bytes] = []
    workers = [threading.Thread(target=lambda: both.append(_factors(base, ft))) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(both) == 2
    assert len(seen | set(both)) == 1


def test_the_thread_count_is_not_recorded_and_any_resumes(
        tmp_path: Path, pair: Callable[[str], tuple[Path, Path]], capsys: pytest.CaptureFixture[str],
        in_process: None) -> None:
    base, ft = pair("llama")
    out, state = tmp_path / "out", tmp_path / "state"
    assert main(["extract-lora", "--model", str(ft), "--base-model", str(base), "--out-path", str(out),
                 "--max-rank", "4", "-j", "1", "-q", "--state-dir", str(state)]) == 0
    assert json.loads((out / "resumerge-manifest.json").read_text())["options"]["num_threads"] is None
    capsys.readouterr()
    assert main(["resume", str(out), "-j", "3", "--state-dir", str(state)]) == 0
    assert "started with" not in capsys.readouterr().err


def test_an_extraction_planned_before_the_threads_were_pinned_is_not_resumed(
        tmp_path: Path, pair: Callable[[str], tuple[Path, Path]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A run planned without the truncation's ``threads`` (as every extraction was before issue 87: its factors
    followed the moment's threads) and stopped is refused on resume, never finished into a mix of both."""
    base, ft = pair("llama")
    out, state = tmp_path / "out", tmp_path / "state"
    pinned = planner._lora_tensors

    def unpinned(*args: object, **kwargs: object) -> list[planner.TensorPlan]:
        from dataclasses import replace
        return [replace(tp, params=tuple(p for p in tp.params if p[0] != "threads"))
                for tp in pinned(*args, **kwargs)]  # type: ignore[arg-type]

    monkeypatch.setattr(planner, "_lora_tensors", unpinned)
    with pytest.raises(InterruptedMerge):
        api.extract_lora(str(ft), str(base), out, settings=api.Settings(state_dir=state), should_stop=lambda: True,
                         lora=api.Lora(max_rank=4))
    monkeypatch.setattr(planner, "_lora_tensors", pinned)
    with pytest.raises(PlanChangedError, match="planned differently"):
        api.resume(out, settings=api.Settings(state_dir=state))


def test_saved_whole_only_records_no_thread_count(tmp_path: Path, pair: Callable[[str], tuple[Path, Path]],
                                                  in_process: None) -> None:
    """Without a decomposed module the bytes do not follow -j: it stays out of the plan."""
    base, ft = pair("llama")
    out = tmp_path / "out"
    assert main(["extract-lora", "--model", str(ft), "--base-model", str(base), "--out-path", str(out),
                 "--max-rank", "4", "-j", "1", "-q", "--state-dir", str(tmp_path / "state"),
                 "-i", "norm"]) == 0
    assert json.loads((out / "resumerge-manifest.json").read_text())["options"]["num_threads"] is None

"""A new forward pass as a client of the one driver (resumerge.forward.job.driver), written on its public names only: a
small test analysis (each layer halves the hidden states; its answer is their sum, written last) is a job, and the
driver gives it the lock, the answer cache, the proof, the fit under admission, the journaled loop and Ctrl-C's
line, in that order: asked again it answers from what it wrote without running; interrupted after a layer it
raises InterruptedMerge naming where it stopped and the command that continues it, and driven again it resumes at
the layer its journal reached, to the same answer; a second process on its folder is refused naming the first."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from resumerge.errors import InterruptedMerge, OutputDirError
from resumerge.forward.job.driver import Fit, PassFolder, content_key, drive
from resumerge.forward.job.folder import pass_lock
from resumerge.forward.job.journal import Journal, latest
from resumerge.forward.job.layerpass import LayerPass, Reserve, Step
from resumerge.forward.text.batches import Hidden
from resumerge.machine.torch_import import torch

LAYERS = 4
ANSWER = "answer.json"


class _Halving(Step[float]):
    """Each layer halves the hidden states, admitted as the pass's ``layer`` step; after the last, their sum."""

    def __init__(self, reserve: Reserve, ran: list[str], stop_after: int | None) -> None:
        self.reserve, self.ran, self.stop_after = reserve, ran, stop_after

    def layer(self, index: int, hidden: Hidden) -> Hidden:
        if self.stop_after is not None and index > self.stop_after:
            raise KeyboardInterrupt  # Ctrl-C, once the layers up to stop_after are journaled
        with self.reserve(f"layer {index}", "layer"):
            self.ran.append(f"layer {index}")
            return [[h / 2 for h in model] for model in hidden]

    def finish(self, hidden: Hidden) -> float:
        return float(sum(h.sum() for model in hidden for h in model))


@dataclass(frozen=True)
class _HalvingJob:
    """The test analysis's job: its folder keyed by its content, its answer file the answer cache."""

    folder: PassFolder
    ran: list[str] = field(default_factory=list)
    stop_after: int | None = None

    def answered(self) -> tuple[float | None, str | None]:
        path = self.folder.path / ANSWER
        self.ran.append("answered")
        return (json.loads(path.read_text())["sum"] if path.is_file() else None), None

    def proved(self) -> str | None:
        self.ran.append("proved")
        return "nothing to prove"

    @contextmanager
    def fitted(self) -> Iterator[Fit[int]]:
        self.ran.append("fitted")
        yield Fit(budget=1 << 40, steps={"layer": 1 << 20}, ready=LAYERS)
        self.ran.append("closed")

    def run(self, ready: int, reserve: Reserve) -> float | None:
        journal = Journal(self.folder.path, "layer-")
        return LayerPass(journal, ready, point="after_check_layer", carries=None).run(
            _Halving(reserve, self.ran, self.stop_after), [[torch.ones(1, 2, 4)]], 1)

    def finish(self, found: float | None, proof: str | None) -> float:
        assert found is not None and proof == "nothing to prove"
        self.ran.append("finish")
        (self.folder.path / ANSWER).write_text(json.dumps({"sum": found}))
        Journal(self.folder.path, "layer-").clear()
        return found

    def stopped_at(self) -> str:
        found = latest(self.folder.path, "layer-")
        return f"the halving was interrupted after layer {0 if found is None else found[0] + 1} of {LAYERS}"


def _folder(root: Path) -> PassFolder:
    key = content_key([[1, 2, 3], "halving", LAYERS])[:16]
    return PassFolder(root / key, "this halving", "resumerge halve", hint="wait for it to finish")


def test_a_pass_is_a_job_the_driver_runs_in_one_order_and_answers_again_from_its_cache(tmp_path: Path) -> None:
    first = _HalvingJob(_folder(tmp_path))
    assert drive(first) == 8 / 2 ** LAYERS
    assert first.ran == ["answered", "proved", "fitted", *(f"layer {i}" for i in range(LAYERS)), "closed", "finish"]
    again = _HalvingJob(_folder(tmp_path))
    assert drive(again) == 8 / 2 ** LAYERS and again.ran == ["answered"]  # nothing proved, fitted or run


def test_ctrl_c_names_where_the_pass_stopped_and_the_command_and_the_pass_resumes_there(tmp_path: Path) -> None:
    stopped = _HalvingJob(_folder(tmp_path), stop_after=1)
    with pytest.raises(InterruptedMerge) as caught:
        drive(stopped)
    assert "the halving was interrupted after layer 2 of 4" in str(caught.value)
    assert caught.value.resume_command == "resumerge halve"
    resumed = _HalvingJob(_folder(tmp_path))
    assert drive(resumed) == 8 / 2 ** LAYERS
    assert [r for r in resumed.ran if r.startswith("layer")] == ["layer 2", "layer 3"]  # 0 and 1 from the journal


def test_a_second_process_on_the_pass_s_folder_is_refused_naming_the_first(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    with pass_lock(folder.path, folder.what, "resumerge halve (the first)", hint=folder.hint):
        second = _HalvingJob(folder)
        with pytest.raises(OutputDirError, match=r"this halving is already under way \(pid \d+: resumerge halve "
                                                 r"\(the first\)"):
            drive(second)
    assert second.ran == []

"""A search's figures do not depend on the cores of the machine it is resumed on: started on two torch threads,
killed (SIGKILL, a real process) inside its first generation's streamed pass and resumed by a process on one thread
(``OMP_NUM_THREADS=1``), it ends with the files of the same search run whole on two threads, byte for byte. A
forward pass's float sums split by thread count round otherwise (on these tiny models too: a KL of
0.007962717729 on two threads, 0.007962716593 on one), so the pass, and the search, keep the count they first
started with (``threads.json``) and compute with it on every later step: the layer the resumed pass runs next, and
the second generation, scored wholly after the resume.

Tiny generated models (two layers, width 32): two processes of a few seconds each, and the whole search here."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from resumerge import api
from tests.evolve.test_kills import _args
from tests.evolve.test_search import FILES, OPTIONS, make_search
from tests.support import cli, torch_threads


def test_a_search_killed_on_two_threads_and_resumed_on_one_scores_as_the_two_thread_search_run_whole(
        tmp_path: Path) -> None:
    config = make_search(tmp_path)
    whole = tmp_path / "whole"
    with torch_threads(2):
        api.evolve(config, whole, search=api.Search(**OPTIONS))
    killed = tmp_path / "killed"
    # A fresh interpreter each (OMP_NUM_THREADS is read as torch loads): two threads, killed in generation 1's pass
    # after its first layer; then one thread, which resumes that pass at its second layer and scores generation 2.
    done = cli(*_args(config, killed), env={"RESUMERGE_KILL_AT": "after_check_layer:1", "OMP_NUM_THREADS": "2"},
               timeout=600)
    assert done.returncode == -9, done.stderr[-2000:]
    status = api.evolve_status(killed)
    assert status.threads == 2 and status.state == "interrupted"
    assert "scored with 2 torch threads (decided at its first start, kept on a resume)" in status.lines()
    passes = list((killed / "work").glob("generation-0001/*/threads.json"))
    assert [json.loads(p.read_text()) for p in passes] == [{"threads": 2}]  # the pass's own record, beside its journal
    done = cli(*_args(config, killed), env={"OMP_NUM_THREADS": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in FILES:
        assert (killed / name).read_bytes() == (whole / name).read_bytes(), name
    assert sorted(p.name for p in killed.iterdir()) == sorted(p.name for p in whole.iterdir())
    assert json.loads((killed / "threads.json").read_text()) == {"threads": 2}


def test_a_pass_computes_with_the_count_its_folder_records_and_puts_the_thread_s_count_back(tmp_path: Path) -> None:
    # The driver's scope: the count recorded at the pass's first start wins over the process's, and the calling
    # thread's count is the process's again after it (a notebook's later kernels, conftest's restore).
    from resumerge.forward.job.threads import pass_threads

    (tmp_path / "threads.json").write_text(json.dumps({"threads": 1}))
    with torch_threads(2):
        with pass_threads(tmp_path / "threads.json") as count:
            assert count == 1 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        fresh = tmp_path / "fresh"
        with pass_threads(fresh / "threads.json") as count:
            assert count == 2 and torch.get_num_threads() == 2
        assert json.loads((fresh / "threads.json").read_text()) == {"threads": 2}

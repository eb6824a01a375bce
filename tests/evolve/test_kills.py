"""A search killed anywhere resumes and ends with the same table and ``best.yml``, byte for byte: one search is
killed (SIGKILL, real subprocesses) at one point after another — inside a generation's streamed pass (after a
layer; twice in one pass, the second time resumed), after one candidate's figures are journaled but not the
other's, between generations, and while ``best.yml``'s temp file is written — each kill resumed by the next
process, and the last start, unkilled (in the test's process, through the CLI's main), ends the search. Its files
equal those of the same search run whole.

Tiny generated models (two layers, width 32): six killed processes of a few seconds each."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from resumerge import api
from tests.evolve.test_search import FILES, OPTIONS, make_search
from tests.support import cli, cli_here

# Each kill counts from its process's start: the process resumes where the last one died, then dies here.
# A generation is one pass over the two layers for all three tasks. 1: in generation 1's pass, after its first
# layer; 2: that pass resumed at its second layer and killed after it (every layer journaled, no head run); 3:
# after candidate 0's figures are journaled (not candidate 1's); 4: candidate 1 scored alone, killed once
# generation 1 is durable; 5: in generation 2's pass, after its second layer; 6: the files rewritten at its start
# (best.yml once), generation 2 scored, killed writing best.yml again, the table already holding all four rows.
KILLS = ("after_check_layer:1", "after_check_layer:1", "after_evolve_candidate:1", "after_evolve_generation:1",
         "after_check_layer:2", "during_best_write:2")


def _args(config: Path, store: Path) -> tuple[str | Path, ...]:
    return ("evolve", config, store, "--max-fevals", str(OPTIONS["max_fevals"]), "--popsize", str(OPTIONS["popsize"]),
            "--random-seed", str(OPTIONS["random_seed"]))


def _evolve(config: Path, store: Path, kill: str) -> subprocess.CompletedProcess[str]:
    # A process of its own (support.cli: forked from the worker's fork server, torch imported once), killed for real.
    return cli(*_args(config, store), env={"RESUMERGE_KILL_AT": kill}, timeout=600)


@pytest.mark.slow
def test_a_search_killed_at_every_kind_of_point_ends_with_the_same_files(tmp_path: Path) -> None:
    config = make_search(tmp_path)
    whole = tmp_path / "whole"
    api.evolve(config, whole, search=api.Search(**OPTIONS))
    killed = tmp_path / "killed"
    for number, kill in enumerate(KILLS):
        done = _evolve(config, killed, kill)
        assert done.returncode == -9, (kill, done.returncode, done.stderr[-2000:])
        if number == 4:  # killed inside the second generation's first pass, after its second layer
            status = api.evolve_status(killed)
            assert (status.generation, status.generations, status.candidates, status.evaluated) == (2, 2, [1, 2], 2)
            assert status.best is not None and status.state == "interrupted" and not status.finished
            assert status.lines()[1] == ("candidates 1-2 of 2, score kl:a:a.txt, kl:b:b.txt, nll:b.txt (all "
                                         "candidates), layer 2 of 2")
            assert status.resume_command == shlex.join(["resumerge", *map(str, _args(config, killed))])
    assert (killed / "evaluations.jsonl").read_text().count("\n") == 4
    assert any(p.name.startswith(".best.yml.") for p in killed.iterdir())  # its temp file, left by the kill
    # The last start, unkilled, ends the search: the CLI's main in this process (support.cli_here), the kills before
    # it real processes; every file it reads, the journal and the state, is on disk as the last kill left it.
    done = cli_here(*_args(config, killed))
    assert done.returncode == 0, done.stderr[-2000:]
    for name in FILES:
        assert (killed / name).read_bytes() == (whole / name).read_bytes(), name
    assert sorted(p.name for p in killed.iterdir()) == sorted(p.name for p in whole.iterdir())


def test_ctrl_c_in_a_generation_s_pass_names_the_layers_it_kept_and_the_command_that_continues_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C is the pass driver's: where the generation's pass stopped, and the search's own command, exit 3.
    from resumerge.runs.evolve.generation import GenerationPass

    layer = GenerationPass.layer

    def interrupted(step: GenerationPass, index: int, hidden: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        if index == 1:  # the first layer journaled, Ctrl-C in the second
            raise KeyboardInterrupt
        return layer(step, index, hidden)

    monkeypatch.setattr(GenerationPass, "layer", interrupted)
    config = make_search(tmp_path)
    store = tmp_path / "s"
    done = cli_here(*_args(config, store))
    command = shlex.join(["resumerge", *map(str, _args(config, store))])
    assert done.returncode == 3, done.stderr[-2000:]
    assert "generation-0001" in done.stderr and "layers 1-1 journaled" in done.stderr, done.stderr
    assert f"finish it with: {command}" in done.stderr, done.stderr
    monkeypatch.setattr(GenerationPass, "layer", layer)
    assert cli_here(*_args(config, store)).returncode == 0  # and it does

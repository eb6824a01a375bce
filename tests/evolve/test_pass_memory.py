"""A search under a tight ``--max-memory`` stays under it: the generation's streamed pass is judged before its first
weight is read (refused in one line, exit 2, naming the smallest budget that fits), and run under that budget its
steps are admitted by the RAM governor and the process's peak RSS (the OS's ``VmHWM``, measured in the search's own
process) stays within it.

Models with a large vocabulary beside small layers (the heads are the pass's largest step: a pass holding every
candidate's head at once, as the pass before this one did, would hold four of them). Two processes: the refusal (a
few seconds), the search (one generation of four)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from resumerge import api
from resumerge.api.evolution import _fits, plan_evolve
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.locations import StateDir
from resumerge.errors import UsageError
from resumerge.machine.memory import parse_size
from resumerge.runs.evolve.search import SearchOptions

SPEC = ModelSpec(layers=2, hidden=128, intermediate=192, vocab=16000)
POPSIZE = 4
CHILD = """
import sys
from resumerge.cli.commands import main
from resumerge.machine.memory import os_peak_rss
code = main(sys.argv[1:])
print("peak", os_peak_rss(), flush=True)
sys.exit(code)
"""


def _search(root: Path) -> Path:
    for i, name in enumerate(("base", "a", "b")):
        make_model(root / name, SPEC, seed=i)
    (root / "a.txt").write_text("the cat sat on the mat\nhello world again and again\n")
    (root / "b.txt").write_text("one two three four five six\n")
    config = root / "evolve.yml"
    config.write_text(yaml.safe_dump({
        "genome": {"models": [str(root / "a"), str(root / "b")], "merge_method": "ties",
                   "base_model": str(root / "base"), "layer_granularity": 1},
        "tasks": [{"kl": {"parent": str(root / "a"), "texts": str(root / "a.txt")}},
                  {"nll": {"texts": str(root / "b.txt")}}]}))
    return config


def _evolve(config: Path, store: Path, budget: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("RESUMERGE_KILL_AT", None)
    return subprocess.run([sys.executable, "-c", CHILD, "evolve", str(config), str(store), "--popsize", str(POPSIZE),
                           "--max-fevals", str(POPSIZE), "--max-memory", budget],
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_search_under_a_tight_budget_stays_within_it(tmp_path: Path) -> None:
    config = _search(tmp_path)
    planned, plan = plan_evolve(config, SearchOptions(POPSIZE, POPSIZE), False, api.plan_merge, StateDir.resolve())
    with pytest.raises(UsageError) as refused:  # the generation's own bytes, judged from the plan
        _fits(planned, plan, "1MB")
    named = re.search(r"--max-memory (\S+)", refused.value.hint or "")
    assert named is not None, refused.value
    # Its own bytes fit; beside what the process holds they do not: the pass refuses before any weight is read.
    store = tmp_path / "store"
    done = _evolve(config, store, named[1])
    # the search's progress lines (the pass refuses once the search has begun) aside
    err = "\n".join(x for x in done.stderr.strip().splitlines() if not x.startswith("evolve: "))
    assert done.returncode == 2 and len(err.splitlines()) == 1, err
    assert "the generation's streamed pass needs" in err, err
    smallest = re.search(r"rerun with --max-memory (\S+) or more", err)
    assert smallest is not None, err
    assert not (store / "evaluations.jsonl").exists()
    done = _evolve(config, store, smallest[1])
    assert done.returncode == 0, done.stderr[-3000:]
    peak = int(re.findall(r"^peak (\d+)$", done.stdout, re.M)[-1])
    budget = parse_size(smallest[1])
    assert peak <= budget, (peak, budget)
    assert (store / "evaluations.jsonl").read_text().count("\n") == POPSIZE


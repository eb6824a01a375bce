"""The objective is mergekit-evolve's weighting (a figure to maximise counts up, KL and NLL count down), a broken
candidate ranks below every finite one, and STORAGE's files stay strict JSON (a non-finite figure is ``null``, an
empty CSV cell) with the best of equals the first."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from resumerge.runs.evolve import storage
from resumerge.runs.evolve.objective import BROKEN, objective
from resumerge.runs.evolve.spec import Task
from resumerge.runs.evolve.storage import Evaluated

TASKS = (Task("lm-eval", "tiny_mc", 2.0), Task("kl", "kl:a", 0.5, "kl", "a", "t"), Task("nll", "nll:t", 1.0, "nll",
                                                                                        None, "t"))


def test_acc_counts_up_kl_and_nll_count_down_and_nan_is_worst() -> None:
    assert objective(TASKS, {"tiny_mc": 0.75, "kl:a": 0.2, "nll:t": 3.0}) == -1.5 + 0.1 + 3.0
    assert objective(TASKS, {"tiny_mc": 0.75, "kl:a": math.nan, "nll:t": 3.0}) == BROKEN
    assert objective(TASKS, {"tiny_mc": 1.0, "kl:a": 0.0, "nll:t": math.inf}) == BROKEN


def test_the_files_are_strict_json_and_the_best_of_equals_is_the_first(tmp_path: Path) -> None:
    rows = [Evaluated(1, 0, [0.1], {"merge_method": "linear"}, 1.0, {"kl:a": 0.5}),
            Evaluated(1, 1, [0.2], {"merge_method": "linear"}, BROKEN, {"kl:a": None}),
            Evaluated(2, 0, [0.3], {"merge_method": "linear"}, 1.0, {"kl:a": 0.25})]
    storage.write_outputs(tmp_path, [rows[:2], rows[2:]], ["kl:a"])
    lines = (tmp_path / "evaluations.jsonl").read_text().splitlines()
    assert json.loads(lines[1], parse_constant=lambda c: 1 / 0)["tasks"] == {"kl:a": None}  # no NaN token
    with (tmp_path / "evaluations.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [r["kl:a"] for r in table] == ["0.5", "", "0.25"] and table[2]["x0"] == "0.3"
    best = storage.best_of([rows[:2], rows[2:]])
    assert best is not None and (best.generation, best.index) == (1, 0)
    assert (tmp_path / "best.yml").read_text().startswith("# resumerge evolve: the best of 3 candidates "
                                                           "(generation 1, candidate 1), objective 1.0\n")

"""A reduced crash soak in CI: random SIGKILLs and resumes on a randomised method (dare_ties, bfloat16) and a
float16-output ties merge with small shards; every trial must end byte-identical to the reference run.

The full soak (seven scenarios, hundreds of kills) is ``python bench/crash_soak.py``; this runs its code with one
trial per scenario, whatever the machine's load (a time budget let a loaded machine run one trial where a quiet one
ran two). The seed gives each trial three killed starts, the first at a commit-protocol kill point in both
scenarios (after the second directory fsync; after the first temp write), so at least two kills land on any machine.
Each killed start is forked from the worker's fork server (support.cli_start: a real process of its own, which the
soak's SIGKILL kills as it would a fresh interpreter) rather than a fresh interpreter importing torch again; what the
soak proves is the resume after the kill, not the interpreter's start.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from support import cli_start

BENCH = Path(__file__).resolve().parents[1] / "bench" / "crash_soak.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("crash_soak", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["crash_soak"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_random_kills_then_resume_are_byte_identical(tmp_path: Path) -> None:
    soak = _load()
    lines: list[str] = []

    def forked(command: list[str], env: dict[str, str]) -> Any:
        assert command[:3] == [sys.executable, "-m", "resumerge"], command
        return cli_start(*command[3:], env=env, capture=True)

    rows = soak.soak(["dare_ties-bf16-60k", "ties-f16-40k"], trials=1, seed=166, work=tmp_path, report=lines.append,
                     start=forked)
    problems = [p for row in rows for p in row.problems]
    assert not problems, "\n".join(problems)
    assert all(row.trials == 1 and row.identical == row.trials for row in rows), soak.table(rows)
    assert sum(row.kills for row in rows) >= 2, soak.table(rows)

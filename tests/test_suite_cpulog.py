"""The suite's CPU log (tests/conftest.py, RESUMERGE_TEST_CPULOG) and its summary (bench/suite_cpu.py) count the CPU of
every process of a cgroup where RESUMERGE_TEST_CGROUP names one: Ray's raylets, agents and workers, which neither the
test's worker nor what it reaped nor its fork servers' commands include (the Ray tests' "waits" were their CPU)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
from conftest import _cpu_now

SUITE_CPU = Path(__file__).resolve().parents[1] / "bench" / "suite_cpu.py"


def test_each_test_s_line_has_its_cgroup_s_cpu_where_one_is_named(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cpuacct.usage").write_text("2500000000\n")  # nanoseconds, as cgroup v1's cpuacct says them
    monkeypatch.setenv("RESUMERGE_TEST_CGROUP", str(tmp_path))
    assert _cpu_now()["group"] == 2.5
    monkeypatch.delenv("RESUMERGE_TEST_CGROUP")
    assert "group" not in _cpu_now()


def _summary(log: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(sys, "argv", [str(SUITE_CPU), str(log), "--top", "5"])
    runpy.run_path(str(SUITE_CPU), run_name="__main__")
    return capsys.readouterr().out


def test_the_summary_counts_the_cgroup_s_cpu_where_the_log_has_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "cpu.jsonl"
    rows = [{"test": "tests/test_ray.py::test_a", "self": 1.0, "children": 0.5, "forked": 0.5, "group": 8.0,
             "wall": 10.0, "worker": "main"},
            {"test": "tests/test_local.py::test_b", "self": 1.0, "children": 0.0, "forked": 0.0, "wall": 1.5,
             "worker": "main"}]
    log.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = _summary(log, capsys, monkeypatch)
    assert "2 tests, 9 CPU s" in out and "the cgroup's every process 8" in out, out
    assert "8.0 s  tests/test_ray.py::test_a" in out, out  # the Ray processes' CPU, not the worker's 2 s
    # its wait measured against all of its processes' CPU: 2 s, not 8
    assert "2.0 s  tests/test_ray.py::test_a  (wall 10.0 s, CPU 8.0 s)" in out, out

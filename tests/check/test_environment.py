"""A check leaves the process's environment as it found it: ``OMP_WAIT_POLICY=PASSIVE`` is set only for the call,
where torch (whose OpenMP reads it as it loads) is not imported yet, and put back after, however the call ends."""

from __future__ import annotations

import os
import sys

import pytest

from resumerge.analyses.check.run import _passive_threads


def test_the_openmp_wait_policy_is_set_for_the_call_and_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as in a fresh CLI process
    with _passive_threads():
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in os.environ
    with pytest.raises(KeyError), _passive_threads():
        raise KeyError("the check failed")
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's own setting wins, and stays
    with _passive_threads():
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"

"""The stored plan is read back by an unpickler that builds only the plan's own records (never a named callable)."""

from __future__ import annotations

import os
import pickle
import zlib
from pathlib import Path

from resumerge.merge.engine import frozenplan


class _Hostile:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch pwned",))


def test_a_tampered_stored_plan_is_planned_again_and_never_run(tmp_path: Path, monkeypatch: object) -> None:
    os.chdir(tmp_path)
    key = frozenplan._key({})
    stored = (key, zlib.compress(pickle.dumps(_Hostile())))
    assert frozenplan.thaw(stored, {}, "fingerprint") is None
    assert not (tmp_path / "pwned").exists()

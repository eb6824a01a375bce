"""The stored plan is read back by an unpickler that builds only the plan's own records (never a named callable)."""

from __future__ import annotations

import importlib
import os
import pickle
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

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


def _subclass(original: type, added: dict[str, str]) -> type:
    """A frozen dataclass of ``original``'s name and module with the fields ``added`` (name: annotation) after its
    own, each defaulting to 0: what a build that adds a field to it makes."""
    body = {"__annotations__": added, **dict.fromkeys(added, 0), "__module__": original.__module__,
            "__qualname__": original.__qualname__}
    return dataclass(frozen=True)(type(original.__name__, (original,), body))


@pytest.mark.parametrize(("module", "name"), [("resumerge.merge.plan.merge_plan", "ExpertStack"),
                                              ("resumerge.merge.plan.merge_plan", "LayerBlocks"),
                                              ("resumerge.merge.vocab", "VocabAlignment")])
def test_a_changed_field_of_any_dataclass_a_plan_holds_is_another_stored_layout(
        module: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor's ExpertStack and LayerBlocks and the plan's VocabAlignment are stored with the plan as its own
    records are: a build whose class has another field never reads a plan stored by this one (its key differs),
    while the same fields under a new class object are the same layout."""
    target = importlib.import_module(module)
    original = getattr(target, name)
    before = frozenplan._key({})
    try:
        monkeypatch.setattr(target, name, _subclass(original, {}))
        assert _fresh_key() == before
        monkeypatch.setattr(target, name, _subclass(original, {"added": "int"}))
        assert _fresh_key() != before
    finally:
        monkeypatch.undo()
        frozenplan.layout.cache_clear()


def _fresh_key() -> str:
    """The stored plans' key as a build of the classes as they are now computes it."""
    frozenplan.layout.cache_clear()
    return frozenplan._key({})

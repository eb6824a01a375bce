"""One way to give a call its options (issue 97, item 9): every call of resumerge.api takes one ``Settings``, as
``run`` does, and a keyword a call took before (the ``state_dir=`` of last week's notebooks) is refused with the
spelling that replaced it, exit 2, not with Python's bare TypeError."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import ModelFactory
from support import write_config

from resumerge import api
from resumerge.errors import EXIT_INVALID, UsageError, exit_code_for


@pytest.mark.parametrize(("call", "args", "old"), [
    (api.run, ("c.yml", "out"), {"state_dir": "s"}),
    (api.resume, ("out",), {"state_dir": "s"}),
    (api.status, ("out",), {"state_dir": "s"}),
    (api.verify, ("out",), {"state_dir": "s"}),
    (api.check, ("model",), {"resources": api.Resources(max_memory="1GB"), "state_dir": "s"}),
    (api.measure, ("c.yml", "grams"), {"executor": None}),
    (api.plan_merge, ("c.yml",), {"output": api.Output()}),
    (api.open_unwritten, ("c.yml",), {"merging": api.Merging()}),
    (api.evaluate, ("model", "tiny"), {"state_dir": "s"}),
], ids=lambda v: getattr(v, "__name__", None))
def test_an_old_keyword_is_refused_with_the_new_spelling(call: Callable[..., Any], args: tuple[str, ...],
                                                         old: dict[str, Any], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # nothing named exists: the refusal comes before anything is read
    with pytest.raises(UsageError) as refused:
        call(*args, **old)
    name = call.__name__
    assert exit_code_for(refused.value) == EXIT_INVALID
    line = str(refused.value)
    assert f"{name}() takes {' and '.join(old)} inside its settings now" in line, line
    assert f"{name}(..., settings=Settings({', '.join(f'{k}=...' for k in old)}))" in line, line
    assert not list(tmp_path.iterdir())


def test_status_and_verify_take_the_settings_run_took(tmp_path: Path, make: ModelFactory) -> None:
    settings = api.Settings(state_dir=tmp_path / "state")
    config = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "models": [str(make("a"))]})
    api.run(config, tmp_path / "out", settings)
    assert api.status(tmp_path / "out", settings).state == "done"
    assert api.verify(tmp_path / "out", settings=settings).ok
    with pytest.raises(UsageError, match=r"^executor does not apply to status"):
        api.status(tmp_path / "out", api.Settings(executor=object()))  # type: ignore[arg-type]

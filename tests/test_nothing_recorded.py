"""An OUT of which nothing is recorded gets one refusal whoever asks (``status``, ``recipe_status``, ``verify``):
:class:`~resumerge.errors.NothingRecordedError`, exit 4, saying what is missing and where to look
(``NothingRecordedError.of``). A recipe's refusal was a bare LedgerError before, and ``verify``'s hint other words."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from resumerge import api
from resumerge.errors import EXIT_REFUSED, NothingRecordedError, exit_code_for


@pytest.mark.parametrize(("ask", "what"), [(api.status, "merge"), (api.recipe_status, "recipe"),
                                           (api.verify, "merge")], ids=["status", "recipe_status", "verify"])
def test_an_out_with_nothing_recorded_is_one_refusal(ask: Callable[..., Any], what: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(NothingRecordedError) as refused:
        ask(out, api.Settings(state_dir=tmp_path / "state"))
    assert refused.value.message == f"no {what} recorded for {out}"
    assert refused.value.hint == "pass the --state-dir used by the run, or check the output path"
    assert exit_code_for(refused.value) == EXIT_REFUSED

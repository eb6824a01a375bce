"""The suite never writes the user's Hugging Face cache. Libraries fix their cache paths as they are first imported
(datasets' HF_DATASETS_CACHE, trackio's store: from HF_HOME), and what imports them first may run before the test's
own ``hermetic`` fixture: a session fixture (lm-eval's task index, parsed once a worker), the fork server, the Ray head.
They see the session's HF home (conftest), never the user's; a module's fixture (a merge its tests share) sees the
session's resumerge cache and state dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

USERS = (Path.home() / ".cache" / "huggingface").resolve()


@pytest.fixture(scope="session")
def hf_home_before_hermetic() -> str | None:
    # A session fixture is set up before the first test's function-scoped fixtures, hermetic among them.
    return os.environ.get("HF_HOME")


def test_what_runs_before_a_test_s_own_fixtures_sees_the_session_s_hf_home(hf_home_before_hermetic: str | None
                                                                           ) -> None:
    assert hf_home_before_hermetic is not None, "HF_HOME unset: a library imported now caches in the user's home"
    assert not Path(hf_home_before_hermetic).resolve().is_relative_to(USERS)
    assert os.environ["HF_HOME"] != hf_home_before_hermetic  # the test itself has its own, as before


@pytest.fixture(scope="module")
def resumerge_dirs_before_hermetic() -> dict[str, str | None]:
    # A module fixture is set up before its first test's function-scoped fixtures too: where a shared merge runs.
    return {name: os.environ.get(name) for name in ("XDG_CACHE_HOME", "RESUMERGE_STATE_DIR", "XDG_STATE_HOME")}


def test_a_module_fixture_s_run_keeps_its_caches_and_state_in_the_session_s_folders(
        resumerge_dirs_before_hermetic: dict[str, str | None]) -> None:
    home = Path.home().resolve()
    for name, value in resumerge_dirs_before_hermetic.items():
        assert value is not None, f"{name} unset: a run keeps its files under the user's home"
        assert not Path(value).resolve().is_relative_to(home), f"{name} is the user's: {value}"

"""The suite never writes the user's Hugging Face cache. Libraries fix their cache paths as they are first imported
(datasets' HF_DATASETS_CACHE, trackio's store: from HF_HOME), and what imports them first may run before the test's
own ``hermetic`` fixture: a session fixture (lm-eval's task index, parsed once a worker), the fork server, the Ray head.
They see the session's HF home (conftest), never the user's."""

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

"""Shared fixtures: hermetic environment (state dir, HF cache, no network) and tiny generated models."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mergekit_oracle import Mergekit, installed

from resumerge.cli.modelgen import ModelSpec, make_model


@pytest.fixture(scope="session", autouse=True)
def bytecode_kept() -> Iterator[None]:
    """Let the suite's CLI subprocesses keep compiled bytecode. With PYTHONDONTWRITEBYTECODE set (as some CI and
    container images do), every ``python -m resumerge`` of the several hundred the suite starts compiled the whole
    package again (0.3-0.5 s each); written as usual (``__pycache__``, git-ignored), only the first one compiles."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
        yield


@pytest.fixture(autouse=True)
def hermetic(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Point every cache and the state dir at temp dirs; never touch the user's files or the network."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("RESUMERGE_STATE_DIR", str(home / "state"))
    monkeypatch.setenv("XDG_STATE_HOME", str(home / "xdg-state"))  # for tests that unset the one above
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("RESUMERGE_KILL_AT", raising=False)
    yield


ModelFactory = Callable[..., Path]


@pytest.fixture
def make(tmp_path: Path) -> ModelFactory:
    """Build a model under tmp_path/models/<name> from ModelSpec keyword arguments."""

    def build(name: str, *, seed: int = 0, **spec: object) -> Path:
        return make_model(tmp_path / "models" / name, ModelSpec(**spec), seed=seed)  # type: ignore[arg-type]

    return build


@pytest.fixture(scope="session")
def mergekit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mergekit]:
    """``mergekit-yaml`` 0.1.5 (the differential tests' oracle) in one process for this worker's whole session."""
    if not installed():
        pytest.skip("mergekit 0.1.5 is not installed (pip install -e '.[test]')")
    oracle = Mergekit(tmp_path_factory.mktemp("mergekit") / "mergekit.log")
    yield oracle
    oracle.close()

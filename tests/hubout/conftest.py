"""Fixtures for hf:// outputs: the stand-in hub with its upload side, a write token, two tiny models, and the bytes
of a local run of the same merge to compare every hub output with."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hub.conftest import hf_env  # noqa: F401  (autouse: an isolated HF home, loopback only)
from hub.fakehub import FakeHub
from hub.fakehub_write import HubWriter
from hub.fakehub_xet import XetCas
from huggingface_hub import constants

from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model
from tests.support import as_on_the_hub, linear_config, write_config

TOKEN = "hf_write_alice"
READ_TOKEN = "hf_read_alice"
SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
SHARD = "20k"


@dataclass(frozen=True)
class Merge:
    """A config over two tiny local models and the files of its local run (name -> bytes)."""

    config: Path
    reference: dict[str, bytes]


@pytest.fixture(scope="session")
def merge(tmp_path_factory: pytest.TempPathFactory) -> Merge:
    root = tmp_path_factory.mktemp("hubout")
    a = make_model(root / "a", SPEC, seed=1)
    b = make_model(root / "b", SPEC, seed=2)
    config = write_config(root / "merge.yml", linear_config(a, b, weights=([0.2, 0.8], 0.5)))
    out = root / "local-out"
    api.run(config, out, settings=api.Settings(state_dir=root / "local-state", output=api.Output(out_shard_size=SHARD)))
    return Merge(config, as_on_the_hub({p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}))



# The two upload paths of huggingface_hub: the Git-LFS batch API (HF_HUB_DISABLE_XET=1) and Xet (what a current
# install with hf-xet takes). A test runs in both with ``@pytest.mark.parametrize("tier", TIERS, indirect=True)``;
# every other hub-output test runs in the LFS tier only (the suite's time budget).
TIERS = ("lfs", "xet")


@pytest.fixture
def tier(request: pytest.FixtureRequest) -> str:
    return str(getattr(request, "param", "lfs"))


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tier: str, tmp_path: Path) -> Iterator[HubWriter]:
    """A started stand-in hub that accepts uploads; ``HF_TOKEN`` holds alice's write token (alice is in ``team``).
    In the Xet tier it hands out a ``local://`` CAS folder and the client uploads through hf_xet."""
    fake = FakeHub()
    writer = HubWriter.attach(fake)
    writer.add_token(TOKEN, "alice", orgs=("team",))
    writer.add_token(READ_TOKEN, "alice", "read", orgs=("team",))
    if tier == "xet":
        writer.cas = XetCas(tmp_path / "cas")
        monkeypatch.delenv("HF_HUB_DISABLE_XET")
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
        monkeypatch.setenv("HF_XET_CACHE", str(Path(os.environ["HF_HOME"]) / "xet"))  # hf_env's home
        # hf_xet's progress bars (the CLI turns them off); the package exports a class under the module's name.
        monkeypatch.setattr(sys.modules["huggingface_hub.utils.tqdm"], "HF_HUB_DISABLE_PROGRESS_BARS", True)
    with fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        yield writer


def repo_files(hub: HubWriter, repo_id: str, branch: str = "main") -> dict[str, bytes]:
    """What the branch head holds, minus the hub's own ``.gitattributes``."""
    return {k: v for k, v in hub.head_files(repo_id, branch).items() if k != ".gitattributes"}


def uploads(hub: HubWriter, repo_id: str) -> dict[str, int]:
    """How many times each object (by sha256) was sent to the hub: LFS PUTs to ``repo_id`` in the LFS tier; in the
    Xet tier, the shards of the CAS that register it (one per upload session that ingested it, its chunks sent or
    deduplicated; the CAS is the test's own, so it holds only this test's objects)."""
    if hub.cas is not None:
        return hub.cas.registrations()
    return {k.split("/")[-1]: v for k, v in hub.puts.items() if k.startswith(repo_id + "/")}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # huggingface_hub's LFS PUT passes the file as ``data=``, which httpx2 deprecates (a warning only, in the client's
    # own code): not ours to fix, and the suite turns warnings into errors.
    for item in items:
        if "hubout" in item.nodeid:
            item.add_marker(pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"))

"""Fixtures for the hub tests: an isolated HF home per test, a stand-in hub, generated models with decoys."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from huggingface_hub import constants

try:
    from huggingface_hub import close_session
except ImportError:  # huggingface_hub 0.x, which test_transformers4_stack.py runs this suite's core against
    from huggingface_hub.utils import reset_sessions as close_session

from support import loopback_only

from hub.fakehub import FakeHub, files_of
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.inputs.hub.download import DOWNLOAD_CHUNK

# Files a merge must never fetch: pickles, GGUF, ONNX, Flax, TF, a safetensors outside the index, docs.
DECOYS = {
    "pytorch_model.bin": b"\x80\x02pickle" + os.urandom(20_000),
    "model.gguf": b"GGUF" + os.urandom(20_000),
    "onnx/model.onnx": os.urandom(10_000),
    "flax_model.msgpack": os.urandom(10_000),
    "tf_model.h5": os.urandom(10_000),
    "README.md": b"# alpha\n",
    ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
}
SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64, shard_bytes=20_000)
REPO = "org/alpha"


@dataclass(frozen=True)
class Model:
    """A generated model as the hub serves it."""

    files: dict[str, bytes]

    @property
    def shards(self) -> list[str]:
        return sorted(p for p in self.files if p.endswith(".safetensors") and "/" not in p)

    @property
    def small(self) -> list[str]:
        return sorted(p for p in self.files if p.endswith(".json"))

    def header_bytes(self, shard: str) -> int:
        """Bytes a Range read of ``shard``'s header costs: the 8-byte length plus the header."""
        return 8 + int.from_bytes(self.files[shard][:8], "little")


def _generate(root: Path, seed: int) -> Model:
    directory = make_model(root / f"seed{seed}", SPEC, seed=seed)
    files = files_of(directory)
    # A safetensors file the index does not name must not be fetched either (Mistral's consolidated.*).
    files["original/consolidated.safetensors"] = files[sorted(p for p in files if p.endswith(".safetensors"))[0]]
    files.update(DECOYS)
    return Model(files)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Model]:
    """Two versions of the same model (seeds 0 and 1), generated once per session."""
    root = tmp_path_factory.mktemp("models")
    return _generate(root, 0), _generate(root, 1)


BIG_REPO = "org/big"


@pytest.fixture(scope="session")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """A one-shard model of 2.4 MiB, several download chunks, so an interruption can leave whole chunks on disk."""
    import torch
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("big") / "model.safetensors"
    assert DOWNLOAD_CHUNK < 2**20
    elements = int(2.4 * 2**20) // 4
    save_file({"w": torch.randn(elements, generator=torch.Generator().manual_seed(0))}, str(path))
    return Model({"config.json": b'{"num_hidden_layers": 0}', "model.safetensors": path.read_bytes()})


@pytest.fixture(autouse=True)
def hf_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Point every huggingface_hub location at a temp HF home; never the user's cache, token or network."""
    home = tmp_path / "hf_home"
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT",
                "HUGGINGFACE_HUB_CACHE", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    env = {"HF_HOME": home, "HF_HUB_CACHE": home / "hub", "HF_TOKEN_PATH": home / "token",
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_XET": "1",
           "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"}
    for var, value in env.items():
        monkeypatch.setenv(var, str(value))
    # huggingface_hub read these at import; patch the module constants too.
    for name, value in {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
                        "HF_TOKEN_PATH": str(home / "token"), "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
                        "HF_HUB_OFFLINE": False, "HF_HUB_DISABLE_XET": True,
                        "HF_HUB_DISABLE_TELEMETRY": True}.items():
        if hasattr(constants, name):
            monkeypatch.setattr(constants, name, value)
    loopback_only(monkeypatch)
    yield home
    close_session()  # drop pooled connections to this test's hub


@pytest.fixture
def hub(models: tuple[Model, Model], big_model: Model, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A started stand-in hub serving ``org/alpha`` (seed 0) and ``org/big``, with ``HF_ENDPOINT`` at it."""
    fake = FakeHub()
    fake.push(REPO, models[0].files)
    fake.push(BIG_REPO, big_model.files)
    with fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """The resumerge state dir that keeps verification records."""
    return tmp_path / "state"

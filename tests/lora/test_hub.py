"""Hub-hosted adapters: pinned commit, only the adapter's own files fetched and verified, offline from the cache."""

from __future__ import annotations

import hashlib
import pickle
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from hub.conftest import hf_env  # noqa: F401  (autouse here: a temp HF home, loopback-only network)
from hub.fakehub import FakeHub, files_of, iter_requests

from lora.gen import make_adapter
from resumerge.config.modelref import ModelRef
from resumerge.errors import ModelInputError, exit_code_for
from resumerge.inputs.adapters import open_adapter
from resumerge.inputs.hub.adapters import open_hub_adapter

REPO = "org/lora"
ALLOWED = {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json"}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, llama_base: Path) -> tuple[Path, Path]:
    """Two versions of an adapter with a tokenizer (seeds 0 and 1)."""
    root = tmp_path_factory.mktemp("hub-adapters")
    for seed in (0, 1):
        make_adapter(llama_base, root / f"v{seed}", r=2, alpha=4, targets=["q_proj", "down_proj"], seed=seed,
                     tokenizer_from=llama_base)
    return root / "v0", root / "v1"


@pytest.fixture
def hub(adapters: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    fake = FakeHub()
    files = files_of(adapters[0])
    # Never fetched: a pickle of the same adapter, training state, a checkpoint folder's copy.
    files["adapter_model.bin"] = pickle.dumps({"weights": b"x" * 5000})
    files["training_args.bin"] = pickle.dumps({"lr": 1e-4})
    files["checkpoint-10/adapter_model.safetensors"] = files["adapter_model.safetensors"]
    fake.push(REPO, files)
    fake.push("org/pickled", {"adapter_config.json": files["adapter_config.json"],
                              "adapter_model.bin": files["adapter_model.bin"]})
    fake.push("org/model", {"config.json": b"{}", "model.safetensors": files["adapter_model.safetensors"]})
    with fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


def test_hub_adapter_is_pinned_verified_and_works_offline(
    hub: FakeHub, adapters: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    adapter = open_hub_adapter(ModelRef(REPO), yaml_path="models[0].model", records_dir=state)
    commit = hub.commit_of(REPO, "main")
    assert commit is not None
    assert re.search(rf"/snapshots/{commit}$", str(adapter.directory))
    local = open_adapter(adapters[0], yaml_path="")
    assert {n: (t.rank, t.scale) for n, t in adapter.targets.items()} == {
        n: (t.rank, t.scale) for n, t in local.targets.items()}
    assert adapter.tokenizer == local.tokenizer and adapter.has_tokenizer
    weights = (adapters[0] / "adapter_model.safetensors").read_bytes()
    assert adapter.files[0].identity == hashlib.sha256(weights).hexdigest()
    assert adapter.files[0].size == len(weights)
    served = {key.removeprefix(f"{REPO}/") for key in hub.file_bytes()}
    assert "adapter_model.safetensors" in served and served <= ALLOWED, served

    # The branch moves on: a resume that passes the pinned commit still gets the first version.
    hub.push(REPO, files_of(adapters[1]))
    moved = open_hub_adapter(ModelRef(REPO), yaml_path="", records_dir=state)
    assert moved.digest != adapter.digest
    pinned = open_hub_adapter(ModelRef(REPO), yaml_path="", records_dir=state, pinned_commit=commit)
    assert pinned.digest == adapter.digest and pinned.directory == adapter.directory

    # Offline, everything comes from the verified cache without a single request.
    hub.reset_counters()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = open_hub_adapter(ModelRef(REPO), yaml_path="", records_dir=state, pinned_commit=commit)
    assert again.digest == adapter.digest
    assert list(iter_requests(hub)) == []


def test_pickle_only_hub_adapter_is_refused_unfetched(hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(ModelInputError) as info:
        open_hub_adapter(ModelRef("org/pickled"), yaml_path="models[1].model", records_dir=tmp_path / "state")
    assert exit_code_for(info.value) == 2
    assert info.value.one_line().startswith("models[1].model: ") and "pickled" in info.value.one_line()
    assert not any(key.endswith(".bin") for key in hub.file_bytes())


def test_hub_model_given_as_adapter_is_refused(hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(ModelInputError) as info:
        open_hub_adapter(ModelRef("org/model"), yaml_path="base_model", records_dir=tmp_path / "state")
    line = info.value.one_line()
    assert "not a PEFT adapter" in line and "full model" in line and line.startswith("base_model: ")

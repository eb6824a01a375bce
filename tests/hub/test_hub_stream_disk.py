"""--stream-inputs with an hf:// OUT under --max-disk: inputs ten times the budget merge within it (issue 15)."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from pathlib import Path

import pytest
from support import write_config

from hub.fakehub import FakeHub, files_of
from hub.fakehub_write import HubWriter
from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.locations import run_dir
from resumerge.errors import UsageError

SPEC = ModelSpec(layers=4, hidden=64, intermediate=128, vocab=256)
BUDGET = 110_000


def _disk_use(*roots: Path) -> int:
    """Bytes of the files under ``roots`` (a snapshot's links to blobs are not counted twice)."""
    total = 0
    for root in roots:
        # os.walk skips a folder that vanishes while it is listed (a download's temp folder); rglob raised.
        for folder, _, names in os.walk(root):
            for name in names:
                with contextlib.suppress(FileNotFoundError):  # a staged file committed and deleted meanwhile
                    st = os.lstat(os.path.join(folder, name))
                    total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


@pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")  # huggingface_hub's LFS upload
def test_inputs_ten_times_the_budget_merge_under_it(tmp_path: Path, hf_env: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = make_model(tmp_path / "a", SPEC, seed=1), make_model(tmp_path / "b", SPEC, seed=2)
    inputs = sum(p.stat().st_size for m in (a, b) for p in m.glob("*.safetensors"))
    assert inputs >= 10 * BUDGET
    doc = {"merge_method": "linear", "dtype": "float32",
           "models": [{"model": "org/a", "parameters": {"weight": 0.4}}, {"model": "org/b",
                                                                          "parameters": {"weight": 0.6}}]}
    local = {"merge_method": "linear", "dtype": "float32",
             "models": [{"model": str(a), "parameters": {"weight": 0.4}}, {"model": str(b),
                                                                           "parameters": {"weight": 0.6}}]}
    api.run(write_config(tmp_path / "local.yml", local), tmp_path / "ref",
            settings=api.Settings(state_dir=tmp_path / "s0", output=api.Output(out_shard_size="50k")))
    fake = FakeHub()
    writer = HubWriter.attach(fake)
    writer.add_token("hf_w", "alice")
    fake.push("org/a", files_of(a))
    fake.push("org/b", files_of(b))
    state = tmp_path / "state"
    staging = run_dir("hf://alice/streamed", state) / "staging"
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _disk_use(hf_env, staging))
            stop.wait(0.002)

    with fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.setenv("HF_TOKEN", "hf_w")
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            api.run(write_config(tmp_path / "c.yml", doc), "hf://alice/streamed",
                    settings=api.Settings(state_dir=state, output=api.Output(out_shard_size="50k"),
                                          resources=api.Resources(max_disk=BUDGET,
                                                                  stream_inputs=True), hub=api.Hub(commit_every=1)))
        finally:
            stop.set()
            sampler.join()
        got = {k: v for k, v in writer.head_files("alice/streamed").items() if k.endswith(".safetensors")}
        # A budget the inputs' own cache files leave too little of is refused before any weight is fetched.
        fake.reset_counters()
        with pytest.raises(UsageError, match="hub inputs kept on disk"):
            api.run(tmp_path / "c.yml", "hf://alice/other",
                    api.Settings(state_dir=state, output=api.Output(out_shard_size="50k"),
                                 resources=api.Resources(max_disk=70_000)))
        headers = sum(8 + int.from_bytes(p.read_bytes()[:8], "little") for m in (a, b) for p in m.glob("*.safetensors"))
        assert sum(v for k, v in fake.file_bytes().items() if k.endswith(".safetensors")) == headers
    want = {p.name: p.read_bytes() for p in (tmp_path / "ref").glob("*.safetensors")}
    assert got == want
    assert 0 < peak[0] < BUDGET, peak[0]

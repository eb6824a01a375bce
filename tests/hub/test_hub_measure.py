"""``resumerge measure`` of hub models (``org/NAME`` in the config, read by HTTP Range through the forward engine's
one opener): killed (a real SIGKILL) after its third layer and run again under ``--max-memory``, it ends with the
Gram files a measurement of the same models as local folders writes, byte for byte, never downloading a weight
file whole; its journal is kept under the state dir and gone once it is done."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import cli, cli_here, digests, write_config

from hub.conftest import SPEC, Model
from hub.fakehub import FakeHub, files_of
from resumerge import api
from resumerge.cli.modelgen import make_model

pytest.importorskip("transformers")

TEXTS = "The capital of France is Paris.\ndef square(x): return x * x\n"


def test_a_killed_measure_of_hub_models_resumes_under_max_memory_as_the_local_one(
        tmp_path: Path, hub: FakeHub, state: Path, hf_env: Path, models: tuple[Model, Model]) -> None:
    beta = make_model(tmp_path / "beta", SPEC, seed=1)
    hub.push("org/beta", files_of(beta))
    alpha = tmp_path / "alpha"  # the hub's org/alpha as a local folder
    for name, data in models[0].files.items():
        if "/" not in name and name.endswith((".json", ".safetensors")):
            (alpha / name).parent.mkdir(parents=True, exist_ok=True)
            (alpha / name).write_bytes(data)
    texts = tmp_path / "texts.txt"
    texts.write_text(TEXTS)

    def config(name: str, a: str, b: str) -> Path:
        return write_config(tmp_path / name, {"merge_method": "regmean", "models": [{"model": a}, {"model": b}],
                                              "parameters": {"grams": "grams"}, "dtype": "float32"})

    out = tmp_path / "grams"
    args = ("measure", config("hub.yml", "org/alpha", "org/beta"), out, "--texts", texts, "--max-memory", "2GB",
            "--state-dir", state)
    killed = cli(*args, env={"RESUMERGE_KILL_AT": "after_measure_layer:3"})
    assert killed.returncode == -9, killed.stderr
    assert [p.name for p in state.glob("measures/*/journal/model-01/*")] == ["hidden-00000.safetensors"]
    assert api.status(out).state == "interrupted"
    resumed = cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.count("measuring:") == 1 and "model 2 of 2, layer 2 of 2" in resumed.stderr
    assert not list(state.glob("measures/*"))  # the journal goes once measure.json is written
    assert not [p for p in (hf_env / "hub").rglob("*.safetensors")]  # read by range, never downloaded whole
    local = tmp_path / "local"
    done = cli_here("measure", config("local.yml", str(alpha), str(beta)), local, "--texts", texts,
                    "--state-dir", tmp_path / "local-state")
    assert done.returncode == 0, done.stderr
    for folder in ("model-00", "model-01"):
        assert digests(out / folder) == digests(local / folder), folder

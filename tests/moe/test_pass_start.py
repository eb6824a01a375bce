"""When the prompt work's process starts, and what it loads: a run that continues one past its gates (the pass's
routers finished in the state dir) starts no process for the pass; a process started with its job reads it first,
and one that only tokenises the prompts never loads torch's and transformers' modelling code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resumerge import api
from resumerge.config.locations import StateDir
from resumerge.errors import InterruptedMerge
from resumerge.runs.moe import load_moe_text, passproc
from resumerge.runs.moe.passdone import routers_finished
from resumerge.runs.moe.prompts import encode, load_tokenizer
from tests.moe.models import llamas, write
from tests.moe.passthread import passes_on_a_thread


def _hidden(path: Path, models: list[Path], prompt: str) -> Path:
    return write(path, {"base_model": str(models[0]), "gate_mode": "hidden",
                        "experts": [{"source_model": str(models[1]), "positive_prompts": [prompt]},
                                    {"source_model": str(models[2]), "positive_prompts": ["xy zw"]}]})


class NoPassProcess:
    def __init__(self, *_: object, **__: object) -> None:
        raise AssertionError("a prompt pass process was started")


def test_a_run_continued_past_its_gates_starts_no_pass_process(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    m = llamas(tmp_path)
    config, other = _hidden(tmp_path / "hidden.yml", m, "ab cd"), _hidden(tmp_path / "other.yml", m, "ef gh")
    out, state = tmp_path / "out", tmp_path / "state"
    where = StateDir.resolve(state).run(out)
    moe = load_moe_text(config.read_text())
    assert not routers_finished(moe, where)  # nothing recorded
    reference = tmp_path / "reference"
    with passes_on_a_thread():
        api.run(config, reference, settings=api.Settings(state_dir=tmp_path / "ref-state"))
        # stopped once the pass has written its routers: the routers' shard (the plan's last) is not committed
        with pytest.raises(InterruptedMerge):
            api.run(config, out, settings=api.Settings(state_dir=state, output=api.Output(out_shard_size="20KB")),
                    should_stop=lambda: any((state / "moe-routers").glob("*/routers.safetensors")))
    assert not (out / "model.safetensors.index.json").exists()
    assert routers_finished(moe, where)
    assert not routers_finished(load_moe_text(other.read_text()), where)  # other prompts: another pass
    monkeypatch.setattr(passproc, "PassProcess", NoPassProcess)
    api.run(config, out, settings=api.Settings(state_dir=state, output=api.Output(out_shard_size="20KB")))
    from safetensors.torch import load_file

    def routers(folder: Path) -> dict[str, object]:
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        return {n: load_file(str(folder / f))[n].tolist() for n, f in index.items() if n.endswith("mlp.gate.weight")}

    assert routers(out) == routers(reference) and routers(out)


_PROMPTS = ["ab cd", "x"]
_ENCODE = {"job": "encode", "mode": "cheap_embed", "prompts": [[_PROMPTS, None]]}


def test_a_process_given_its_job_loads_only_what_it_needs(tmp_path: Path) -> None:
    """Tokenising the prompts in a process started with its job: the same tokens as the tokenizer gives them here,
    without the modelling modules (torch's compiler, which the pass's modules import) that a process started early
    loads while it waits."""
    (base,) = llamas(tmp_path, count=1)
    job = json.dumps({**_ENCODE, "tokenizer_dir": str(base), "workdir": str(tmp_path), "parent": os.getpid()})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(Path(__file__).parents[2]),
                                                                     os.environ.get("PYTHONPATH"))))}
    said = subprocess.run([sys.executable, "-X", "importtime", "-m", "resumerge.runs.moe.passmain", str(os.getpid()),
                           passproc.JOB_GIVEN], input=job, capture_output=True, text=True, env=env, timeout=120)
    assert said.returncode == 0, said.stderr
    imported = {line.split("|")[-1].strip() for line in said.stderr.splitlines() if line.startswith("import time:")}
    assert "transformers" in imported and "torch._dynamo" not in imported
    tokenizer = load_tokenizer(base, "cheap_embed")  # as a process started early tokenises them, after its loads
    expected = {"encoded": [[encode(tokenizer, _PROMPTS), None]]}
    assert json.loads(said.stdout.splitlines()[-1])["ok"] == json.loads(json.dumps(expected))

"""A MoE merge is journaled like any merge: SIGKILL between shards or inside one, then ``resume`` (with the state
dir, or from OUT's manifest alone) ends byte-identical to an uninterrupted run; noise is drawn per tensor from the
run's seed, so it is the same after a resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import psutil
import pytest
import torch

from resumerge import api
from resumerge.merge.store.manifest import read_manifest
from resumerge.runs.moe import gatesites
from tests.moe.models import hidden_gates, llamas, tensors, write
from tests.moe.passthread import passes_on_a_thread
from tests.support import cli, cli_here, digests


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], Path]:
    root = tmp_path_factory.mktemp("moe_resume")
    m = llamas(root)
    config = write(root / "moe.yml", {
        "base_model": str(m[0]), "gate_mode": "uniform_random",
        "experts": [{"source_model": str(m[1]), "positive_prompts": ["a"], "noise_scale": 0.01},
                    {"source_model": str(m[2]), "positive_prompts": ["b"], "residual_scale": 2.0},
                    {"source_model": str(m[0]), "positive_prompts": ["c"]}]})
    reference = root / "reference"
    api.run(config, reference, settings=api.Settings(state_dir=root / "ref-state",
                                                     output=api.Output(out_shard_size="20KB"),
                                                     merging=api.Merging(random_seed=7)))
    return config, digests(reference), reference


def test_kill_then_resume_is_identical(setup: tuple[Path, dict[str, str], Path], tmp_path: Path) -> None:
    """Killed inside a shard's write, resumed with the state dir and killed again after a ledger commit, then
    resumed from OUT's manifest alone (state dir deleted): the output is the uninterrupted run's."""
    config, expected, _ = setup
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("run", config, out, "--out-shard-size", "20KB", "--random-seed", "7", "--state-dir", state,
                 "--quiet", env={"RESUMERGE_KILL_AT": "mid_shard_write:2"})
    assert killed.returncode == -9, killed.stderr
    assert digests(out) != expected
    again = cli("resume", out, "--state-dir", state, "--quiet", env={"RESUMERGE_KILL_AT": "after_ledger_commit:2"})
    assert again.returncode == -9, again.stderr
    shutil.rmtree(state)
    api.resume(out, settings=api.Settings(state_dir=state))  # never killed: in this process, an interpreter start saved
    assert digests(out) == expected


def test_noise_is_per_tensor_and_scaled(setup: tuple[Path, dict[str, str], Path]) -> None:
    _, _, reference = setup
    out = tensors(reference)
    m1 = tensors(Path(str(reference).replace("reference", "m1")))
    m0 = tensors(Path(str(reference).replace("reference", "m0")))
    m2 = tensors(Path(str(reference).replace("reference", "m2")))
    gate_up = out["model.layers.0.mlp.experts.gate_up_proj"]
    rows = m1["model.layers.0.mlp.gate_proj.weight"].shape[0]
    noise = gate_up[0, :rows] - m1["model.layers.0.mlp.gate_proj.weight"]
    assert 0.008 < float(noise.std()) < 0.012 and abs(float(noise.mean())) < 0.002
    other = out["model.layers.1.mlp.experts.gate_up_proj"][0, :rows] - m1["model.layers.1.mlp.gate_proj.weight"]
    assert not torch.equal(noise, other)  # each tensor draws its own noise
    down = out["model.layers.0.mlp.experts.down_proj"]
    assert torch.equal(down[1], 2.0 * m2["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(down[2], m0["model.layers.0.mlp.down_proj.weight"])


_RUN_AND_LOOK = """
import sys
from resumerge import api
api.run(sys.argv[1], sys.argv[2], api.Settings(state_dir=sys.argv[3]))
print("transformers" in sys.modules)
"""


@pytest.mark.slow
def test_kill_during_the_forward_pass_resumes_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = llamas(tmp_path, layers=4)
    config = hidden_gates(tmp_path / "hidden.yml", m)
    reference = tmp_path / "reference"
    # uninterrupted, its pass on a thread of this process (the pass's process is the killed runs' subject below):
    # the same job done by the same function
    with passes_on_a_thread():
        api.run(config, reference, settings=api.Settings(state_dir=tmp_path / "ref"))
    out, state = tmp_path / "out", tmp_path / "state"
    # the pass runs in a child process, which kills the run's process there (as a kill from outside would); it
    # pauses a second after each layer, so that the run has recorded its plan by then (on an idle machine a pass
    # of these tiny layers reaches layer 2 before the run's process has)
    killed = cli("run", config, out, "--state-dir", state, "--quiet",
                 env={"RESUMERGE_KILL_AT": "after_router_layer:2", "RESUMERGE_PAUSE_AT": "after_router_layer:1"})
    assert killed.returncode == -9, killed.stderr
    (work,) = (state / "moe-routers").iterdir()
    # the child died with its parent: it did not go on to the next layer (it would after a wait), and none is left
    assert sorted(p.name for p in work.iterdir()) == ["layer-00000.safetensors", "layer-00001.safetensors"]
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(work.parent) in " ".join(p.info["cmdline"] or ())]
    # the merge ran beside the pass: every tensor but the routers (their own last shard) may be committed already
    assert not (out / "model-00002-of-00002.safetensors").exists()
    # status says how far the pass got (it said "tensors 0 / N" and "elapsed 0.0 s" while it ran)
    said = json.loads(cli_here("status", out, "--state-dir", state, "--json").stdout)
    layers = json.loads((m[0] / "config.json").read_text())["num_hidden_layers"]
    assert said["prepass_layers"] == [2, layers] and said["elapsed_seconds"] > 0
    assert f"prompt forward pass: 2 of {layers} decoder layers" in cli_here("status", out, "--state-dir", state).stdout
    # the kill point is reached once per layer: continued at layer 2 it is reached twice more (layers 2 and 3),
    # started again from layer 0 it would die at layer 2. The run goes on in a process of its own (forked from the
    # worker's fork server, which never imports transformers) that says at its end whether it imported
    # transformers: it never enters the run's process (half a gigabyte once imported), for the tokenizer or the pass
    look = tmp_path / "run_and_look.py"
    look.write_text(_RUN_AND_LOOK)
    again = cli(config, out, state, script=look, timeout=300, env={"RESUMERGE_KILL_AT": "after_router_layer:3"})
    assert again.returncode == 0, again.stderr
    assert again.stdout.split() == ["False"]
    assert digests(out) == digests(reference)
    manifest = read_manifest(out)
    assert manifest is not None and manifest.fingerprint == api.plan_merge(config).fingerprint  # no pass needed
    routers = work / "routers.safetensors"
    before = routers.stat().st_mtime_ns
    shutil.rmtree(out)
    killed = cli("run", config, out, "--state-dir", state, "--quiet",
                 env={"RESUMERGE_KILL_AT": "after_ledger_commit:1"})
    assert killed.returncode == -9

    def no_pass(*_: object) -> None:
        raise AssertionError("the forward pass ran again")

    monkeypatch.setattr(gatesites, "start_child", no_pass)  # resumed here: no process is needed to see it is not rerun
    api.resume(out, settings=api.Settings(state_dir=state))
    assert routers.stat().st_mtime_ns == before and digests(out) == digests(reference)
    assert not [p for p in work.iterdir() if p.name != routers.name]

"""Every example in ``configs/`` is accepted: each YAML by ``resumerge plan``, and the LoRA extraction's
command lines (mergekit-extract-lora takes flags, no YAML) in their ``--plan`` form, over tiny models generated
under the paths the examples name (``./models/...``, 32 layers: the frankenmerge stacks layers 8 to 32)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from resumerge.cli.modelgen import ModelSpec, make_model
from tests.support import cli_here

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").iterdir())
MODELS = ("model-a", "model-b", "base", "chat", "code", "math")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory holding ``models/<name>`` for every name the examples use."""
    root = tmp_path_factory.mktemp("examples")
    for seed, name in enumerate(MODELS):
        make_model(root / "models" / name, ModelSpec(layers=32, hidden=16, intermediate=24, heads=2, kv_heads=1),
                   seed=seed)
    return root


def test_the_examples_include_moe_and_lora_extraction() -> None:
    names = {p.name for p in CONFIGS}
    assert {"moe-hidden.yml", "extract-lora.sh", "linear.yml"} <= names, names


@pytest.mark.parametrize("example", CONFIGS, ids=lambda p: p.name)
def test_every_example_is_accepted(example: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(models_dir)
    if example.suffix == ".sh":
        commands = [shlex.split(line) for line in example.read_text().splitlines()
                    if line.startswith("resumerge ")]
        planned = [argv for argv in commands if "--plan" in argv]
        assert planned and all(argv[1] == "extract-lora" for argv in commands), commands
        runs = [argv[1:] for argv in planned]
    else:
        assert example.suffix == ".yml", f"{example.name}: add a way to check this kind of example"
        runs = [["plan", str(example), "out", "--probe-size", "0"]]
    for argv in runs:
        done = cli_here(*argv, "--state-dir", models_dir / "state")  # the CLI's main, in this process
        assert done.returncode == 0, f"{example.name}: {argv}\n{done.stdout}\n{done.stderr}"
    assert not (models_dir / "out").exists() and not (models_dir / "out-lora").exists()

"""``verify`` fuzzed on an extracted LoRA adapter's files (issue 60): each flipped, truncated, deleted and overwritten
with non-UTF-8 bytes; ``verify`` exits 3 naming the file, and ``resume`` makes it byte-identical again. The adapter
weights are made again by a fresh process (an extraction's bits are only compared across fresh processes: see
test_resume.py), once; the small files, which a resume writes from the recorded plan alone, for every damage."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from support import DAMAGE, cli, digests

from resumerge.cli.commands import main
from resumerge.config.locations import run_dir
from resumerge.errors import EXIT_INTERRUPTED
from resumerge.merge.store.manifest import MANIFEST_NAME

FILES = ("adapter_model.safetensors", "adapter_config.json", "README.md", MANIFEST_NAME)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory,
            pair: Callable[[str], tuple[Path, Path]]) -> tuple[Path, Path, dict[str, str]]:
    base, ft = pair("llama")
    root = tmp_path_factory.mktemp("adapter-damage")
    out, state = root / "out", root / "state"
    assert cli("extract-lora", "--model", ft, "--base-model", base, "--out-path", out, "--max-rank", "4",
               "--state-dir", state, "-q", timeout=300).returncode == 0
    return out, state, digests(out)


def _damaged(adapter: tuple[Path, Path, dict[str, str]], tmp_path: Path, name: str, damage: str,
             capsys: pytest.CaptureFixture[str]) -> tuple[Path, Path]:
    """A copy of the adapter (with its ledger) whose ``name`` is damaged, checked by verify."""
    ref, ref_state, _ = adapter
    out, state = tmp_path / "out", tmp_path / "state"
    shutil.copytree(ref, out)
    shutil.copytree(run_dir(ref, ref_state), run_dir(out, state))
    DAMAGE[damage](out / name)
    capsys.readouterr()
    assert main(["verify", str(out), "--state-dir", str(state), "--json"]) == EXIT_INTERRUPTED
    assert [d["name"] for d in json.loads(capsys.readouterr().out)["damaged"]] == [name]
    return out, state


def test_the_fuzzed_files_are_every_file_the_extraction_writes(adapter: tuple[Path, Path, dict[str, str]]) -> None:
    assert sorted(adapter[2]) == sorted(FILES)


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("name", [n for n in FILES if n != "adapter_model.safetensors"])
def test_a_damaged_small_file_is_named_and_written_again(
        adapter: tuple[Path, Path, dict[str, str]], tmp_path: Path, name: str, damage: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    out, state = _damaged(adapter, tmp_path, name, damage, capsys)
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    assert digests(out) == adapter[2]


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_adapter_weights_are_named(adapter: tuple[Path, Path, dict[str, str]], tmp_path: Path, damage: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out, state = _damaged(adapter, tmp_path, "adapter_model.safetensors", damage, capsys)
    if damage == "flipped":  # made again once, by a fresh process
        assert cli("resume", out, "--state-dir", state, "-q", timeout=300).returncode == 0
        assert digests(out) == adapter[2]

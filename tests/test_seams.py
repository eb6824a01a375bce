"""The two seams the engine works through: output sinks and input sources, each held to one contract (the contract
every sink keeps, a hub repo's and the memory sink's included, is tests/test_sink_contract.py; here what folders
add to it)."""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ModelFactory
from support import digests, linear_config, write_config

from resumerge.cli.commands import EXIT_BROKEN_PIPE, main
from resumerge.config.locations import RunLocations, StateDir
from resumerge.config.merge_config import load_config_text
from resumerge.config.settings import RunSettings
from resumerge.errors import InterruptedMerge
from resumerge.inputs.source import InputSource, InputSources, LocalFiles
from resumerge.merge.engine.compute import compute_tensor
from resumerge.merge.engine.reporting import Driving
from resumerge.merge.engine.session import plan_from_config, run_merge
from resumerge.merge.methods.resources import NO_RESOURCES
from resumerge.merge.plan.merge_plan import PlanOptions
from resumerge.merge.store.sink import LocalDirSink, OutputSink, StagedDirSink

SINKS = ("local", "staged")


def _sink(kind: str, tmp_path: Path) -> OutputSink:
    out = tmp_path / "out"
    out.mkdir()
    if kind == "local":
        return LocalDirSink(out)
    staging = tmp_path / "staging"
    staging.mkdir()
    return StagedDirSink(out, staging)


@pytest.mark.parametrize("kind", SINKS)
def test_a_folder_sink_lists_no_link_and_deletes_only_what_it_is_told(kind: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with _sink(kind, tmp_path) as sink:
        (out / "user-notes.txt").write_text("not ours")
        (out / "link.json").symlink_to(out / "user-notes.txt")
        data = b"x" * 1000
        sha = hashlib.sha256(data).hexdigest()
        temp = sink.temp_for("config.json")
        temp.write_bytes(data)
        assert sink.publish(temp, "config.json", sha).done()  # a folder commits at once
        assert (out / "config.json").read_bytes() == data
        assert sink.names() == ["config.json", "user-notes.txt"]  # links are never a sink's files
        assert sink.check([("config.json", 1000, sha)]) == {"config.json": None}
        (out / "config.json").write_bytes(b"y" * 1000)
        assert sink.check([("config.json", 1000, sha)])["config.json"] == "contents differ from the committed checksum"
        sink.delete(["config.json", "link.json", "never-written.bin"])
        assert sorted(p.name for p in out.iterdir()) == ["link.json", "user-notes.txt"]
        leftovers = [p.name for p in tmp_path.rglob("*.part")]
        assert leftovers == []


@pytest.mark.parametrize("kind", SINKS)
def test_a_sink_hands_out_temp_files_where_its_commit_protocol_needs_them(kind: str, tmp_path: Path) -> None:
    sink = _sink(kind, tmp_path)
    temp = sink.temp_for("model.safetensors")
    # Local: beside the final file, so the rename is atomic. Staged: on local disk, never inside OUT.
    assert temp.parent == (tmp_path / ("out" if kind == "local" else "staging"))
    temp.write_bytes(b"abc")
    sink.publish(temp, "model.safetensors", hashlib.sha256(b"abc").hexdigest())
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"abc" and not temp.exists()


def test_a_staged_sink_refuses_bytes_that_do_not_read_back(tmp_path: Path) -> None:
    sink = _sink("staged", tmp_path)
    temp = sink.temp_for("a.bin")
    temp.write_bytes(b"abc")
    with pytest.raises(Exception, match="differs from what was written"):
        sink.publish(temp, "a.bin", "0" * 64)
    assert not (tmp_path / "out" / "a.bin").exists()


class _InMemory(InputSource):
    """A source with no file behind it: what a new kind of input (HTTP ranges) looks like to the engine."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.ranges: list[tuple[str, int, int]] = []
        self.closed = False

    def read_range(self, file: str, start: int, end: int) -> torch.Tensor:
        self.ranges.append((file, start, end))
        return torch.frombuffer(bytearray(self.files[file][start:end]), dtype=torch.uint8)

    def close(self) -> None:
        self.closed = True


def test_the_engine_computes_the_same_tensors_from_any_input_source(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    config = load_config_text(write_config(tmp_path / "c.yml", linear_config(a, b)).read_text())
    plan = plan_from_config(config, PlanOptions())
    local = InputSources.local(plan.model_dirs)
    memories = {key: _InMemory({p.name: p.read_bytes() for p in Path(d).glob("*.safetensors")})
                for key, d in plan.model_dirs.items()}
    with local, InputSources(memories) as remote:
        for tp in plan.tensors.values():
            assert torch.equal(compute_tensor(plan, tp, local, NO_RESOURCES)[tp.name],
                               compute_tensor(plan, tp, remote, NO_RESOURCES)[tp.name]), tp.name
    assert all(source.closed for source in memories.values())  # leaving the block closed every source
    # Only the byte ranges of the tensors were asked for: never a header, never a whole file.
    for source in memories.values():
        assert source.ranges and all(start > 8 for _, start, _ in source.ranges)


def test_local_files_read_ranges_and_whole_tensors(tmp_path: Path) -> None:
    (tmp_path / "f.raw").write_bytes(bytes(range(16)))
    source = LocalFiles(tmp_path)
    try:
        assert source.read_range("f.raw", 4, 8).tolist() == [4, 5, 6, 7]
        assert source.read_tensor("f.raw", 0, 8, "I32", (2,)).tolist() == [
            int.from_bytes(bytes(range(4)), "little"), int.from_bytes(bytes(range(4, 8)), "little")]
        assert source.read_tensor("f.raw", 3, 3, "F32", (0, 4)).shape == (0, 4)
    finally:
        source.close()


def test_the_interrupt_hint_is_the_exact_command_that_continues_from_the_ledger(
    tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    out, state = tmp_path / "big out", tmp_path / "state-big"
    with pytest.raises(InterruptedMerge) as stopped:
        run_merge(cfg.read_text(), RunLocations.of(out, state), PlanOptions(out_shard_size=30_000),
                  RunSettings(state=StateDir.resolve(state)), Driving(should_stop=lambda: True))
    command = stopped.value.resume_command
    assert command == f"resumerge resume {shlex.quote(str(out))} --state-dir {shlex.quote(str(state))}"
    assert command in stopped.value.one_line()
    capsys.readouterr()
    assert main(shlex.split(command)[1:]) == 0
    # Continued from the ledger: nothing was rebuilt from the manifest (which re-hashes every committed file).
    # Without --state-dir the same resume prints "ledger rebuilt from resumerge-manifest.json".
    assert "rebuilt" not in capsys.readouterr().err
    assert main(["run", str(cfg), str(tmp_path / "ref"), "--out-shard-size", "30000", "--quiet"]) == 0
    assert digests(out) == digests(tmp_path / "ref")


def test_a_closed_pipe_ends_status_quietly(tmp_path: Path, make: ModelFactory) -> None:
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "models": [str(make("a"))]})
    assert main(["run", str(cfg), str(tmp_path / "out"), "--quiet"]) == 0
    read, write = os.pipe()
    os.close(read)  # `| head` that has already gone away
    # A fresh interpreter, not support.cli: its stdout must be this pipe's closed end (a forked command writes a file).
    done = subprocess.run([sys.executable, "-m", "resumerge", "status", str(tmp_path / "out"), "--json"],
                          stdout=write, stderr=subprocess.PIPE, text=True, check=False, timeout=60)
    os.close(write)
    assert done.stderr == "" and done.returncode == EXIT_BROKEN_PIPE

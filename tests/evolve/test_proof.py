"""A generation's streamed pass proves the models it reads against its journal
(:class:`resumerge.forward.job.proof.JournalProof`): a search killed after a layer of a generation's pass and resumed
after one of the candidates' input models was edited in a range the journaled layer was computed from is refused
(exit 4, the file and the layer named); put back, the search resumes and ends. The pass's folder is named by its
generation and candidates, not by the models' bytes: only the proof can see the edit. Tiny generated models, real
processes killed for real."""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import pytest

from resumerge.inputs.safetensors_format import read_header
from tests.evolve.test_search import OPTIONS, make_search
from tests.support import cli, cli_here


def _evolve(config: Path, store: Path, kill: str | None = None) -> subprocess.CompletedProcess[str]:
    """The search started through the CLI: killed at ``kill`` in a process of its own (a real SIGKILL), or, unkilled,
    through the CLI's main in this process (support.cli_here: the same parsing, lines and exit codes)."""
    args = ("evolve", config, store, "--max-fevals", str(OPTIONS["max_fevals"]), "--popsize", str(OPTIONS["popsize"]),
            "--random-seed", str(OPTIONS["random_seed"]))
    return cli(*args, env={"RESUMERGE_KILL_AT": kill}, timeout=600) if kill is not None else cli_here(*args)


def _shard(model: Path, tensor: str) -> Path:
    index = json.loads((model / "model.safetensors.index.json").read_text())
    return model / index["weight_map"][tensor]


def _edit(file: Path, tensor: str) -> None:
    """Add 1 to the first float32 value of ``tensor`` in ``file``, in place."""
    at = read_header(file).tensors[tensor].start
    with open(file, "r+b") as f:
        f.seek(at)
        value = struct.unpack("<f", f.read(4))[0]
        f.seek(at)
        f.write(struct.pack("<f", value + 1.0))


@pytest.mark.slow
def test_a_resumed_generation_refuses_an_input_edited_in_a_journaled_layer(tmp_path: Path) -> None:
    config = make_search(tmp_path)
    store = tmp_path / "store"
    killed = _evolve(config, store, "after_check_layer:1")  # generation 1's pass: its first layer journaled
    assert killed.returncode == -9, killed.stderr[-2000:]
    base = tmp_path / "base"  # an input of every candidate, not a task's parent
    tensor = "model.layers.0.mlp.up_proj.weight"
    file = _shard(base, tensor)
    held = file.read_bytes()
    _edit(file, tensor)
    refused = _evolve(config, store)
    assert refused.returncode == 4, refused.stderr[-2000:]
    assert str(file) in refused.stderr and "decoder layer 0" in refused.stderr
    assert "Traceback" not in refused.stderr
    with open(file, "r+b") as f:  # put back in place: the bytes the journal was computed from
        f.write(held)
    # resumed (tests/evolve/test_kills.py holds a resumed search's files to those of one never interrupted)
    done = _evolve(config, store)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (store / "evaluations.jsonl").read_text().count("\n") == 4

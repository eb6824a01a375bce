"""A check's models proved by the bytes it reads (:mod:`resumerge.forward.job.proof`): a repeated check reads no tensor
byte when nothing changed; a model edited between a kill and a resume, in a layer the journal holds, is refused
(exit 4, the file named); an edit in a range no step reads is reported and the report kept; a finished check of
bytes a model no longer holds is checked again.

The models are a little over 1 MiB a file and every edit lands outside the 16 blocks a file's identity samples,
so that the check's key (its folder) stays the same and only the proof can see it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from proofedits import count_reads, edit_unsampled, trust_fresh_files
from support import cli

from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model

pytest.importorskip("transformers")

SPEC = ModelSpec(layers=3, hidden=128, intermediate=256, vocab=96, shard_bytes=1 << 30)


def _models(tmp_path: Path, extra: bool = False) -> tuple[Path, Path, Path]:
    merge, parent = make_model(tmp_path / "m", SPEC, seed=0), make_model(tmp_path / "p", SPEC, seed=1)
    if extra:  # a tensor the merge does not hold: no step of the check reads it
        from safetensors.torch import load_file, save_file

        from resumerge.machine.torch_import import torch

        file = parent / "model.safetensors"
        tensors = load_file(str(file))
        tensors["extra.weight"] = torch.zeros(512, 256)
        save_file(tensors, str(file), metadata={"format": "pt"})
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\na dog ran in the park\n")
    return merge, parent, texts


def test_a_repeated_check_reads_no_tensor_and_a_touched_file_is_hashed_not_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trust_fresh_files(monkeypatch)
    merge, parent, texts = _models(tmp_path)
    state = tmp_path / "state"
    first = api.check(merge, parents=[parent], prompts=texts, settings=api.Settings(state_dir=state))
    records = list((state / "checks").glob("*/inputs.json"))
    assert len(records) == 1 and len(json.loads(records[0].read_text())["files"]) == 2
    read = count_reads(monkeypatch)
    again = api.check(merge, parents=[parent], prompts=texts, settings=api.Settings(state_dir=state))
    assert read == [] and again.to_json() == first.to_json()
    os.utime(parent / "model.safetensors")  # touched, the same bytes: hashed again, no tensor read
    touched = api.check(merge, parents=[parent], prompts=texts, settings=api.Settings(state_dir=state))
    assert read == [str(parent / "model.safetensors")]
    assert touched.proof is not None and "same bytes" in touched.proof
    assert touched.models == first.models


def test_an_edit_no_step_reads_is_reported_and_a_read_one_checks_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trust_fresh_files(monkeypatch)
    merge, parent, texts = _models(tmp_path, extra=True)
    state = tmp_path / "state"
    first = api.check(merge, parents=[parent], prompts=texts, settings=api.Settings(state_dir=state))
    edit_unsampled(parent, "extra.weight")
    read = count_reads(monkeypatch)
    kept = api.check(merge, parents=[parent], prompts=texts, settings=api.Settings(state_dir=state))
    assert kept.proof is not None and "same bytes in every range this pass reads" in kept.proof
    assert str(parent) in kept.proof and kept.models == first.models
    assert not [r for r in read if not r.endswith(".safetensors")]  # no tensor read: the report kept
    edit_unsampled(merge, "model.layers.2.mlp.up_proj.weight")
    again = api.check(merge, parents=[parent], prompts=texts, settings=api.Settings(state_dir=state))
    assert again.proof is not None and "checked again" in again.proof and str(merge) in again.proof
    assert again.models[0].nll != first.models[0].nll  # the new bytes were read


def test_an_edit_between_kill_and_resume_in_a_journaled_layer_is_refused(tmp_path: Path) -> None:
    merge, parent, texts = _models(tmp_path)
    state = tmp_path / "state"
    argv = ["check", merge, "--parent", parent, "--prompts", texts, "--state-dir", state, "--quiet"]
    killed = cli(*argv, env={"RESUMERGE_KILL_AT": "after_check_layer:2"}, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    file = edit_unsampled(parent, "model.layers.0.self_attn.q_proj.weight")
    resumed = cli(*argv, timeout=300)
    assert resumed.returncode == 4, resumed.stderr[-2000:]
    assert str(file) in resumed.stderr and "decoder layer 0" in resumed.stderr
    assert "Traceback" not in resumed.stderr

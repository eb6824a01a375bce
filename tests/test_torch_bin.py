"""PyTorch ``.bin`` checkpoints as inputs: the same weights as ``.bin`` and as safetensors merge to the same bytes.

Covers a single ``pytorch_model.bin``, shards named by ``pytorch_model.bin.index.json`` (tensors interleaved
across shards), tensors stored as non-contiguous, offset and shared-storage views, ``nn.Parameter`` values,
bf16, row-chunked reads, and a ``.bin`` changed between an interrupted run and its resume. Hostile ``.bin`` files
are in tests/test_hostile.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ModelFactory
from support import cli, output_tensors, write_config

from resumerge.cli.commands import main
from resumerge.inputs import torch_bin
from resumerge.inputs.torch_bin import PickleReader, read_bin_header


def _as_views(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same values stored as awkward views: transposed (non-contiguous), offset into a larger storage,
    a Parameter; the embedding and head share one storage."""
    out: dict[str, torch.Tensor] = {}
    for i, (name, t) in enumerate(sorted(state.items())):
        if t.dim() == 2 and i % 3 == 0:
            out[name] = t.t().contiguous().t()
        elif i % 3 == 1:
            out[name] = torch.cat([torch.zeros(5, dtype=t.dtype), t.reshape(-1)])[5:].view(t.shape)
        else:
            out[name] = torch.nn.Parameter(t.clone(), requires_grad=False)
    embed, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    both = torch.stack([embed, head])
    out["model.embed_tokens.weight"], out["lm_head.weight"] = both[0], both[1]
    return out


def _to_bin(model: Path, target: Path, *, shards: int = 1, views: bool = False) -> Path:
    """Copy ``model`` to ``target`` with its weights as ``.bin`` (one file, or ``shards`` interleaved shards)."""
    shutil.copytree(model, target, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    state = output_tensors(model)
    if views:
        state = _as_views(state)
    if shards == 1:
        torch.save(state, target / "pytorch_model.bin")
        return target
    names = sorted(state)
    weight_map = {}
    for k in range(shards):
        file = f"pytorch_model-{k + 1:05d}-of-{shards:05d}.bin"
        part = {n: state[n] for n in names[k::shards]}  # interleaved: neighbours live in different shards
        torch.save(part, target / file)
        weight_map.update(dict.fromkeys(part, file))
    (target / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return target


def _merge(tmp_path: Path, name: str, a: Path, b: Path, *extra: str) -> Path:
    cfg = write_config(tmp_path / f"{name}.yml", {"merge_method": "linear", "models": [
        {"model": str(a), "parameters": {"weight": 0.3}}, {"model": str(b), "parameters": {"weight": 0.7}}]})
    out = tmp_path / name
    assert main(["run", str(cfg), str(out), "--quiet", "--out-shard-size", "30k", *extra]) == 0
    return out


def _weights(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())
            if p.suffix == ".safetensors" or p.name in {"config.json", "model.safetensors.index.json"}}


@pytest.mark.parametrize(("shards", "views"), [(1, False), (3, False), (1, True), (2, True)],
                         ids=["single", "sharded", "views", "sharded-views"])
def test_bin_and_safetensors_give_identical_outputs(
    tmp_path: Path, make: ModelFactory, shards: int, views: bool
) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    want = _weights(_merge(tmp_path, "from-safetensors", a, b))
    a_bin = _to_bin(a, tmp_path / "a-bin", shards=shards, views=views)
    assert not list(a_bin.glob("*.safetensors"))
    assert _weights(_merge(tmp_path, "from-bin", a_bin, b)) == want


def test_bf16_rows_read_in_chunks_match(tmp_path: Path, make: ModelFactory) -> None:
    """Row-range reads of a ``.bin`` tensor (the engine's chunked reads) give the safetensors bytes."""
    a = make("a", seed=1, dtype=torch.bfloat16)
    header = read_bin_header(_to_bin(a, tmp_path / "a-bin", views=True) / "pytorch_model.bin")
    state = output_tensors(a)
    reader = PickleReader(tmp_path / "a-bin")
    try:
        for name, entry in header.tensors.items():
            want = state[name].contiguous().reshape(-1).view(torch.uint8)
            mid = entry.start + (entry.end - entry.start) // 2
            got = torch.cat([reader.read_range("pytorch_model.bin", entry.start, mid),
                             reader.read_range("pytorch_model.bin", mid, entry.end)])
            assert entry.dtype == "BF16" and torch.equal(got, want), name
    finally:
        reader.close()


def test_a_bin_changed_before_resume_is_refused(tmp_path: Path, make: ModelFactory,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    a_bin = _to_bin(a, tmp_path / "a-bin")
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": [
        {"model": str(a_bin), "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {"weight": 0.5}}]})
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("run", cfg, out, "--state-dir", state, "--out-shard-size", "30k", "--quiet",
                 env={"RESUMERGE_KILL_AT": "after_manifest_write:2"})
    assert killed.returncode == -9, killed.stderr
    changed = {k: v + 1 for k, v in torch.load(a_bin / "pytorch_model.bin", weights_only=True).items()}
    torch.save(changed, a_bin / "pytorch_model.bin")
    capsys.readouterr()
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 4  # the kill alone needs a process
    assert "pytorch_model.bin" in capsys.readouterr().err


def test_a_bin_under_a_torch_with_an_unsafe_unpickler_is_refused_unread(
        tmp_path: Path, make: ModelFactory, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before torch 2.10 the weights-only unpickler runs a crafted pickle's code (CVE-2026-24747): a ``.bin`` is
    refused while the merge is planned, in one line saying why and what to do, before torch.load sees it."""
    a_bin = _to_bin(make("a", seed=1), tmp_path / "a-bin")
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": [
        {"model": str(a_bin), "parameters": {"weight": 0.5}}, {"model": str(make("b", seed=2)),
                                                             "parameters": {"weight": 0.5}}]})
    monkeypatch.setattr(torch_bin, "torch_release", lambda: (2, 9))

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load ran")

    monkeypatch.setattr(torch, "load", never)
    capsys.readouterr()
    assert main(["run", str(cfg), str(tmp_path / "out"), "--quiet", "--state-dir", str(tmp_path / "state")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "CVE-2026-24747" in err and "pytorch_model.bin is a pickle" in err, err
    assert "convert the model to safetensors, or upgrade torch to 2.10 or later" in err, err
    assert not (tmp_path / "out").exists()

"""The two caches of a pure function's tensors (an extraction's factors, a transplant's batches) keep an entry one
way (:func:`resumerge.machine.durable.save_entry`): temp file, fsync, rename, the folder fsynced, so a power
loss leaves it whole or absent; a disk that refuses it costs only a recomputation. The extraction's copy of that
write never fsynced its folder (the rename could be lost with the power); the transplant's did."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resumerge.machine import durable
from resumerge.runs.extract.factor_cache import FactorCache
from resumerge.runs.transplant.batches import BatchStore


def _synced(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    folders: list[Path] = []
    real = durable.fsync_dir

    def fsync_dir(directory: Path) -> None:
        folders.append(directory)
        real(directory)

    monkeypatch.setattr(durable, "fsync_dir", fsync_dir)
    return folders


def test_a_factor_entry_is_read_back_and_its_folder_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folders = _synced(monkeypatch)
    cache = FactorCache(tmp_path / "factors")
    a, b = torch.arange(10, dtype=torch.float32).reshape(2, 5), torch.ones(6, 2)
    cache.store("k", a, b, module="model.layers.0.mlp.up_proj")
    found = cache.load("k")
    assert found is not None and torch.equal(found[0], a) and torch.equal(found[1], b)
    assert folders == [tmp_path / "factors"]
    assert [p.name for p in (tmp_path / "factors").iterdir()] == ["k.factors"]  # no temp file left


def test_a_batch_entry_is_read_back_and_its_folder_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folders = _synced(monkeypatch)
    store = BatchStore(tmp_path / "batches")
    rows = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    store.store("k", rows)
    found = store.load("k")
    assert found is not None and torch.equal(found, rows)
    assert folders == [tmp_path / "batches"]


def test_a_refused_entry_is_left_out_without_an_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    FactorCache(tmp_path / "file" / "factors").store("k", torch.ones(2, 2), torch.ones(2, 2), module="m")
    BatchStore(tmp_path / "file" / "batches").store("k", torch.ones(2, 2))
    assert [p.name for p in tmp_path.iterdir()] == ["file"]

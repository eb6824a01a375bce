"""Inputs stored alike (one folder under two names, two fine-tunes of one base saved the same way) share the parse
of their safetensors headers and their formats' recognition; inputs whose headers differ only in their bytes (order,
metadata, so offsets) share the recognition, not the parse; inputs that differ in any tensor or the config share
neither."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ModelFactory
from safetensors.torch import load_file, save_file
from support import linear_config, write_config
from toycodec import TOY, quantize

from resumerge.config.merge_config import load_config_text
from resumerge.inputs import model as model_module
from resumerge.inputs.catalog import open_inputs
from resumerge.inputs.codecs import CodecTable, StoredFormats
from resumerge.inputs.files import TensorSource
from resumerge.inputs.safetensors_format import Header, read_header
from resumerge.merge.plan.merge_plan import PlanOptions
from resumerge.merge.plan.planner import build_plan


def test_a_header_byte_for_byte_another_s_is_parsed_once(tmp_path: Path) -> None:
    files = {"a": torch.zeros(4, 8), "b": torch.ones(4, 8), "c": torch.zeros(8, 4)}
    for name, t in files.items():
        save_file({"w": t}, tmp_path / f"{name}.safetensors")
    parsed: dict[tuple[bytes, int], Header] = {}
    # The shared Header and the map's entries are read_header's contract for ``parsed``, not an internal: what the
    # caller keeps is one parse per distinct header (a 163-shard fine-tune's headers parsed once for both models).
    a, b, c = (read_header(tmp_path / f"{name}.safetensors", parsed=parsed) for name in files)
    assert b is a and c is not a and len(parsed) == 2
    assert c == read_header(tmp_path / "c.safetensors") and c.tensors["w"].shape == (8, 4)


@dataclass(frozen=True)
class _Asked(CodecTable):
    """A codec table that keeps which models it was asked to recognise (the planner's table, handed to it)."""

    recognised_at: list[str] = field(default_factory=list)

    def recognise(self, config: Mapping[str, Any], tensors: Mapping[str, TensorSource],
                  *, where: str = "") -> StoredFormats:
        self.recognised_at.append(where)
        return super().recognise(config, tensors, where=where)


def test_models_stored_alike_are_recognised_once(tmp_path: Path, make: ModelFactory) -> None:
    a = make("a", seed=1)
    quantize(a)
    twin, other = tmp_path / "twin", tmp_path / "other"
    shutil.copytree(a, twin)
    shutil.copytree(a, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "_name_or_path": "other"}))
    plans = []
    for b in (twin, other):
        doc = load_config_text(write_config(tmp_path / f"{b.name}.yml", linear_config(a, b)).read_text())
        codecs = _Asked(TOY.formats)
        plans.append(build_plan(doc, open_inputs(doc).models, PlanOptions(), codecs))
        # "Judged once" is ModelInput.recognised's contract (what a 92k-tensor fine-tune pair saves), asked of the
        # table the planner is given.
        assert codecs.recognised_at == [str(a)] if b is twin else codecs.recognised_at == [str(a), str(b)]
    for plan, b in zip(plans, (twin, other)):
        assert plan.input_roles[str(a)] == plan.input_roles[str(b)]
        assert all(tp.inputs[0].codec == tp.inputs[1].codec for tp in plan.tensors.values())
        assert any(not tp.inputs[1].codec.plain for tp in plan.tensors.values())


def _resaved(src: Path, dst: Path, *, cast: str | None = None) -> Path:
    """``src`` copied to ``dst`` with every shard saved again with its own metadata (other header bytes, other data
    offsets: another writer); ``cast``: that tensor stored as float16 (a model that is not stored alike)."""
    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        if cast in tensors:
            tensors[cast] = tensors[cast].half()
        save_file(tensors, file, metadata={"format": "pt", "writer": "another"})
    return dst


def test_headers_that_differ_only_in_bytes_share_recognition_not_places(
        tmp_path: Path, make: ModelFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    a = make("a", seed=1)
    quantize(a)
    alike = _resaved(a, tmp_path / "alike")
    plain = next(n for n, e in read_header(next(a.glob("*.safetensors"))).tensors.items() if len(e.shape) == 1)
    unlike = _resaved(a, tmp_path / "unlike", cast=plain)
    for b in (alike, unlike):
        doc = load_config_text(write_config(tmp_path / f"{b.name}.yml", linear_config(a, b)).read_text())
        models = open_inputs(doc).models
        codecs = _Asked(TOY.formats)
        plan = build_plan(doc, models, PlanOptions(), codecs)
        assert codecs.recognised_at == ([str(a)] if b is alike else [str(a), str(b)])
        # Shared judgement, own places: every part b's plan reads is where b's own headers put it.
        stored = models[str(b)].tensors
        refs = [ref for tp in plan.tensors.values() for ref in (tp.inputs[1], *(c for _, c in tp.inputs[1].companions))]
        assert all((ref.file, ref.start, ref.end) == (stored[ref.tensor].file, stored[ref.tensor].entry.start,
                                                      stored[ref.tensor].entry.end) for ref in refs)
        assert any(ref.start != models[str(a)].tensors[ref.tensor].entry.start for ref in refs)
        with monkeypatch.context() as judged_anew:  # the same plan as when each model is judged on its own
            judged_anew.setattr(model_module, "stored_alike", lambda one, other: False)
            codecs = _Asked(TOY.formats)
            assert build_plan(doc, models, PlanOptions(), codecs).fingerprint == plan.fingerprint
            assert codecs.recognised_at == [str(a), str(b)]

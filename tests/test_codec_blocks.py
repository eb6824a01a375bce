"""Row chunks of a tensor written in a block format hold whole blocks: a block scale covers several rows, so a
chunk that cut a block would encode each half with a scale of its own (and the second would overwrite the first).
The block format here is a test-only codec, the toy int8 format with one scale per four rows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from conftest import ModelFactory
from support import write_config
from toycodec import TOY, RowScaledInt8, quantize

from resumerge.config.merge_config import load_config_text
from resumerge.inputs.catalog import open_inputs
from resumerge.inputs.codecs import MAIN, OutPart
from resumerge.inputs.kernels import serial_kernels
from resumerge.inputs.source import InputSources
from resumerge.merge.engine.compute import compute_tensor
from resumerge.merge.methods.registry import get_method
from resumerge.merge.methods.resources import NO_RESOURCES
from resumerge.merge.plan import workunits
from resumerge.merge.plan.merge_plan import Plan, PlanOptions
from resumerge.merge.plan.planner import build_plan
from resumerge.merge.plan.workunits import aligned_rows, row_step, row_stream

BLOCK = 4


def plan_for(tmp_path: Path, doc: dict[str, object]) -> Plan:
    config = load_config_text(write_config(tmp_path / "c.yml", doc).read_text())
    return build_plan(config, open_inputs(config).models, PlanOptions(), TOY)


@dataclass(frozen=True)
class BlockScaledInt8(RowScaledInt8):
    """Int8 codes with one F32 scale per block of four rows."""

    name: ClassVar[str] = "toy-block-int8"

    @property
    def row_block(self) -> int:
        return BLOCK

    def part_rows(self, part: str, first: int, stop: int) -> tuple[int, int]:
        return first // BLOCK, -(-stop // BLOCK)

    def decode(self, parts: Mapping[str, torch.Tensor], first_row: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        codes = parts[MAIN]
        rows = torch.arange(first_row, first_row + codes.shape[0]) // BLOCK - first_row // BLOCK
        return codes.to(torch.float32) * parts["scale"][rows].unsqueeze(-1)

    def out_parts(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[OutPart, ...]:
        return OutPart(MAIN, name, "I8", shape), OutPart("scale", f"{name}_scale", "F32", (-(-shape[0] // BLOCK),))

    def encode(self, value: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
        rows = value.shape[0]
        padded = torch.zeros(-(-rows // BLOCK) * BLOCK, *value.shape[1:], dtype=torch.float32)
        padded[:rows] = value
        scale = padded.reshape(-1, BLOCK * value[0].numel()).abs().amax(dim=-1) / 127
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        codes = (value / scale.repeat_interleave(BLOCK)[:rows].unsqueeze(-1)).round().clamp(-127, 127)
        return {MAIN: codes.to(torch.int8), "scale": scale}


def test_a_chunk_is_a_whole_number_of_its_format_s_blocks_but_the_last(tmp_path: Path, make: ModelFactory) -> None:
    base = make("base", seed=0)
    quantize(base)
    plan = plan_for(tmp_path, {"merge_method": "linear", "models": [
        {"model": str(base), "parameters": {"weight": 1.0}}, {"model": str(make("a", seed=1)),
                                                             "parameters": {"weight": 1.0}}]})
    tp = replace(next(t for t in plan.tensors.values() if not t.out_codec.plain), out_codec=BlockScaledInt8())
    assert row_step(tp) == BLOCK
    assert [aligned_rows(tp, rows, 10) for rows in (1, 3, 4, 7, 9, 10, 12)] == [4, 4, 4, 4, 8, 10, 10]
    assert aligned_rows(tp, 3, 2) == 2  # the last rows of a tensor, whatever they are


def test_a_streamed_method_s_chunks_encode_whole_blocks(tmp_path: Path, make: ModelFactory,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    base, a, b = make("base", seed=0), make("a", seed=1), make("b", seed=2)
    quantize(base)
    doc = {"merge_method": "ties", "base_model": str(base),
           "models": [{"model": str(a), "parameters": {"weight": 0.6, "density": 0.3}},
                      {"model": str(b), "parameters": {"weight": 0.4, "density": 0.5}}]}
    plan = plan_for(tmp_path, doc)
    ties = get_method("ties")
    assert ties is not None
    blocked = [replace(tp, out_codec=BlockScaledInt8()) for tp in plan.tensors.values() if not tp.out_codec.plain]
    assert blocked
    with InputSources.local(plan.model_dirs) as sources:
        for tp in blocked:
            # Chunks of about three rows, as a tight budget would cut them: each must still hold whole blocks.
            with monkeypatch.context() as patch:
                patch.setattr(workunits, "CHUNK_ELEMENTS", 3 * tp.shape[1])
                patch.setattr(workunits, "STACKED_ELEMENTS", 3 * tp.shape[1])
                assert workunits.pass_rows(tp) == BLOCK
                stream = row_stream(tp, ties, "cpu")
                assert stream is not None
                with serial_kernels():  # a stream's chunk kernels, as the engine runs them
                    rows = compute_tensor(plan, tp, sources, NO_RESOURCES, stream)
            whole = compute_tensor(plan, tp, sources, NO_RESOURCES)
            assert all(torch.equal(rows[k], whole[k]) for k in whole), tp.name

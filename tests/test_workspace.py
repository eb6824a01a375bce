"""A worker's reused buffers (resumerge.merge.engine.workspace): what they lend, and that tensors computed one after
another in one workspace are stored as they are without one, none of them overwritten by the next."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import ModelFactory
from quantmodels import fp8, fp8_config
from support import linear_config, write_config
from test_quant_codecs import pair

from resumerge.config.merge_config import load_config_text
from resumerge.inputs.catalog import open_inputs
from resumerge.inputs.codecs import CODECS
from resumerge.inputs.gguf.blocks import F16, Q8_0
from resumerge.inputs.source import InputSources
from resumerge.merge.engine.bufferpool import MOST_IDLE, BufferPool
from resumerge.merge.engine.compute import Stored, TensorCompute, compute_tensor
from resumerge.merge.engine.workspace import BUDGET_SHARE, WARM_BYTES, Workspace, Workspaces, workspace_bytes
from resumerge.merge.methods.resources import NO_RESOURCES
from resumerge.merge.plan.merge_plan import PlanOptions
from resumerge.merge.plan.planner import build_plan
from resumerge.outputs.gguf.outcodec import GgufOutCodec


def test_a_workspace_lends_one_buffer_per_key_grown_to_the_largest_and_never_beyond_its_bound() -> None:
    space = Workspace(most=1000, warm_bytes=0)
    small = space.take("a", (10, 4), torch.float32)
    again = space.take("a", (2, 3), torch.float32)
    assert again.data_ptr() == small.data_ptr() and again.shape == (2, 3) and again.is_contiguous()
    assert space.holds(small[1:]) and space.holds(again.view(torch.int32))
    grown = space.take("a", (100,), torch.float64)  # 800 bytes: the 160-byte buffer is replaced
    assert space.held_bytes == 800 and space.holds(grown) and not space.holds(small)
    other = space.take("b", (100,), torch.float32)  # 400 more would pass the bound: fresh, not kept
    assert not space.holds(other) and space.held_bytes == 800
    assert space.take("b", (10,), torch.bfloat16).shape == (10,) and space.held_bytes == 820
    assert not space.holds(torch.empty(3))


def test_workspaces_lend_each_to_one_computation_at_a_time() -> None:
    pool = Workspaces(most=64, workers=2)
    with pool.lend() as first, pool.lend() as second:
        assert first is not second
    with pool.lend() as again:
        assert again in (first, second)


@pytest.mark.parametrize(("budget", "workers"), [(1 << 20, 1), (3_000_001, 3)])
def test_every_worker_s_workspace_filled_together_holds_the_share_of_the_budget_and_no_more(budget: int,
                                                                                          workers: int) -> None:
    # The planner sizes units against the whole budget: what the workspaces keep must leave the rest of it.
    pool = Workspaces(workspace_bytes(budget, workers), workers, warm_bytes=0)
    with contextlib.ExitStack() as lent:
        spaces = [lent.enter_context(pool.lend()) for _ in range(workers)]
        for space in spaces:
            for i in range(100):
                space.take(f"buffer{i}", (budget // 64,), torch.uint8)
        held = sum(space.held_bytes for space in spaces)
    assert budget * BUDGET_SHARE * 0.9 < held <= budget * BUDGET_SHARE and BUDGET_SHARE < 1
    assert workspace_bytes(None, workers) > 0  # without a budget too, a workspace keeps buffers


def test_workspaces_keep_one_per_worker_and_trim_gives_back_what_the_idle_ones_hold() -> None:
    pool = Workspaces(most=1000, workers=2, warm_bytes=0)
    with pool.lend() as first, pool.lend() as second, pool.lend() as third:
        first.take("a", (100,), torch.uint8)
        second.take("a", (200,), torch.uint8)
        third.take("a", (300,), torch.uint8)  # beyond the workers: keeps nothing, and is not kept
        assert third.held_bytes == 0 and pool.trim() == 0  # none is idle: nothing is taken from under a worker
    with pool.lend() as busy:
        assert busy.held_bytes in (100, 200)
        assert pool.trim() == 300 - busy.held_bytes  # the idle one only
        assert busy.held_bytes in (100, 200)
    with pool.lend() as a, pool.lend() as b, pool.lend() as c:
        assert c not in (first, second, third) and {a, b} == {first, second}


@pytest.mark.parametrize("dequantize", [True, False])
def test_tensors_computed_in_one_workspace_are_stored_as_without_one(tmp_path: Path, make: ModelFactory,
                                                                      dequantize: bool) -> None:
    # Decoded inputs and linear's result share the workspace's buffers from one tensor to the next. A float32 result
    # written as float32 (dequantize) is the buffer itself until the engine copies it out: every stored tensor must
    # survive the tensors computed after it.
    a, b = pair(tmp_path, make, fp8((16, 16)), fp8_config((16, 16)))
    text = write_config(tmp_path / "c.yml", {**linear_config(a, b), "dtype": "float32"}).read_text()
    config = load_config_text(text)
    plan = build_plan(config, open_inputs(config).models, PlanOptions(dequantize=dequantize), CODECS)
    space = Workspace(most=1 << 30, warm_bytes=0)  # these tensors are small
    with InputSources.local(plan.model_dirs) as sources:
        fresh = {name: compute_tensor(plan, tp, sources, NO_RESOURCES) for name, tp in plan.tensors.items()}
        reused: dict[str, Stored] = {}
        for name, tp in plan.tensors.items():
            reused[name] = TensorCompute(plan, tp, sources, NO_RESOURCES).whole(space)
    assert space.held_bytes > 0
    for name, parts in fresh.items():
        assert reused[name].keys() == parts.keys()
        for part, t in parts.items():
            assert not space.holds(reused[name][part]), part
            assert torch.equal(reused[name][part].view(torch.uint8), t.view(torch.uint8)), part


def test_a_kept_fp8_merge_on_another_device_decodes_in_the_workspace_and_encodes_there(tmp_path: Path,
                                                                                         make: ModelFactory) -> None:
    # --device cuda: inputs decoded into the worker's CPU buffers, moved to the device, merged there (no CPU result
    # buffer lent), the result encoded there. The meta device raises wherever a CPU tensor is mixed in, as CUDA does.
    a, b = pair(tmp_path, make, fp8((16, 16)), fp8_config((16, 16)))
    doc = {**linear_config(a, b), "parameters": {"normalize": False}}  # normalize reads the weights' sum's value
    config = load_config_text(write_config(tmp_path / "c.yml", doc).read_text())
    plan = build_plan(config, open_inputs(config).models, PlanOptions(dequantize=False, device="meta"), CODECS)
    space = Workspace(most=1 << 30, warm_bytes=0)  # these tensors are small
    kept = 0
    with InputSources.local(plan.model_dirs) as sources:
        for tp in plan.tensors.values():
            merged = TensorCompute(plan, tp, sources, NO_RESOURCES).merged(0, tp.shape[0], space)
            assert merged.device.type == "meta" and tuple(merged.shape) == tp.shape, tp.name
            parts = tp.out_codec.encode(merged, tp.out_dtype)
            assert all(t.device.type == "meta" for t in parts.values()), tp.name
            kept += not tp.out_codec.plain
    assert kept and space.held_bytes > 0  # FP8 weights were kept, their inputs decoded in the CPU workspace


def test_a_pool_lends_again_only_what_the_writer_gave_back_within_its_bound() -> None:
    pool = BufferPool(most=3000)
    first = pool.take(1000)
    pool.give_back([first])  # never passed on: not the pool's to keep
    assert pool.idle_bytes == 0
    pool.pass_on(first)
    assert pool.out == 1
    pool.give_back([first[10:20].view(torch.int16), torch.empty(5)])  # a view of it gives it back; others ignored
    assert pool.out == 0 and pool.idle_bytes == 1000
    assert pool.take(2001).data_ptr() != first.data_ptr()  # too small for it
    assert pool.idle_bytes == 1000
    assert pool.take(499).data_ptr() != first.data_ptr()  # more than twice as large: a small one is fresh
    again = pool.take(600)
    assert again.data_ptr() == first.data_ptr() and pool.idle_bytes == 0
    buffers = [pool.take(1000 + i) for i in range(4)]
    for b in buffers:
        pool.pass_on(b)
    pool.give_back(buffers)  # 4006 bytes given back: the oldest ones dropped to stay within 3000
    assert pool.idle_bytes == 1002 + 1003 and pool.out == 0
    assert pool.take(1001).data_ptr() == buffers[2].data_ptr()  # the smallest that fits
    assert pool.trim() == 1003 and pool.idle_bytes == 0


def test_a_workspace_passes_on_a_result_it_holds_and_takes_its_next_buffer_from_the_pool() -> None:
    pool = BufferPool(most=1 << 20)
    space = Workspace(most=1 << 20, pool=pool, warm_bytes=0)
    result = space.take("result", (64,), torch.float32)
    assert not space.pass_on(torch.empty(64)) and not space.pass_on(result.view(8, 8).t())
    assert space.pass_on(result) and not space.holds(result) and pool.out == 1
    nxt = space.take("result", (64,), torch.float32)
    assert nxt.data_ptr() != result.data_ptr()  # the first is the writer's until it gives it back
    pool.give_back([result])
    space.pass_on(nxt)
    assert space.take("result", (32,), torch.float32).data_ptr() == result.data_ptr()
    assert not Workspace(most=1 << 20).pass_on(torch.empty(4))  # without a pool: the caller copies


def test_a_small_result_is_a_fresh_tensor_none_of_the_workspace_s_and_one_at_the_threshold_is_passed_on() -> None:
    # Under WARM_BYTES the workspace lends a fresh tensor from the allocator's warm heap and keeps nothing: the result
    # is stored as it is, where lending a buffer cost a copy of it out (a clone) and a refused pass_on per tensor.
    pool = BufferPool(most=1 << 30)
    space = Workspace(most=1 << 30, pool=pool)
    small = space.take("result", (WARM_BYTES // 4 - 1,), torch.float32)
    assert not space.holds(small) and space.held_bytes == 0
    assert not space.pass_on(small) and pool.out == 0
    large = space.take("result", (WARM_BYTES // 4,), torch.float32)
    assert space.holds(large) and space.pass_on(large) and pool.out == 1
    kept = space.take("result", (WARM_BYTES // 4,), torch.float32)
    assert space.take("result", (16,), torch.float32).data_ptr() != kept.data_ptr()
    assert space.holds(kept)  # a small take leaves the key's buffer as it was


def test_a_tiny_tensor_computed_in_a_workspace_is_stored_in_the_buffer_its_method_computed_it_in(
        tmp_path: Path, make: ModelFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # A 90k-tensor merge of tiny tensors: each result was computed in the workspace's buffer and cloned out of it.
    config = load_config_text(write_config(tmp_path / "c.yml", linear_config(
        make("a", seed=1, layers=1, hidden=8, intermediate=8, vocab=16),
        make("b", seed=2, layers=1, hidden=8, intermediate=8, vocab=16))).read_text())
    plan = build_plan(config, open_inputs(config).models, PlanOptions(), CODECS)
    lent: list[torch.Tensor] = []
    take = Workspace.take

    def recorded(self: Workspace, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = take(self, key, shape, dtype)
        lent.append(t)
        return t

    monkeypatch.setattr(Workspace, "take", recorded)
    space = Workspace(most=1 << 30, pool=BufferPool(most=1 << 30))
    with InputSources.local(plan.model_dirs) as sources:
        for name, tp in plan.tensors.items():
            lent.clear()
            stored = TensorCompute(plan, tp, sources, NO_RESOURCES).whole(space)[name]
            assert torch.equal(stored, compute_tensor(plan, tp, sources, NO_RESOURCES)[name]), name
            assert [t.data_ptr() for t in lent] == [stored.data_ptr()], name  # linear's result, not a copy of it
    assert space.held_bytes == 0


def test_a_pool_keeps_a_bounded_number_of_idle_buffers() -> None:
    # Many small results given back (a 90k-tensor merge) must not pile up: each take scans the idle buffers.
    pool = BufferPool(most=1 << 30)
    buffers = [pool.take(256) for _ in range(MOST_IDLE * 3)]
    for b in buffers:
        pool.pass_on(b)
    pool.give_back(buffers)
    assert pool.out == 0 and pool.idle_bytes == 256 * MOST_IDLE
    assert pool.take(256).data_ptr() == buffers[-MOST_IDLE].data_ptr()  # the newest kept, the oldest dropped


def test_a_pool_with_no_buffer_out_looks_at_none_of_the_tensors_given_back() -> None:
    # A run of tiny tensors passes none on: the writer's give-backs looked up each one's storage (90k of them).
    def untouched() -> Iterator[torch.Tensor]:
        raise AssertionError("a tensor given back was looked at")
        yield torch.empty(0)

    pool = BufferPool(most=1 << 20)
    pool.give_back(untouched())
    buffer = pool.take(64)
    pool.pass_on(buffer)
    pool.give_back([torch.empty(4), buffer[8:]])
    assert pool.out == 0 and pool.idle_bytes == 64


@pytest.mark.parametrize("dequantize", [True, False])
def test_results_passed_on_are_stored_as_without_a_pool_until_given_back(tmp_path: Path, make: ModelFactory,
                                                                        dequantize: bool) -> None:
    # Plain float32 models (their inputs read into the workspace, the result passed on as it was computed) and FP8
    # ones: every tensor stored as a run without a workspace stores it, each surviving the tensors computed after
    # it while the writer holds it, and the buffers given back lent again.
    spec = {"layers": 2, "hidden": 64, "intermediate": 96, "vocab": 128}
    plain = linear_config(make("a", seed=1, **spec), make("b", seed=2, **spec))
    a, b = pair(tmp_path, make, fp8((16, 16)), fp8_config((16, 16)))
    for doc in (plain, {**linear_config(a, b), "dtype": "float32"}):
        config = load_config_text(write_config(tmp_path / "c.yml", doc).read_text())
        plan = build_plan(config, open_inputs(config).models, PlanOptions(dequantize=dequantize), CODECS)
        pool = BufferPool(most=1 << 30)
        space = Workspace(most=1 << 30, pool=pool, warm_bytes=0)  # these tensors are small
        with InputSources.local(plan.model_dirs) as sources:
            fresh = {name: compute_tensor(plan, tp, sources, NO_RESOURCES) for name, tp in plan.tensors.items()}
            passed = {name: TensorCompute(plan, tp, sources, NO_RESOURCES).whole(space)
                      for name, tp in plan.tensors.items()}
            assert pool.out > 0 or not dequantize
            for stored in passed.values():
                pool.give_back(stored.values())
            assert pool.out == 0
            again = {name: TensorCompute(plan, tp, sources, NO_RESOURCES).whole(space)
                     for name, tp in plan.tensors.items()}
        for name, parts in fresh.items():
            for got in (passed[name], again[name]):
                assert got.keys() == parts.keys()
                for part, t in parts.items():
                    assert not space.holds(got[part]), part
                    assert torch.equal(got[part].view(torch.uint8), t.view(torch.uint8)), part


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    # The engine's workers run torch on one thread each: linear sums tile by tile only then.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("out_type", ["safetensors", "F16", "Q8_0"])
def test_a_bfloat16_merge_is_cast_and_encoded_into_lent_buffers_passed_on_to_the_writer(
        tmp_path: Path, make: ModelFactory, monkeypatch: pytest.MonkeyPatch, out_type: str) -> None:
    # linear's float32 sum cast to bfloat16 (acc.to()) and a GGUF's encoding (a float32 copy, then a float16 one
    # for F16) were fresh tensors of the output's size, every page of them zeroed by the kernel at first touch: the
    # cast now goes to the workspace's "cast" buffer, a block type's float32 values to its "gguf-values" one and
    # the encoding into its "out:" buffer, passed on to the writer, with the bytes a run without a workspace
    # stores. (A GGUF output's codec on each tensor, q permuted as llama's is: these models have no tokenizer a
    # GGUF vocabulary is built from.)
    spec = {"layers": 1, "hidden": 1024, "intermediate": 2048, "vocab": 256, "dtype": torch.bfloat16}
    doc = {**linear_config(make("a", seed=1, **spec), make("b", seed=2, **spec)), "dtype": "bfloat16"}
    config = load_config_text(write_config(tmp_path / "c.yml", doc).read_text())
    plan = build_plan(config, open_inputs(config).models, PlanOptions(), CODECS)
    if out_type != "safetensors":
        ggml_type = {"F16": F16, "Q8_0": Q8_0}[out_type]
        tensors = {name: replace(tp, out_codec=GgufOutCodec(name, ggml_type, "permute" if "q_proj" in name else "",
                                                            256)) for name, tp in plan.tensors.items()}
        plan = replace(plan, tensors=tensors)
    uses: set[str] = set()
    take = Workspace.take

    def recorded(self: Workspace, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        uses.add(key)
        return take(self, key, shape, dtype)

    monkeypatch.setattr(Workspace, "take", recorded)
    pool = BufferPool(most=1 << 30)
    space = Workspace(most=1 << 30, pool=pool)
    with _one_thread(), InputSources.local(plan.model_dirs) as sources:
        fresh = {name: compute_tensor(plan, tp, sources, NO_RESOURCES) for name, tp in plan.tensors.items()}
        lent = {name: TensorCompute(plan, tp, sources, NO_RESOURCES).whole(space) for name, tp in plan.tensors.items()}
    large = [name for name, parts in fresh.items() if next(iter(parts.values())).nbytes >= WARM_BYTES]  # one part
    assert large and pool.out == len(large)  # each large tensor's stored part is a buffer passed on
    assert ("gguf-values" in uses) == (out_type == "Q8_0")
    for name, parts in fresh.items():
        assert lent[name].keys() == parts.keys()
        for part, t in parts.items():
            assert not space.holds(lent[name][part]), part
            assert torch.equal(lent[name][part].view(torch.uint8), t.view(torch.uint8)), part

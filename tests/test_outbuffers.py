"""The outputs' buffers the writer gives back to be lent again (resumerge.engine.outbuffers), and the codecs and
workspace that encode and copy results into them."""

from __future__ import annotations

import torch

from resumerge.engine.outbuffers import SMALLEST, OutputBuffers
from resumerge.engine.workspace import Workspace, Workspaces
from resumerge.inputs.codecs import PLAIN, BlockFp8Codec

MIB = 1 << 20


def test_a_buffer_is_lent_again_only_once_given_back_and_only_for_its_size() -> None:
    pool = OutputBuffers(most=8 * MIB)
    first = pool.take((MIB // 4,), torch.float32)
    assert pool.take((MIB // 4,), torch.float32).data_ptr() != first.data_ptr()  # still out: a fresh one
    pool.give_back([first])
    assert pool.held_bytes == MIB
    assert pool.take((2 * MIB,), torch.uint8).data_ptr() != first.data_ptr()  # another size
    again = pool.take((512, 512), torch.float32)  # the same bytes, another shape and dtype
    assert again.data_ptr() == first.data_ptr() and again.is_contiguous() and pool.held_bytes == 0
    pool.give_back([again])
    pool.give_back([again])  # given back twice: held once
    assert pool.held_bytes == MIB


def test_only_whole_lent_buffers_are_taken_back_and_small_ones_are_never_pooled() -> None:
    pool = OutputBuffers(most=8 * MIB)
    lent = pool.take((2 * MIB,), torch.uint8)
    pool.give_back([torch.empty(2 * MIB, dtype=torch.uint8), lent[MIB:], lent[:MIB]])  # never lent; parts of one
    assert pool.held_bytes == 0
    small = pool.take((SMALLEST // 2,), torch.uint8)
    pool.give_back([small])
    assert pool.held_bytes == 0


def test_what_lies_idle_stays_within_its_bound_oldest_dropped_first_and_trim_empties_it() -> None:
    pool = OutputBuffers(most=3 * MIB)
    a, b, c = (pool.take((n * MIB,), torch.uint8) for n in (1, 2, 4))
    pool.give_back([a, b])
    assert pool.held_bytes == 3 * MIB
    pool.give_back([c])  # larger than the bound: dropped, nothing else
    assert pool.held_bytes == 3 * MIB
    d = pool.take((MIB,), torch.uint8)  # a's buffer
    pool.give_back([d, pool.take((MIB,), torch.uint8)])  # b (the oldest) makes room for the second MiB
    assert pool.held_bytes == 2 * MIB
    assert pool.take((2 * MIB,), torch.uint8).data_ptr() != b.data_ptr()
    assert pool.trim() == 2 * MIB and pool.held_bytes == 0


def test_results_are_encoded_and_copied_out_into_the_lent_buffers_with_the_same_bytes() -> None:
    pool = OutputBuffers(most=64 * MIB)
    space = Workspace(most=64 * MIB, outputs=pool)
    values = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    codec = BlockFp8Codec((128, 128))
    fresh = codec.encode(values, "float32")
    lent = codec.encode(values, "float32", space.output)
    assert torch.equal(lent["main"].view(torch.uint8), fresh["main"].view(torch.uint8))
    assert torch.equal(lent["scale"], fresh["scale"])
    cast = PLAIN.encode(values, "BF16", space.output)["main"]
    assert torch.equal(cast.view(torch.int16), values.to(torch.bfloat16).view(torch.int16))
    assert PLAIN.encode(values, "F32", space.output)["main"] is values  # no cast: no copy
    result = space.take("result", (1024, 1024), torch.float32).copy_(values)
    out = space.copy_out(result)
    assert not space.holds(out) and torch.equal(out, values)
    pool.give_back([lent["main"], cast, out])
    assert pool.held_bytes == values.numel() * (1 + 2 + 4)


def test_workspaces_trim_gives_back_the_idle_output_buffers_too() -> None:
    pool = OutputBuffers(most=8 * MIB)
    spaces = Workspaces(most=8 * MIB, workers=1, outputs=pool)
    with spaces.lend() as space:
        pool.give_back([space.output((MIB,), torch.uint8)])
        space.take("input0", (MIB,), torch.uint8)
    assert spaces.trim() == 2 * MIB and pool.held_bytes == 0

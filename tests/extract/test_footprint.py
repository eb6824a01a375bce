"""The factor units' declared footprints cover what the decomposition allocates beyond its inputs, and are not far
above it: the governor admits each module by them, so they must never understate the SVD workspace (measured by
the profiler replay the merge methods' footprint tests use), for the randomized truncation and the full SVD alike,
at ranks small and close to the matrix's size, in float32 and bfloat16."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from methods.footprint_cases import peaks

from resumerge.config.settings import RunSettings
from resumerge.merge.methods import get_method
from resumerge.merge.methods.footprint import working_bytes
from resumerge.merge.methods.spec import MergeContext
from resumerge.runs.extract.decompose import full_svd
from resumerge.runs.extract.factors import FACTOR_A, FACTOR_A_FULL, FACTOR_B, FACTOR_B_FULL, SAVED, UNITS, decompose

NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
# (shape, rank, exact): the randomized truncation at a small rank and just below its fallback to a full SVD (the
# widest sketches), on square, wide and tall weights; the full SVD asked for and as the fallback.
CASES = [((256, 256), 8, False), ((256, 256), 60, False), ((192, 512), 44, False), ((512, 192), 44, False),
         ((256, 256), 8, True), ((192, 512), 64, False)]
# The declared figures may exceed a measurement by this much (the governor's MARGIN of 1.25 included): the full
# SVD's per element, the randomized truncation's per panel element (its constant differs between square and wide
# weights).
NOT_FAR_ABOVE = {True: 1.6, False: 2.0}


def _measured(shape: tuple[int, int], dtype: torch.dtype, rank: int, exact: bool) -> int:
    """Peak bytes of a module's decomposition beyond its inputs, the task vector taken in FT's buffer as the
    engine's lazily read inputs allow (second of two calls: the first warms up)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(shape, generator=g).to(dtype)
    ft = (base.float() + 0.01 * torch.randn(shape, generator=g)).to(dtype)
    params = {"rank": rank, "exact": exact, "seed": 1, "sv_epsilon": 0.0, "distribute_scale": True, "threads": 1,
              "embedding": False}
    owned = [ft.clone() for _ in range(2)]  # each call's own FT buffer, made before it
    calls = [lambda mine=mine: decompose(MergeContext([base, mine], 0, [{}, {}], params, owned_inputs=True))
             for mine in owned]
    return peaks(calls)[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_declared_footprints_cover_the_decomposition(dtype: torch.dtype) -> None:
    ratios: dict[bool, list[float]] = {True: [], False: []}  # full SVD -> declared / measured of each case
    for shape, rank, exact in CASES:
        full = full_svd(rank, *shape, exact=exact)
        measured = _measured(shape, dtype, rank, exact)
        for name in ((FACTOR_A_FULL, FACTOR_B_FULL) if full else (FACTOR_A, FACTOR_B)):
            spec = get_method(name, UNITS)
            assert spec is not None and spec.footprint is not None and spec.footprint.of_inputs
            reserved = working_bytes(spec.footprint, NAMES[dtype], shape, 2, base=True, rank=rank)
            assert measured <= reserved, (name, shape, rank, measured, reserved)
            ratios[full].append(reserved / measured)
    for full in (True, False):
        assert min(ratios[full]) <= NOT_FAR_ABOVE[full], (full, ratios[full])
    # At a small rank the randomized truncation reserves a fraction of the full SVD's workspace.
    small = {name: working_bytes(get_method(name, UNITS).footprint, NAMES[dtype], (2048, 5504), 2, base=True, rank=32)
             for name in (FACTOR_A, FACTOR_A_FULL)}  # type: ignore[union-attr]
    assert small[FACTOR_A] < small[FACTOR_A_FULL] / (2 if dtype == torch.bfloat16 else 8), small


def test_a_factor_unit_is_admitted_by_its_weight(pair: Callable[[str], tuple[Path, Path]], tmp_path: Path) -> None:
    """The unit of a rank-4 factor reserves the workspace of the whole weight it factors, not of its 4 rows; the
    planner picks the randomized units where the truncation runs randomized, the full SVD's elsewhere."""
    from resumerge.merge.plan.merge_plan import PlanOptions
    from resumerge.merge.plan.workunits import estimate_bytes
    from resumerge.runs.extract.prepare import prepare_extraction
    from resumerge.runs.extract.spec import ExtractSpec, spec_text

    base, ft = pair("llama-wide")
    for exact in (False, True):
        text = spec_text(ExtractSpec(model=str(ft), base_model=str(base), max_rank=4, exact=exact))
        plan = prepare_extraction(text, PlanOptions(), RunSettings()).plan
        units = [t for t in plan.tensors.values() if t.name.endswith("lora_A.weight")]
        assert {t.method for t in units} == {FACTOR_A_FULL if exact else FACTOR_A}
        tp = units[0]
        spec = plan.method_of(tp)
        assert spec.footprint is not None
        weight = tp.inputs[0].shape
        assert tp.shape[0] == 4 and weight[0] > 4
        assert estimate_bytes(tp, spec) >= working_bytes(spec.footprint, "float32", weight, 2, base=True)


def test_the_task_vector_reads_base_a_row_chunk_at_a_time() -> None:
    """With the engine's lazy inputs, BASE is never read whole: FT − BASE is taken in FT's buffer from BASE's row
    chunks, with the bits of one whole subtraction."""
    from resumerge.merge.plan.workunits import CHUNK_ELEMENTS
    from resumerge.runs.extract.factors import task_vector

    g = torch.Generator().manual_seed(3)
    base, ft = torch.randn(300, 1000, generator=g), torch.randn(300, 1000, generator=g)
    reads: list[tuple[int, int]] = []

    class Inputs(list):  # type: ignore[type-arg]
        def __getitem__(self, i):  # type: ignore[no-untyped-def]
            assert i == 1, "BASE read whole"
            return ft.clone()

    def rows(i: int, first: int, stop: int) -> torch.Tensor:
        assert i == 0
        reads.append((first, stop))
        return base[first:stop].clone()

    ctx = MergeContext(Inputs([base, ft]), 0, [{}, {}], {"embedding": False}, owned_inputs=True, read_rows=rows)
    assert torch.equal(task_vector(ctx), ft - base)
    assert len(reads) > 1 and max(stop - first for first, stop in reads) * 1000 <= CHUNK_ELEMENTS
    assert [r for pair in reads for r in pair] == sorted(r for pair in reads for r in pair)  # in order, once each
    assert reads[0][0] == 0 and reads[-1][1] == 300


def test_tensors_saved_whole_stream_in_row_chunks(pair: Callable[[str], tuple[Path, Path]]) -> None:
    """FT's tensors saved whole (embeddings, head, norms) go to the adapter in row chunks of at most the method's
    ``row_chunk`` entries, whatever the budget; a tensor of one chunk or less is computed whole."""
    from dataclasses import replace

    from resumerge.merge.plan.merge_plan import PlanOptions
    from resumerge.merge.plan.workunits import ROWS, WHOLE, fixed_chunk_rows, unit_mode
    from resumerge.runs.extract.prepare import prepare_extraction
    from resumerge.runs.extract.spec import ExtractSpec, spec_text

    base, ft = pair("llama-wide")
    plan = prepare_extraction(spec_text(ExtractSpec(model=str(ft), base_model=str(base), max_rank=4)),
                              PlanOptions(), RunSettings()).plan
    saved = [t for t in plan.tensors.values() if t.method == SAVED]
    embedding = max(saved, key=lambda t: t.nbytes)
    assert len(embedding.shape) == 2
    spec = get_method(SAVED, UNITS)
    assert spec is not None and spec.row_chunk is not None
    row = embedding.shape[1]
    small = replace(spec, row_chunk=3 * row)  # the tiny model's embedding is smaller than the real chunk
    assert fixed_chunk_rows(embedding, small) == 3
    assert unit_mode(embedding, small, 1 << 40, "cpu") == ROWS
    assert unit_mode(embedding, replace(spec, row_chunk=embedding.shape[0] * row), 1 << 40, "cpu") == WHOLE


def test_a_modules_second_factor_collects_the_first_and_takes_no_worker(
        pair: Callable[[str], tuple[Path, Path]]) -> None:
    """In the adapter's data order each module's second factor unit collects its sibling's truncation: the engine
    lets it wait beside its two working units (two modules decomposed at once) and ``plan`` counts the pair once."""
    from resumerge.merge.plan.merge_plan import PlanOptions
    from resumerge.merge.plan.workunits import collects_sibling
    from resumerge.runs.extract.prepare import prepare_extraction
    from resumerge.runs.extract.spec import ExtractSpec, spec_text

    base, ft = pair("llama-wide")
    plan = prepare_extraction(spec_text(ExtractSpec(model=str(ft), base_model=str(base), max_rank=4)),
                              PlanOptions(), RunSettings()).plan
    order = [plan.tensors[n] for s in plan.shards for n in s.tensors]
    flags = []
    for previous, tp in zip([None, *order[:-1]], order, strict=True):
        spec = plan.method_of(tp)
        flags.append(collects_sibling(previous, tp, spec))
    siblings = [tp for tp, flag in zip(order, flags, strict=True) if flag]
    modules = {dict(tp.params)["module"] for tp in order if tp.method == FACTOR_A}
    assert len(siblings) == len(modules) > 0
    assert {dict(tp.params)["module"] for tp in siblings} == modules
    assert not any(flags[i] and flags[i + 1] for i in range(len(flags) - 1))  # never two in a row

"""A transplant within --max-memory: the unit reads MODEL's and DONOR's matrices by row ranges (never indexing a whole
input) and gives the rows it gives from whole matrices; ``plan`` names what the unit holds (its shared rows and
batch, not the two whole tables) and refuses a budget under it in one line, exit 2."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import overload

import pytest
import torch
from support import cli

import resumerge.runs.transplant.units as registered
from resumerge import api
from resumerge.analyses.estimate.costs import Estimate
from resumerge.merge.methods.resources import Resources
from resumerge.merge.methods.spec import MergeContext
from resumerge.runs.transplant.approximate import Method
from resumerge.runs.transplant.tokens import MatrixMatch
from resumerge.runs.transplant.units import Transplant, surgery_rows
from transplant.pairs import make_pair

MODEL_ROWS, DONOR_ROWS, MODEL_WIDTH, DONOR_WIDTH = 70, 90, 12, 16


class _Unreadable(Sequence[torch.Tensor]):
    """Inputs that may only be read by row ranges."""

    def __len__(self) -> int:
        return 2

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[torch.Tensor]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        raise AssertionError("a whole input was read")


def _match() -> MatrixMatch:
    shared = tuple((d, (d * 7) % MODEL_ROWS) for d in range(0, 60))  # DONOR row, MODEL row
    approximated = tuple(range(60, DONOR_ROWS))
    pieces = tuple(((d * 3) % MODEL_ROWS, (d * 5 + 1) % MODEL_ROWS) for d in approximated)
    return MatrixMatch(DONOR_ROWS, shared, approximated, shared, pieces, junk=(88,), exact=len(shared))


def _run(method: Method, tensors: tuple[torch.Tensor, torch.Tensor], *, chunk_bytes: int,
         ranges: list[tuple[int, int, int]] | None) -> torch.Tensor:
    transplant = Transplant({"embed": _match()}, method, 8, None, chunk_bytes)
    params = {"matrix": "embed", "seed": 3, "source": "x", "device": "cpu", "model_rows": MODEL_ROWS,
              "donor_rows": DONOR_ROWS, "held": 0}

    def read_rows(i: int, first: int, stop: int) -> torch.Tensor:
        assert ranges is not None
        ranges.append((i, first, stop))
        return tensors[i][first:stop].clone()

    ctx = MergeContext(tensors=_Unreadable() if ranges is not None else tensors, base_index=None,
                       model_params=[{}, {}], params=params, owned_inputs=ranges is not None,
                       read_rows=read_rows if ranges is not None else None, resources=Resources((transplant,)))
    return surgery_rows(ctx)


@pytest.mark.parametrize(("name", "tolerance"), [("omp", 0.0), ("common_interpolation", 0.0), ("subword", 0.0),
                                                 ("landmark_pca", 0.0), ("randn", 0.0), ("mean", 1e-6),
                                                 ("john_hewitt", 1e-5)])
def test_the_matrices_are_read_by_row_ranges(name: str, tolerance: float) -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = (torch.randn((MODEL_ROWS, MODEL_WIDTH), generator=generator),
               torch.randn((DONOR_ROWS, DONOR_WIDTH), generator=generator))
    method = Method(name, k=4)
    whole = _run(method, tensors, chunk_bytes=1 << 30, ranges=None)
    ranges: list[tuple[int, int, int]] = []
    chunk = 16  # rows of MODEL per range; DONOR's rows are wider, fewer per range
    ranged = _run(method, tensors, chunk_bytes=chunk * MODEL_WIDTH * 4, ranges=ranges)
    longest = {i: max(stop - first for j, first, stop in ranges if j == i) for i in (0, 1)}
    assert longest[0] <= chunk and longest[1] <= chunk * MODEL_WIDTH // DONOR_WIDTH, ranges
    assert whole.shape == ranged.shape == (DONOR_ROWS, MODEL_WIDTH)
    for donor_row, model_row in _match().copies:
        assert torch.equal(ranged[donor_row], tensors[0][model_row])  # shared rows bit for bit
    assert not ranged[88].any()
    if tolerance == 0.0:
        assert torch.equal(whole, ranged)
    else:
        assert torch.allclose(whole, ranged, atol=tolerance, rtol=0), (whole - ranged).abs().max()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_pair(tmp_path_factory.mktemp("pair"), model_hidden=256, donor_hidden=256)


def test_plan_names_what_the_unit_holds_not_the_whole_tables(pair: tuple[Path, Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    model, donor = pair
    tables = 2 * 294 * 256 * 4  # MODEL's and DONOR's embeddings (float32)

    def largest(chunk: int) -> int:
        monkeypatch.setattr(registered, "CHUNK_BYTES", chunk)
        estimate = api.tokensurgeon(str(model), str(donor), tmp_path / "out", plan=True,
                                    surgery=api.Surgery(k=8), settings=api.Settings(state_dir=tmp_path / "s"))
        assert isinstance(estimate, Estimate)
        return estimate.memory.largest_unit_bytes

    whole, ranged = largest(1 << 30), largest(4096)
    # read whole, a table and its gathered copy are held; by ranges only a range of each
    assert whole - ranged >= 2 * tables
    assert not (tmp_path / "out").exists()


def test_plan_refuses_a_budget_it_cannot_meet_in_one_line(pair: tuple[Path, Path], tmp_path: Path) -> None:
    model, donor = pair
    ran = cli("tokensurgeon", model, donor, tmp_path / "out", "--plan", "--max-memory", "1MB",
              "--state-dir", tmp_path / "s")
    assert ran.returncode == 2, ran.stderr
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "will not fit" in lines[0] and "--max-memory" in lines[0], ran.stderr
    assert not (tmp_path / "out").exists()


def test_plan_times_the_unit_on_the_real_tables(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """plan's time comes from the transplant's unit run on MODEL's and DONOR's tables (it was left unmeasured: a
    sample of the output's rows read past MODEL's smaller table), at a reduced scale scaled to every token."""
    model, donor = pair
    estimate = api.tokensurgeon(str(model), str(donor), tmp_path / "out", plan=True,
                                surgery=api.Surgery(k=8,
                                                    batch_size=16), settings=api.Settings(state_dir=tmp_path / "s"))
    assert isinstance(estimate, Estimate)
    units = [g for g in estimate.time.compute if g.method == registered.SURGERY_ROWS]
    assert len(units) == 2  # the embedding and the untied head
    for group in units:
        assert group.seconds is not None and group.seconds > 0, group.note
        assert not group.synthetic and group.sample_bytes > 0
        assert "16 of 82 approximated tokens" in group.note
    assert not (tmp_path / "out").exists() and not (tmp_path / "s").exists()


def test_the_probe_cuts_the_approximated_tokens_and_keeps_nothing() -> None:
    match = _match()
    store = object()
    transplant = Transplant({"embed": match}, Method("omp", k=4), 8, store, 1 << 20)  # type: ignore[arg-type]
    probe = registered.scaled_probe(Resources((transplant,)), {"matrix": "embed"})
    small, large = (r.find(Transplant) for r in (probe.small, probe.large))
    assert small is not None and large is not None
    assert small.matches["embed"].approximated == () and small.store is None and large.store is None
    taken = min(8, len(match.approximated))
    assert large.matches["embed"].approximated == match.approximated[:taken]
    assert large.matches["embed"].copies == match.copies and large.matches["embed"].shared == match.shared
    assert probe.scale == len(match.approximated) / taken


def test_the_probe_is_one_batch_of_the_runs_size() -> None:
    """plan timed a transplant's unit on 32 tokens whatever its batches (512 by default), so each batch's fixed
    cost was counted once per 32 tokens: "about 3 min" for a 12-26 s transplant (issue 97, item 6). The probe is a
    batch as the run computes one, and scales by the run's batches."""
    total = 200  # more tokens than the 32 of a probe before
    match = replace(_match(), approximated=tuple(range(total)), pieces=tuple((t % MODEL_ROWS,) for t in range(total)))
    for batch in (64, total):
        transplant = Transplant({"embed": match}, Method("omp", k=4), batch, None, 1 << 20)
        probe = registered.scaled_probe(Resources((transplant,)), {"matrix": "embed"})
        large = probe.large.find(Transplant)
        assert large is not None and len(large.matches["embed"].approximated) == batch
        assert probe.scale == total / batch  # the run's batches, the last one's part of one


def test_a_gather_reads_of_each_range_only_the_rows_from_its_first_id_to_its_last() -> None:
    """A batch's DONOR rows are a stretch of the vocabulary: its gather reads that stretch of each range it falls in,
    not the whole ranges (on Gemma-3-270M ← SmolLM2 a batch's read went from ~0.3 s to ~0.04 s; a worker may wait
    for it)."""
    table = torch.arange(100 * 3, dtype=torch.float32).reshape(100, 3)
    reads: list[tuple[int, int]] = []

    def read(first: int, stop: int) -> torch.Tensor:
        reads.append((first, stop))
        return table[first:stop].clone()

    ids = torch.tensor([47, 5, 9, 33, 12], dtype=torch.long)
    got = registered.RowRanges(read, 100, 16).gather(ids)
    assert torch.equal(got, table[ids])
    assert reads == [(5, 13), (33, 48)]

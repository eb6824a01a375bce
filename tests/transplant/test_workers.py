"""A matrix's batches computed on several threads (issue 85): the same bytes with one worker as with two or three,
whatever order the batches finish in, and the workers really computed batches side by side (else the comparison
would prove nothing); and no more batches alive at once than the unit's held bytes count."""

from __future__ import annotations

import threading
import weakref
from pathlib import Path

import pytest
import torch
from support import cli, digests

import resumerge.runs.transplant.units as registered
from resumerge.inputs.kernels import serial_kernels
from resumerge.merge.methods.resources import Resources
from resumerge.merge.methods.spec import MergeContext
from resumerge.runs.transplant.approximate import Batch, Method, Rope
from resumerge.runs.transplant.tokens import MatrixMatch
from resumerge.runs.transplant.units import Transplant, surgery_rows
from transplant.pairs import make_pair

MODEL_ROWS, DONOR_ROWS, MODEL_WIDTH, DONOR_WIDTH = 70, 130, 12, 16


def _match() -> MatrixMatch:
    shared = tuple((d, (d * 7) % MODEL_ROWS) for d in range(0, 60))  # DONOR row, MODEL row
    approximated = tuple(range(60, DONOR_ROWS))
    pieces = tuple(((d * 3) % MODEL_ROWS, (d * 5 + 1) % MODEL_ROWS) for d in approximated)
    return MatrixMatch(DONOR_ROWS, shared, approximated, shared, pieces, exact=len(shared))


def _rows(method: Method, workers: int, tensors: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    transplant = Transplant({"embed": _match()}, method, 8, None, workers=workers)  # nine batches
    params = {"matrix": "embed", "seed": 3, "source": "x", "device": "cpu", "model_rows": MODEL_ROWS,
              "donor_rows": DONOR_ROWS, "held": 0}
    ctx = MergeContext(tensors=tensors, base_index=None, model_params=[{}, {}], params=params,
                       resources=Resources((transplant,)))
    with serial_kernels():  # as the engine runs a CPU unit beside others
        return surgery_rows(ctx)


# name -> the method (the least-squares ones too: their solver gives the same bits call after call)
METHODS = {
    **{name: Method(name, k=4, noise=0.1 if name in ("omp", "mean") else None)
       for name in ("omp", "common_interpolation", "randn", "john_hewitt", "subword", "mean", "landmark_pca", "zero",
                    "stb")},
    "mp_rope": Method("mp_rope", k=4, rope=(Rope(2, 10000.0), Rope(2, 500000.0))),
    "least_squares": Method("common_interpolation", k=4, weight_scheme="least_squares"),
    "barycentric": Method("common_interpolation", k=4, weight_scheme="barycentric"),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_the_rows_are_the_same_bytes_however_many_workers(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = (torch.randn((MODEL_ROWS, MODEL_WIDTH), generator=generator),
               torch.randn((DONOR_ROWS, DONOR_WIDTH), generator=generator))
    method = METHODS[name]
    one = _rows(method, 1, tensors)
    threads: list[str] = []
    together = threading.Barrier(2, timeout=30)  # the first two batches only finish once both are being computed
    computed = registered.approximate

    def approximate(method: Method, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        me = threading.current_thread().name
        threads.append(me)
        if threads.count(me) == 1 and len(set(threads)) <= 2:
            together.wait()
        return computed(method, batch, generator)

    monkeypatch.setattr(registered, "approximate", approximate)
    for workers in (2, 3):
        threads.clear()
        together.reset()
        many = _rows(method, workers, tensors)
        assert len(threads) == 9 and len(set(threads)) >= 2, threads  # two workers computed batches
        assert all(t.startswith("tokensurgeon") for t in threads), threads
        assert many.dtype == one.dtype and torch.equal(many.view(torch.uint8), one.view(torch.uint8)), workers


def test_the_kernels_split_over_threads_keep_the_batches_on_the_units_thread(monkeypatch: pytest.MonkeyPatch
                                                                             ) -> None:
    """Where the engine lets the unit's kernels use torch's threads, the batches stay on its thread: a worker's
    kernels would run on one thread, other bits than the unit's."""
    generator = torch.Generator().manual_seed(0)
    tensors = (torch.randn((MODEL_ROWS, MODEL_WIDTH), generator=generator),
               torch.randn((DONOR_ROWS, DONOR_WIDTH), generator=generator))
    threads: list[str] = []
    computed = registered.approximate
    monkeypatch.setattr(registered, "approximate",
                        lambda *a: threads.append(threading.current_thread().name) or computed(*a))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    transplant = Transplant({"embed": _match()}, Method("omp", k=4), 8, None, workers=2)
    params = {"matrix": "embed", "seed": 3, "source": "x", "device": "cpu", "model_rows": MODEL_ROWS,
              "donor_rows": DONOR_ROWS, "held": 0}
    surgery_rows(MergeContext(tensors=tensors, base_index=None, model_params=[{}, {}], params=params,
                              resources=Resources((transplant,))))
    assert set(threads) == {threading.current_thread().name}, threads


def test_the_output_is_the_same_bytes_with_one_thread_and_two(tmp_path: Path) -> None:
    model, donor = make_pair(tmp_path / "pair")
    outputs = []
    for threads in (1, 2):
        out = tmp_path / f"j{threads}"
        ran = cli("tokensurgeon", model, donor, out, "-k", "4", "--batch-size", "8", "-j", str(threads),
                  "--state-dir", tmp_path / f"s{threads}", "-q")
        assert ran.returncode == 0, ran.stderr
        outputs.append({n: d for n, d in digests(out).items() if n.endswith(".safetensors")})
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_no_more_batches_are_alive_than_held_bytes_counts(workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """held_bytes counts BATCH_WORKERS batches at most, each from its DONOR rows read to its rows written into the
    matrix: the unit holds no more. A batch is alive here from its inputs made until both its DONOR rows are let go
    and its rows are written (batches are made and written in batch order); the number alive is counted each time
    one is made. Reading the next batch ahead of the oldest's rows held a third batch's rows beside the two
    computed (and a finished batch's DONOR rows beside the next one, on one thread)."""
    alive: set[int] = set()  # made, and not both let go and written
    inputs: set[int] = set()  # whose DONOR rows are still referenced
    most, made, written = 0, 0, 0
    lock = threading.Lock()  # the DONOR rows are let go on the workers' threads
    batch, put = registered.Batch, registered._put

    def gone(number: int) -> None:
        with lock:
            inputs.discard(number)
            if number < written:
                alive.discard(number)

    def tracked(*args: object, **kwargs: object) -> Batch:
        nonlocal most, made
        made_batch = batch(*args, **kwargs)  # type: ignore[arg-type]
        with lock:
            number, made = made, made + 1
            alive.add(number)
            inputs.add(number)
            most = max(most, len(alive))
        weakref.finalize(made_batch.targets, gone, number)
        return made_batch

    def writing(out: torch.Tensor, ids: list[int], rows: torch.Tensor) -> None:
        nonlocal written
        put(out, ids, rows)
        with lock:
            number, written = written, written + 1
            if number not in inputs:
                alive.discard(number)

    monkeypatch.setattr(registered, "Batch", tracked)
    monkeypatch.setattr(registered, "_put", writing)
    generator = torch.Generator().manual_seed(0)
    tensors = (torch.randn((MODEL_ROWS, MODEL_WIDTH), generator=generator),
               torch.randn((DONOR_ROWS, DONOR_WIDTH), generator=generator))
    _rows(Method("omp", k=4), workers, tensors)
    assert made == written == 9
    assert most == min(workers, registered.BATCH_WORKERS), most

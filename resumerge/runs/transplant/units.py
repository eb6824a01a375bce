"""The transplant's unit function: one output matrix (the token embedding or the head) with DONOR's vocabulary.

A pure function of its two inputs (MODEL's matrix, DONOR's) and the run's :class:`Transplant` (in the units'
context's resources, made by the planning from the two tokenizers): rows of matched tokens are MODEL's rows copied
bit for bit, the others approximated one batch at a time (:mod:`~resumerge.runs.transplant.approximate`), each batch
kept in the run's :class:`~resumerge.runs.transplant.batches.BatchStore` once computed, so a resumed run computes only
the batches a killed one had not finished. Random draws come from a generator seeded by (``--random-seed``, the matrix,
the batch's number): never by run order, so a resumed run draws the same numbers.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from itertools import pairwise
from typing import Any

from resumerge.inputs.kernels import serial_kernels
from resumerge.machine.torch_import import torch
from resumerge.merge.methods.footprint import measured
from resumerge.merge.methods.resources import Resources
from resumerge.merge.methods.spec import MergeContext, MethodSpec, ParamSpec, ScaledProbe, Scope, declared
from resumerge.runs.transplant.approximate import Batch, Method, ModelStats, approximate, model_stats
from resumerge.runs.transplant.batches import BatchStore
from resumerge.runs.transplant.tokens import MatrixMatch

SURGERY_ROWS = "tokensurgeon_rows"


# The most bytes of one input matrix read at once: a larger table is read by row ranges of about this size, so no
# table is ever whole in memory (tables this small are read whole, one range). The output's bytes do not depend on
# it: rows are copied or gathered as they are, and MODEL's statistics are float64 sums.
CHUNK_BYTES = 64 << 20
# Which approximation reads what: DONOR's rows of the approximated tokens, both models' shared rows, MODEL's sums.
_READS_TARGETS = frozenset({"omp", "common_interpolation", "landmark_pca", "stb", "mp_rope"})
_READS_STATS = frozenset({"mean", "john_hewitt"})


@dataclass(frozen=True)
class Transplant:
    """One run's matches (by matrix: ``embed``, ``lm_head``), its method and batch size, where its finished
    batches are kept (None: nowhere, a ``--plan`` estimate), the most bytes of a matrix read at once, and how many
    threads compute a matrix's batches (the run's threads: the output's bytes do not depend on it)."""

    matches: Mapping[str, MatrixMatch]
    method: Method
    batch_size: int
    store: BatchStore | None = None
    chunk_bytes: int = CHUNK_BYTES
    workers: int = 1


def batch_seed(seed: int, matrix: str, batch: int) -> int:
    """The generator seed of batch ``batch`` of ``matrix``: depends only on (seed, matrix, batch)."""
    text = f"{seed}\x00tokensurgeon\x00{matrix}\x00{batch}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & (2**63 - 1)


class RowRanges:
    """One input matrix of ``total`` rows, read ``read(first, stop)`` by ranges of at most ``chunk`` rows: the
    whole (kept) when it is one range, else each range read when needed and let go."""

    def __init__(self, read: Callable[[int, int], torch.Tensor], total: int, chunk: int) -> None:
        self._read, self.total, self.chunk = read, total, max(1, chunk)
        self._whole: torch.Tensor | None = None

    def ranges(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, rows) of each range in order."""
        if self.chunk >= self.total:
            yield 0, self._all()
            return
        for first in range(0, self.total, self.chunk):
            yield first, self._read(first, min(self.total, first + self.chunk))

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64, any order), read range by range: of each range holding one of them, its rows from
        the first of them to the last."""
        if self.chunk >= self.total:
            whole = self._all()
            return whole[ids.to(whole.device)]
        order = torch.argsort(ids)
        ordered = ids[order]
        out: torch.Tensor | None = None
        bounds = torch.arange(0, self.total + self.chunk, self.chunk, dtype=ordered.dtype, device=ordered.device)
        cuts = torch.searchsorted(ordered, bounds).tolist()
        for lo, hi in pairwise(cuts):
            if lo == hi:
                continue
            # From the range's first id to its last, not the whole range: a batch's ids (DONOR's, ascending) are a
            # stretch of the vocabulary, and the unit's thread reads them while a worker may wait for the batch.
            start = int(ordered[lo])
            rows = self._read(start, int(ordered[hi - 1]) + 1)
            if out is None:
                out = rows.new_empty((ids.shape[0], rows.shape[1]))
            out[order[lo:hi].to(rows.device)] = rows[(ordered[lo:hi] - start).to(rows.device)]
        if out is None:  # no ids: the matrix's width and dtype from its first row
            first_row = self._read(0, 1)
            return first_row.new_empty((0, first_row.shape[1]))
        return out

    def _all(self) -> torch.Tensor:
        if self._whole is None:
            self._whole = self._read(0, self.total)
        return self._whole


def _inputs(ctx: MergeContext, chunk_bytes: int) -> tuple[RowRanges, RowRanges]:
    """MODEL's and DONOR's matrices as row ranges: read by the engine's ``read_rows`` where it lends it (the
    engine's lazy inputs), else slices of the tensors in hand (``plan``'s sample, a test's)."""
    tables = []
    for i, rows in enumerate(("model_rows", "donor_rows")):
        if ctx.read_rows is not None:
            read = partial(ctx.read_rows, i)
            total, first = int(ctx.params[rows]), read(0, 1)
            row_bytes = first.shape[1] * first.element_size()
        else:
            read = partial(_slice, ctx.tensors[i])
            total, row_bytes = ctx.tensors[i].shape[0], ctx.tensors[i].shape[1] * ctx.tensors[i].element_size()
        tables.append(RowRanges(read, total, chunk_bytes // max(1, row_bytes)))
    return tables[0], tables[1]


def _slice(tensor: torch.Tensor, first: int, stop: int) -> torch.Tensor:
    return tensor[first:stop]


def surgery_rows(ctx: MergeContext) -> torch.Tensor:
    """The matrix ``ctx.params["matrix"]`` with DONOR's vocabulary, in MODEL's dtype (inputs: MODEL's matrix,
    DONOR's), neither held whole where it is larger than the transplant's ``chunk_bytes``: MODEL is read once
    range by range (its rows copied into the result, its sums taken), DONOR's shared rows gathered, and each
    batch's DONOR rows read as the batch is computed."""
    transplant = ctx.resources.find(Transplant)
    if transplant is None:
        raise ValueError("internal: a transplant's rows need the run's matches (Transplant) in its resources")
    matrix = str(ctx.params["matrix"])
    match = transplant.matches[matrix]
    model, donor = _inputs(ctx, transplant.chunk_bytes)
    name = transplant.method.name
    summed = name in _READS_STATS and bool(match.approximated)
    out: torch.Tensor | None = None
    copies = sorted(match.copies, key=lambda pair: pair[1])
    model_ids = [m for _, m in copies]

    def copied() -> Iterator[torch.Tensor]:
        nonlocal out
        at = 0
        for first, rows in model.ranges():
            if out is None:
                out = torch.zeros((match.rows, rows.shape[1]), dtype=rows.dtype, device=rows.device)
            stop = bisect.bisect_left(model_ids, first + rows.shape[0], lo=at)
            if stop > at:
                pairs = torch.tensor(copies[at:stop], dtype=torch.long, device=rows.device)
                out[pairs[:, 0]] = rows[pairs[:, 1] - first]
            at = stop
            yield rows

    stats = model_stats(copied(), covariance=name == "john_hewitt") if summed else None
    if not summed:
        for _ in copied():
            pass
    assert out is not None  # a matrix has rows
    if match.approximated:
        _approximate(ctx, transplant, match, out, model, donor, stats)
    if match.junk:
        out[torch.tensor(match.junk, dtype=torch.long, device=out.device)] = 0
    return out


def _approximate(ctx: MergeContext, transplant: Transplant, match: MatrixMatch, out: torch.Tensor,
                 model: RowRanges, donor: RowRanges, stats: ModelStats | None) -> None:
    """``out``'s approximated rows, batch by batch: each kept batch read back, the others computed and kept.
    MODEL's shared rows are ``out``'s (each shared token's row was copied there); DONOR's are gathered once,
    and only the batches computed read their DONOR rows."""
    matrix, name = str(ctx.params["matrix"]), transplant.method.name
    device = out.device
    shared = torch.tensor(match.shared, dtype=torch.long).reshape(-1, 2)
    reads_shared = name in _READS_TARGETS
    donor_ids = shared[:, 0] if reads_shared else shared[:0, 0]
    model_shared = out[donor_ids.to(device)]
    donor_shared: torch.Tensor | None = None
    step = transplant.batch_size if transplant.batch_size > 0 else len(match.approximated)
    params = dict(ctx.params)
    # Batches run on workers only where the engine runs this unit's kernels on its thread alone (its CPU units, as
    # -j and its worker count decide), each worker's kernels then alone too: the same kernels, so the same bits,
    # whatever thread computes a batch and however many do. Kernels already split over torch's threads stay here.
    workers = min(transplant.workers, BATCH_WORKERS) if device.type == "cpu" and torch.get_num_threads() == 1 else 1
    pending: deque[tuple[list[int], Future[torch.Tensor]]] = deque()

    def drain(limit: int) -> None:
        # The oldest batches' rows written, in batch order, until at most ``limit`` are in flight (every batch writes
        # its own tokens' rows, so the order changes no byte either way). Each one's rows go as they are written: a
        # future left in the loop's locals would hold them while the next batch is read.
        while len(pending) > limit:
            waited, done = pending.popleft()
            _put(out, waited, done.result())

    def inputs(first: int, ids: list[int]) -> list[Batch]:
        # The batch's inputs, read here on the unit's thread (the engine's readers are not shared across threads),
        # in a list the computation empties (_computed): nothing here keeps them once it is done.
        nonlocal donor_shared
        if reads_shared:
            if donor_shared is None:
                donor_shared = donor.gather(donor_ids)
            targets = donor.gather(torch.tensor(ids, dtype=torch.long))
        else:
            donor_shared = targets = out.new_empty((len(ids), 0))
        pieces, piece_rows = _pieces(match.pieces[first:first + step], model) if name == "subword" else ((), None)
        return [Batch(targets, donor_shared, model_shared, stats, piece_rows, pieces, lm_head=matrix == "lm_head")]

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokensurgeon") if workers > 1 \
            else nullcontext() as pool:
        for number, first in enumerate(range(0, len(match.approximated), step)):
            # At most BATCH_WORKERS batches alive, as held_bytes counts them (each holds its DONOR rows and
            # workspace, or its rows waiting to be written): the oldest written before the next one's inputs are
            # read, not after (read ahead, a third batch's DONOR rows were held beside the two computed).
            drain(workers - 1)
            ids = list(match.approximated[first:first + step])
            key = BatchStore.key(params, number)
            if transplant.store is not None and _kept(transplant.store, key, out, ids):
                continue
            generator = torch.Generator(device=device).manual_seed(batch_seed(int(params["seed"]), matrix, number))
            if pool is None:
                _put(out, ids, _computed(transplant, inputs(first, ids), generator, key, serial=False))
                continue
            # Only the computation and the kept entry go to a worker.
            pending.append((ids, pool.submit(_computed, transplant, inputs(first, ids), generator, key, serial=True)))
        drain(0)


def _kept(store: BatchStore, key: str, out: torch.Tensor, ids: list[int]) -> bool:
    """Whether the batch's rows were kept (a killed run's): then they are in ``out``."""
    rows = store.load(key)
    if rows is None or rows.shape != (len(ids), out.shape[1]) or rows.dtype != out.dtype:
        return False
    _put(out, ids, rows)
    return True


def _computed(transplant: Transplant, handed: list[Batch], generator: torch.Generator, key: str, *,
              serial: bool) -> torch.Tensor:
    """One batch's rows, kept in the run's store; the batch is taken out of ``handed``, so that its inputs are let
    go when this returns (a pool's work item keeps its arguments until after its future is done, when the unit's
    thread may already be reading the next batch). ``serial``: on a worker thread, its kernels on that thread
    alone, as the engine runs the unit's (so a batch's bits are the same whichever thread computes it, and however
    many do)."""
    batch = handed.pop()
    with serial_kernels() if serial else nullcontext():
        rows = approximate(transplant.method, batch, generator)
    if transplant.store is not None:
        transplant.store.store(key, rows.cpu())
    return rows


def _put(out: torch.Tensor, ids: list[int], rows: torch.Tensor) -> None:
    """A batch's rows into ``out`` at its tokens' ids."""
    out[torch.tensor(ids, dtype=torch.long, device=out.device)] = rows.to(out.device)


def _pieces(pieces: tuple[tuple[int, ...], ...], model: RowRanges
            ) -> tuple[tuple[tuple[int, ...], ...], torch.Tensor]:
    """The batch's subword pieces as indexes into MODEL's rows of them (pieces past MODEL's rows left out), and
    those rows."""
    used = sorted({j for each in pieces for j in each if j < model.total})
    at = {j: i for i, j in enumerate(used)}
    rows = model.gather(torch.tensor(used, dtype=torch.long))
    return tuple(tuple(at[j] for j in each if j in at) for each in pieces), rows


_PARAMS = (
    ParamSpec("matrix", Scope.GLOBAL, str, required=True),
    # Digest of the models' file identities, the match and the method: an entry left by another run is never taken.
    ParamSpec("source", Scope.GLOBAL, str, required=True),
    ParamSpec("seed", Scope.GLOBAL, int, required=True),
    ParamSpec("device", Scope.GLOBAL, str, default="cpu"),
    # The two matrices' row counts (the unit reads them by row ranges) and the bytes the unit holds (held_bytes).
    ParamSpec("model_rows", Scope.GLOBAL, int, required=True),
    ParamSpec("donor_rows", Scope.GLOBAL, int, required=True),
    ParamSpec("held", Scope.GLOBAL, int, required=True),
)

# What a unit holds is stated in its ``held`` parameter (see held_bytes); the footprint is only the registry's
# required declaration, never read for it (MethodSpec.held_param).
_FOOTPRINT = measured((12, 8), (16, 10), (16, 10), (24, 16), of_inputs=True)
# held_bytes' margin over its count, and the fixed bytes of a batch's bookkeeping (index tensors, the kept entry).
_MARGIN, _FIXED = 1.25, 4 << 20
# The most batches a unit computes at once (on CPU threads, -j permitting): a fixed number, so the plan's held
# bytes (and with them its fingerprint) do not depend on the machine's cores; two, as the pursuit's products keep
# two threads busy (on the real pair, 0.67x one thread's wall) and each worker's batch is counted in held_bytes.
BATCH_WORKERS = 2


def held_bytes(method: Method, batch_size: int, match: MatrixMatch, model: tuple[int, int, int],
               donor: tuple[int, int, int], chunk_bytes: int) -> int:
    """The most bytes the unit of ``match``'s matrix holds at once, a bound from the code above: the result, a
    row range of each model's matrix (a whole matrix where it is one range) and its gathered copy, the shared rows
    of both models with float32 copies, and the largest batch's workspace for ``method``. ``model``/``donor``:
    (rows, width, bytes per element) of each matrix."""
    (model_rows, model_width, model_size), (_, donor_width, donor_size) = model, donor
    held = match.rows * model_width * model_size
    for rows, width, size in (model, donor):
        held += 2 * min(rows * width * size, max(chunk_bytes, width * size))
    count = len(match.approximated)
    if count:
        batch = min(batch_size if batch_size > 0 else count, count)
        shared = len(match.shared) if method.name in _READS_TARGETS else 0
        held += shared * (model_width * model_size + donor_width * donor_size + 4 * (model_width + donor_width))
        # each batch in flight (BATCH_WORKERS at most, whatever -j): its targets, rows made and noise, its
        # workspace, and its rows made waiting to be written back in batch order
        per_batch = 3 * 4 * batch * (donor_width + model_width) + 4 * batch * model_width
        per_batch += _work(method, batch, shared, model_width, donor_width, model_size, model_rows)
        held += BATCH_WORKERS * per_batch
    return int(held * _MARGIN) + _FIXED


def _work(method: Method, batch: int, shared: int, model_width: int, donor_width: int, model_size: int,
          model_rows: int) -> int:
    """A batch's workspace beyond its rows, by method (float32; scores per shared token, the chosen atoms). omp's
    screened pick uses the part its pursuit leaves free and screens only where it fits (``omp.screens``)."""
    k, name, width = method.k, method.name, max(model_width, donor_width)
    if name in ("omp", "mp_rope"):
        return 4 * batch * (3 * shared + 3 * k * width + k * k) + batch * shared
    if name == "common_interpolation":
        return 4 * batch * (2 * shared + 3 * k * width + (k + 1) ** 2)
    if name in ("landmark_pca", "stb"):
        return 4 * (3 * shared * (model_width + donor_width) + 4 * width * width)
    if name == "john_hewitt":
        return 8 * 3 * model_width * model_width
    if name == "subword":
        return model_rows * model_width * model_size  # MODEL's rows of the batch's pieces, at most all of them
    return 0


# The most approximated tokens ``plan`` times a unit on: one batch of the run's (512 by default) up to this, its cost
# scaled to all of them. A batch pays a fixed cost (the fit's, the gather's) beside its tokens': a probe of 32 tokens
# priced it 16 times per run batch ("about 3 min" for a 12-26 s transplant).
PROBE_TOKENS = 2048


def scaled_probe(resources: Resources, params: Mapping[str, Any]) -> ScaledProbe:
    """How ``plan`` times the unit of ``params["matrix"]`` on the real tables: once with no token to approximate
    (the tables read, the shared rows copied: what every method pays) and once with the first batch of the run's
    size (at most :data:`PROBE_TOKENS` tokens), the difference scaled to all the matrix's approximated tokens: a
    pursuit's work per token and a fit's once per batch each priced as the run pays them (a probe smaller than the
    run's batches paid a batch's fixed cost for each of its few tokens). Nothing is kept: the store is dropped."""
    transplant = resources.find(Transplant)
    if transplant is None:
        raise ValueError("internal: a transplant's probe needs the run's matches (Transplant) in its resources")
    matrix = str(params["matrix"])
    match = transplant.matches[matrix]
    total = len(match.approximated)
    step = transplant.batch_size if transplant.batch_size > 0 else total
    taken = min(total, PROBE_TOKENS, max(1, step))

    def reduced(count: int) -> Resources:
        cut = replace(match, approximated=match.approximated[:count], pieces=match.pieces[:count])
        return Resources((replace(transplant, matches={**transplant.matches, matrix: cut}, store=None),))

    return ScaledProbe(reduced(0), reduced(taken), total / taken if taken else 0.0,
                       f"{taken} of {total} approximated tokens")


# The unit functions of a transplant, which its plan hands the engine (Plan.units).
UNITS = declared(
    MethodSpec(name=SURGERY_ROWS, fn=surgery_rows, params=_PARAMS, min_inputs=2, max_inputs=2,
               title="tokensurgeon", reference="https://arxiv.org/abs/2506.06607",
               summary="MODEL's token rows under DONOR's vocabulary: shared tokens copied, the others approximated",
               footprint=_FOOTPRINT, thread_dependent=True, lazy_inputs=True,
               held_param="held", scaled_probe=scaled_probe),
)

"""The extraction's unit functions: LoRA factor A, factor B, and a bias delta, from (BASE, FT).

Each is a pure function of its two inputs and parameters, like a merge method, so the engine journals, resumes and
governs them as it does merge tensors. A and B of one module come from the same truncation: the first of the two to run
computes it and leaves the other factor in the run's :class:`FactorStore` (in the units' context) for its sibling (a
worker asking for it meanwhile waits), so the SVD runs once per module; a factor not collected (a stopped run) is
dropped after a few more modules. The factor units read their inputs lazily (``lazy_inputs``): the sibling that finds
the pair computed, or cached, reads no weight at all, and the one that computes it reads FT and subtracts BASE from it
in place, a row chunk of BASE at a time, so a module in flight holds one task vector and its SVD workspace. FT's tensors
saved whole (``lora_extract_saved``) reach the adapter in row chunks. With a
:class:`~resumerge.runs.extract.factor_cache.FactorCache` in use, each module's factors are also kept on disk until the
adapter is committed, so a resumed run decomposes only the modules the killed one had not finished. Recomputing gives
the same bytes: the randomized truncation is seeded per module (``seed``), never by run order, and every truncation
computes on the one thread that runs it (``threads``, 1 in every plan), its MKL kernels included
(:func:`~resumerge.inputs.kernels.serial_kernels`): their sums split over more threads round otherwise, and how
many that was followed ``-j``, the machine's cores and even the process's past (issue 87), none of them the plan's.

There are two pairs of factor functions, the same computation declared with two footprints: ``…_a``/``…_b`` for
the randomized truncation and ``…_a_full``/``…_b_full`` for the exact one (``--exact``, or a rank too close to the
matrix's size for the randomized one to gain); the planner picks by :func:`~resumerge.runs.extract.decompose.full_svd`.

The extraction planner hands them to its plan (:data:`UNITS`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from resumerge.inputs.kernels import serial_kernels
from resumerge.machine.torch_import import torch
from resumerge.merge.methods.footprint import MethodFootprint, measured
from resumerge.merge.methods.spec import BasePolicy, MergeContext, MethodSpec, ParamSpec, Scope, WholeCost, declared
from resumerge.merge.plan.workunits import CHUNK_ELEMENTS
from resumerge.runs.extract.decompose import (
    MIN_OVERSAMPLE,
    Truncation,
    changed_lines,
    factors,
    gram_scratch,
    keep_unchanged,
    kept_rank,
    truncate,
)
from resumerge.runs.extract.factor_cache import FactorCache

FACTOR_A = "lora_extract_a"
FACTOR_B = "lora_extract_b"
FACTOR_A_FULL = "lora_extract_a_full"
FACTOR_B_FULL = "lora_extract_b_full"
DELTA = "lora_extract_delta"
SAVED = "lora_extract_saved"

# Pending sibling factors kept at most: a stopped run's leftovers age out.
_KEEP = 8
# The threads every truncation computes on (see the module's docstring): MKL splits the sketches' products, the QRs
# and the SVD by its thread count (on a 1024 × 2816 task vector one and two threads give other bytes).
TRUNCATION_THREADS = 1


class FactorStore:
    """One run's factor pairs: the pair a module's first factor unit computed, waiting for its sibling (a worker
    asking for it meanwhile waits; at most ``_KEEP`` pending, oldest dropped), and ``cache``, where finished
    modules' factors are kept for a resumed run (None: nowhere). Made by the run's planning
    (:mod:`resumerge.runs.extract.prepare`) and handed to the factor units in their context's
    :attr:`~resumerge.merge.methods.spec.MergeContext.resources`."""

    def __init__(self, cache: FactorCache | None = None) -> None:
        self.cache = cache
        self._lock = threading.Lock()
        self._pending: OrderedDict[tuple[Any, ...], Future[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()

    def factor(self, ctx: MergeContext, which: int) -> torch.Tensor:
        """Factor ``which`` (0: A, 1: B) of the module of ``ctx``, the pair computed once for both siblings."""
        key = tuple(sorted(ctx.params.items()))  # the module and all its factors depend on, the device included
        with self._lock:
            future = self._pending.get(key)
            mine = future is None
            if future is None:
                future = Future()
                self._pending[key] = future
                while len(self._pending) > _KEEP:
                    self._pending.popitem(last=False)
            else:
                del self._pending[key]  # the sibling collects it: nobody else will
        if mine:
            try:
                future.set_result(self._decompose(ctx))
            except BaseException as exc:
                future.set_exception(exc)
                with self._lock:
                    self._pending.pop(key, None)
                raise
        return future.result()[which]

    def _decompose(self, ctx: MergeContext) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`decompose`, or the factors a stopped run of the same module left in the cache (no weight read)."""
        if self.cache is None:
            return decompose(ctx)
        key = cache_key(ctx.params)
        device = torch.device(str(ctx.params["device"]))
        found = self.cache.load(key)
        if found is not None:
            return found[0].to(device), found[1].to(device)
        a, b = decompose(ctx)
        self.cache.store(key, a.cpu(), b.cpu(), module=str(ctx.params["module"]))
        return a, b


def task_vector(ctx: MergeContext) -> torch.Tensor:
    """FT − BASE in the inputs' (common) dtype, as mergekit subtracts them; transposed for an embedding.

    With inputs of its own (the engine's lazy reads) the difference is taken in FT's buffer, BASE read into it a
    row chunk at a time, so BASE is never whole in memory (the same bits as ``FT - BASE``: a subtraction is
    elementwise); a caller's tensors are never written."""
    ft = ctx.tensors[1]
    if not ctx.owned_inputs:
        delta = ft - ctx.tensors[0]
    elif ctx.read_rows is None or ft.dim() != 2:
        delta = ft.sub_(ctx.tensors[0])
    else:
        rows = ft.shape[0]
        step = max(1, CHUNK_ELEMENTS // max(1, ft.shape[1]))
        for first in range(0, rows, step):
            stop = min(rows, first + step)
            ft[first:stop].sub_(ctx.read_rows(0, first, stop))
        delta = ft
    return delta.T if ctx.params["embedding"] else delta


def decompose(ctx: MergeContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of the module, float32, of exactly ``rank`` components (zero rows/columns beyond the matrix's own
    rank cannot occur: ``rank`` ≤ min(shape) by planning), exactly zero where the task vector's rows or columns
    are (:func:`~resumerge.runs.extract.decompose.keep_unchanged`)."""
    p = ctx.params
    rank = int(p["rank"])
    delta = task_vector(ctx)
    rows, columns = changed_lines(delta)
    t = truncation(delta, rank, exact=bool(p["exact"]), seed=int(p["seed"]), threads=int(p["threads"]))
    del delta
    keep = kept_rank(t.s, rank, float(p["sv_epsilon"]))
    if keep != rank:
        raise ValueError(f"the truncation kept {keep} components where {rank} were planned")
    a, b = factors(t, rank, bool(p["distribute_scale"]))
    keep_unchanged(a, b, rows, columns)
    return a, b


def truncation(delta: torch.Tensor, rank: int, *, exact: bool, seed: int, threads: int) -> Truncation:
    """:func:`~resumerge.runs.extract.decompose.truncate` on ``threads`` threads (the plan's: one, the only count whose
    kernels this process can pin whatever it did before), the one way an extraction truncates, its rank probe
    (``--sv-epsilon``) included, so both find the same singular values."""
    if threads != 1:
        raise ValueError(f"a truncation runs on one thread, the plan says {threads}")
    with serial_kernels():
        return truncate(delta, rank, exact=exact, seed=seed)


def _shared(ctx: MergeContext, which: int) -> torch.Tensor:
    """Factor ``which`` (0: A, 1: B) of the module: through the run's :class:`FactorStore`, which computes the pair
    once for both sibling tensors of the engine's units; another caller's context (``plan``'s timing, a test)
    computes it alone."""
    store = ctx.resources.find(FactorStore)
    if not ctx.owned_inputs or store is None:
        return decompose(ctx)[which]
    return store.factor(ctx, which)


def cache_key(params: Mapping[str, Any]) -> str:
    """The cache entry of a module's factors: the module's parameters (the models' file identities, the rank and
    the device among them)."""
    return FactorCache.key(params, None, None, str(params["device"]))


def factor_a(ctx: MergeContext) -> torch.Tensor:
    """LoRA factor A (r × in): √s·Vh, or s·Vh without ``distribute_scale``."""
    return _shared(ctx, 0)


def factor_b(ctx: MergeContext) -> torch.Tensor:
    """LoRA factor B (out × r): U·√s, or U without ``distribute_scale``."""
    return _shared(ctx, 1)


def saved_whole(ctx: MergeContext) -> torch.Tensor:
    """FT's tensor as it is (``modules_to_save``), for a row chunk at a time: the engine streams these tensors to
    the adapter in chunks of :data:`~resumerge.merge.plan.workunits.CHUNK_ELEMENTS` entries (``row_chunk``), so an
    embedding or a head is never whole in memory."""
    return ctx.tensors[0].clone()


def bias_delta(ctx: MergeContext) -> torch.Tensor:
    """FT's bias − BASE's (mergekit saves it as ``lora_B.bias``)."""
    return ctx.tensors[1] - ctx.tensors[0]


_PARAMS = (
    ParamSpec("module", Scope.GLOBAL, str, required=True),
    # Digest of the two models' file identities: a factor left here by another run is never taken for this one's.
    ParamSpec("source", Scope.GLOBAL, str, required=True),
    ParamSpec("rank", Scope.GLOBAL, int, required=True, minimum=1),
    ParamSpec("exact", Scope.GLOBAL, bool, default=False),
    ParamSpec("seed", Scope.GLOBAL, int, required=True),
    ParamSpec("sv_epsilon", Scope.GLOBAL, float, default=0.0),
    ParamSpec("distribute_scale", Scope.GLOBAL, bool, default=True),
    ParamSpec("embedding", Scope.GLOBAL, bool, default=False),
    ParamSpec("device", Scope.GLOBAL, str, default="cpu"),
    # The truncation's kernels' threads: part of the plan (and so of its fingerprint and the factor cache's keys),
    # so that a run planned before they were pinned (whose bytes followed the moment's threads) is never resumed
    # into the same adapter.
    ParamSpec("threads", Scope.GLOBAL, int, default=TRUNCATION_THREADS, minimum=1, maximum=1),
)

# What a factor unit allocates beyond its two inputs, whichever of the pair's units computes it (the task vector
# is taken in FT's own buffer). Measured with the profiler replay of tests/methods/footprint_cases.py
# (tests/extract/test_footprint.py; torch 2.x CPU) on 192×512 to 1024×2816 weights, ranks 8 to 128. The exact
# truncation: its peak is the eigendecomposition of the float64 Gram matrix, 30 to 32.3 bytes per entry of it (the
# shorter side squared: the matrix, its eigenvectors, LAPACK's workspace), or, on a matrix far wider than tall,
# the Gram matrix and its float64 column block (8 bytes per entry, at most GRAM_BLOCK entries; counted on top),
# plus the float32 copy of a task vector of another dtype (4 bytes per element).
_FULL_SVD = measured((0, 0, 8, 32), (4, 0, 8, 32), (4, 0, 8, 32), (4, 0, 8, 32), of_inputs=True,
                     scratch=gram_scratch)
# The randomized truncation: its sketches and their QR factors, 13 to 17.2 bytes per element of a (out + in) ×
# sketch-width panel, plus the float32 copy of a half-precision task vector (4 bytes per element) — at rank 32 on a
# 2048 × 5504 weight 0.4 bytes per element where the exact truncation's are 16.
_RANDOMIZED = measured((0.5, 0), (4.5, 0), (4.5, 0), (8.5, 0), of_inputs=True, panel=18.0,
                       panel_width=lambda rank: rank + max(MIN_OVERSAMPLE, rank))
# The bias delta: one subtraction, linear's figures.
_SUBTRACTION = measured((4, 0), (8, 0), (8, 0), (8, 0))



def _factor(name: str, fn: Any, footprint: MethodFootprint) -> MethodSpec:
    return MethodSpec(name=name, fn=fn, params=_PARAMS, base=BasePolicy.REQUIRED, min_inputs=2, max_inputs=2,
                      reference="mergekit-extract-lora", footprint=footprint, lazy_inputs=True,
                      # A truncation's time follows the weight's shape, the rank and the algorithm; A and B of a
                      # module come from one truncation.
                      whole_cost=WholeCost(params=("rank", "exact"), shared_by=2))


# The unit functions of an extraction, which its plan hands the engine (Plan.units).
UNITS = declared(
    _factor(FACTOR_A, factor_a, _RANDOMIZED),
    _factor(FACTOR_B, factor_b, _RANDOMIZED),
    _factor(FACTOR_A_FULL, factor_a, _FULL_SVD),
    _factor(FACTOR_B_FULL, factor_b, _FULL_SVD),
    # A copy: passthrough's figures.
    MethodSpec(name=SAVED, fn=saved_whole, min_inputs=1, max_inputs=1, elementwise=True,
               reference="mergekit-extract-lora", footprint=measured((4, 0), (2, 0), (2, 0), (8, 0)),
               row_chunk=CHUNK_ELEMENTS),
    MethodSpec(name=DELTA, fn=bias_delta, base=BasePolicy.REQUIRED, min_inputs=2, max_inputs=2,
               elementwise=True, reference="mergekit-extract-lora", footprint=_SUBTRACTION),
)

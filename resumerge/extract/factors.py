"""The extraction's registered tensor functions: LoRA factor A, factor B, and a bias delta, from (BASE, FT).

Each is a pure function of its two inputs and parameters, like a merge method, so the engine journals, resumes
and governs them as it does merge tensors. A and B of one module come from the same truncation: the first of the
two to run computes it and leaves the other factor here for its sibling (a worker asking for it meanwhile waits),
so the SVD runs once per module; a factor not collected (a stopped run) is dropped after a few more modules. With a
:class:`~resumerge.extract.factor_cache.FactorCache` in use, each module's factors are also kept on disk until the
adapter is committed, so a resumed run decomposes only the modules the killed one had not finished.
Recomputing gives the same bytes: the randomized truncation is seeded per module (``seed``), never by run order.

Importing this module registers the functions (the extraction planner imports it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from resumerge.extract.decompose import factors, kept_rank, truncate
from resumerge.extract.factor_cache import FactorCache
from resumerge.methods.footprint import measured
from resumerge.methods.spec import BasePolicy, MergeContext, MethodSpec, ParamSpec, Scope, register

FACTOR_A = "lora_extract_a"
FACTOR_B = "lora_extract_b"
DELTA = "lora_extract_delta"

# Where finished modules' factors are kept for a resumed run (set by the extraction's planning; None: nowhere).
_cache: FactorCache | None = None

# Pending sibling factors: (module key) -> future of (A, B). Bounded: a stopped run's leftovers age out.
_KEEP = 8
_pending: OrderedDict[tuple[Any, ...], Future[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
_lock = threading.Lock()


def task_vector(ctx: MergeContext) -> torch.Tensor:
    """FT − BASE in the inputs' (common) dtype, as mergekit subtracts them; transposed for an embedding."""
    delta = ctx.tensors[1] - ctx.tensors[0]
    return delta.T if ctx.params["embedding"] else delta


def decompose(ctx: MergeContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of the module, float32, of exactly ``rank`` components (zero rows/columns beyond the matrix's own
    rank cannot occur: ``rank`` ≤ min(shape) by planning)."""
    p = ctx.params
    delta = task_vector(ctx)
    rank = int(p["rank"])
    t = truncate(delta, rank, exact=bool(p["exact"]), seed=int(p["seed"]))
    keep = kept_rank(t.s, rank, float(p["sv_epsilon"]))
    if keep != rank:
        raise ValueError(f"the truncation kept {keep} components where {rank} were planned")
    return factors(t, rank, bool(p["distribute_scale"]))


def _shared(ctx: MergeContext, which: int) -> torch.Tensor:
    """Factor ``which`` (0: A, 1: B) of the module, computing the pair once for both sibling tensors."""
    key = (ctx.params["module"], tuple(sorted(ctx.params.items())), tuple(tuple(t.shape) for t in ctx.tensors),
           str(ctx.tensors[0].device))
    with _lock:
        future = _pending.get(key)
        mine = future is None
        if future is None:
            future = Future()
            _pending[key] = future
            while len(_pending) > _KEEP:
                _pending.popitem(last=False)
        else:
            del _pending[key]  # the sibling collects it: nobody else will
    if mine:
        try:
            future.set_result(_cached_decompose(ctx))
        except BaseException as exc:
            future.set_exception(exc)
            with _lock:
                _pending.pop(key, None)
            raise
    return future.result()[which]


def use_cache(cache: FactorCache | None) -> None:
    """Keep finished modules' factors in ``cache`` from now on (None: keep none)."""
    global _cache
    _cache = cache


def cache_key(params: Mapping[str, Any], shapes: Sequence[tuple[int, ...]], device: str) -> str:
    """The cache entry of a module's factors: the module's parameters (the models' file identities among them),
    its inputs' shapes and the device."""
    return FactorCache.key(params, [tuple(s) for s in shapes], None, device)


def _cached_decompose(ctx: MergeContext) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decompose`, or the factors a stopped run of the same module left in the cache."""
    cache = _cache
    if cache is None:
        return decompose(ctx)
    key = cache_key(ctx.params, [tuple(t.shape) for t in ctx.tensors], str(ctx.tensors[0].device))
    found = cache.load(key)
    if found is not None:
        return found[0].to(ctx.tensors[0].device), found[1].to(ctx.tensors[0].device)
    a, b = decompose(ctx)
    cache.store(key, a.cpu(), b.cpu())
    return a, b


def factor_a(ctx: MergeContext) -> torch.Tensor:
    """LoRA factor A (r × in): √s·Vh, or s·Vh without ``distribute_scale``."""
    return _shared(ctx, 0)


def factor_b(ctx: MergeContext) -> torch.Tensor:
    """LoRA factor B (out × r): U·√s, or U without ``distribute_scale``."""
    return _shared(ctx, 1)


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
)

# The SVD workspace, per element of the module's weight (out × in), whichever factor's unit computes the pair:
# the task vector, its float32 copy, U and Vh and LAPACK's work arrays. Measured with the profiler replay of
# tests/methods/footprint_cases.py (torch 2.x CPU, 2 threads) on 1024² to 2048², 1024×2816, 2816×1024, 256×4096 and
# 4096×256 weights, ranks 8 and 128, exact and randomized: the exact SVD peaks highest, at 4.0 × m·n·4 bytes from
# float32 weights and 4.5 × from bfloat16 ones (square weights; wider ones less); the randomized truncation peaks
# at 1.1–3.6 × (the top being the exact fallback of thin matrices). float16 is taken as bfloat16; float64 adds the
# wider task vector (8 bytes) to float32's figure. MARGIN is added on top.
_SVD_WORKSPACE = measured((16, 0), (18, 0), (18, 0), (24, 0), of_inputs=True)
# The bias delta: one subtraction, linear's figures.
_SUBTRACTION = measured((4, 0), (8, 0), (8, 0), (8, 0))

for _name, _fn in ((FACTOR_A, factor_a), (FACTOR_B, factor_b)):
    register(MethodSpec(name=_name, fn=_fn, params=_PARAMS, base=BasePolicy.REQUIRED, min_inputs=2, max_inputs=2,
                        reference="mergekit-extract-lora", footprint=_SVD_WORKSPACE, internal=True))
register(MethodSpec(name=DELTA, fn=bias_delta, base=BasePolicy.REQUIRED, min_inputs=2, max_inputs=2,
                    elementwise=True, reference="mergekit-extract-lora", footprint=_SUBTRACTION,
                    internal=True))

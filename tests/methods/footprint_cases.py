"""Measure a merge method's working memory: the peak bytes it allocates during one call, beyond its inputs.

How: torch's profiler with ``profile_memory=True`` records every allocation and free made through torch's CPU
allocator (signed size, nanosecond timestamp); replaying them in time order gives the exact peak of live bytes,
free of RSS noise (page cache, glibc arenas, other threads). The CPU allocator caches nothing, so each event is
a real ``malloc``/``free``. Starting a profiling session costs ~40 ms while a call on a small tensor costs a
millisecond, so many calls share one session and are told apart by two marker allocations of odd sizes that no
method makes (their own events are left out of the replay). What torch does not allocate — a BLAS library's own
scratch — is not seen; the methods use none of any size.

Also: the calls to measure (:func:`cases` — each registered method at 2-4 inputs with and without a base where
its contract allows, with parameters like ``tests/test_oracle_methods.py``'s, plus :func:`variants` that take
other code paths) and inputs that look like fine-tunes of one base (:func:`make_inputs`). Shared by
``tests/methods/test_footprint.py`` and ``bench/method_footprint.py``.
"""

from __future__ import annotations

import importlib
import tracemalloc
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from resumerge.merge.methods import BasePolicy, MergeContext, get_method

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Odd byte counts: every tensor a method makes holds whole elements of 2, 4 or 8 bytes, or bools of a shape
# far from these.
_OPEN, _CLOSE, _CUT = 3_333_331, 3_333_329, 3_333_327
_MARKERS = (_OPEN, _CLOSE, _CUT)


@dataclass(frozen=True)
class Case:
    """One method call: input count, base position, global and per-model parameters (None = not given)."""

    method: str
    inputs: int
    base: int | None
    params: Mapping[str, Any] = field(default_factory=dict)
    per_model: Mapping[str, Sequence[Any]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.method}[{self.inputs} in, base {self.base}{', ' + extra if extra else ''}]"


def _weights(n: int, base: int | None) -> list[Any]:
    return [None if i == base else round(0.2 + 0.3 * i / n, 3) for i in range(n)]


def _densities(n: int, base: int | None) -> list[Any]:
    return [None if i == base else (0.5, 0.6, 0.3)[i % 3] for i in range(n)]


def _family(method: str, n: int) -> Case:
    """A task-arithmetic family member at ``n`` inputs, base first."""
    per_model: dict[str, list[Any]] = {"weight": _weights(n, 0), "density": _densities(n, 0)}
    if method.startswith("breadcrumbs"):
        per_model["gamma"] = [None, *([0.05] * (n - 1))]
    if method.startswith("della"):
        per_model["epsilon"] = [None, *([0.1] * (n - 1))]
    params = {"lambda": 0.9} if method == "task_arithmetic" else {}
    return Case(method, n, 0, params, per_model)


_FAMILY = ("task_arithmetic", "ties", "dare_ties", "dare_linear", "breadcrumbs", "breadcrumbs_ties", "della",
           "della_linear")


def cases(method: str) -> list[Case]:
    """The representative calls of ``method``: every allowed input count from 2 to 4 (1 for passthrough), with a
    base first where the method uses one and without one where it may do without."""
    spec = get_method(method)
    assert spec is not None, method
    if method in _FAMILY:
        return [_family(method, n) for n in (2, 3, 4)]
    if method == "passthrough":
        return [Case(method, 1, None, {}, {"scale": [0.5]})]
    found = []
    for n in (2, 3, 4):
        if n < spec.min_inputs or (spec.max_inputs is not None and n > spec.max_inputs):
            continue
        for base in (0, None):
            if base is None and spec.base is BasePolicy.REQUIRED:
                continue
            if base is not None and spec.base in (BasePolicy.FORBIDDEN, BasePolicy.IGNORED):
                continue  # an ignored base is merged like any input: the call is the one without it
            non_base = n - (base is not None)
            if (spec.min_non_base or 0) > non_base or (spec.max_non_base or non_base) < non_base:
                continue
            found.append(Case(method, n, base, _PARAMS.get(method, {}), _per_model(method, n, base)))
    return found


_PARAMS: dict[str, dict[str, Any]] = {
    "slerp": {"t": 0.3}, "nearswap": {"t": 0.05}, "sce": {"select_topk": 0.5},
    "ramplus_tl": {"r": 0.1, "alpha": 0.2},
    # Every step reuses the same buffers, so two steps reach the peak of ten at a fifth of the time.
    "karcher": {"max_iter": 2},
}


def _per_model(method: str, n: int, base: int | None) -> dict[str, list[Any]]:
    if method == "linear":
        return {"weight": _weights(n, None)}
    if method in ("multislerp", "nuslerp"):
        return {"weight": _weights(n, base)}
    return {}


def variants(method: str) -> list[Case]:
    """Calls of ``method`` on other code paths than :func:`cases` (flags flipped, no sparsification)."""
    base = cases(method)[-1]
    flips: list[dict[str, Any]] = {
        "linear": [{"normalize": False}],
        "passthrough": [],
        "nuslerp": [{"nuslerp_row_wise": True}, {"nuslerp_flatten": False}],
        "model_stock": [{"filter_wise": True}],
        "sce": [{"select_topk": 1.0}, {"select_topk": 0.5, "int8_mask": True}],
        "karcher": [{"max_iter": 1}],
        "multislerp": [{"normalize_weights": False}],
    }.get(method, [])
    if method in _FAMILY:
        flips = [{"int8_mask": True}, {"normalize": True, "rescale": True, "lambda": 0.5},
                 {"normalize": False, "rescale": False}]
    found = [Case(method, base.inputs, base.base, {**base.params, **f}, base.per_model) for f in flips]
    if method in _FAMILY:
        dense = {**base.per_model, "density": [None, *([1.0] * (base.inputs - 1))]}
        found.append(Case(method, base.inputs, base.base, base.params, dense))
    if method == "passthrough":
        found.append(Case(method, 1, None))
    return found


def make_inputs(shape: Sequence[int], n: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """``n`` tensors that look like fine-tunes of the first: a base and small task vectors of mixed signs."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(tuple(shape), generator=g, dtype=torch.float64) * 0.02
    found = [base.to(dtype)]
    for _ in range(n - 1):
        found.append((base + torch.randn(tuple(shape), generator=g, dtype=torch.float64) * 0.002).to(dtype))
    return found


def call(case: Case, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Run ``case`` on ``tensors`` as the engine does (a seeded generator for randomised methods)."""
    spec = get_method(case.method)
    assert spec is not None
    model_params = [
        {name: values[i] for name, values in case.per_model.items() if values[i] is not None}
        for i in range(case.inputs)
    ]
    generator = torch.Generator().manual_seed(7) if spec.randomized else None
    bound_models, bound = spec.bind(model_params, case.params, case.base)
    ctx = MergeContext(list(tensors), case.base, bound_models, bound, generator)
    return spec.fn(ctx)


# resumerge functions that allocate numpy memory: each is bracketed by segment boundaries (see peaks).
_NUMPY_USERS = (("resumerge.merge.methods.ranking", "_select_numpy"), ("resumerge.merge.methods.ranking", "_sort_rows"))


class _Segments:
    """Cuts each measured call into segments at the entry and exit of the numpy-using functions, recording the
    numpy bytes (tracemalloc) each segment peaked at, and a torch marker allocation at each cut."""

    def __init__(self) -> None:
        self.numpy: list[int] = []
        self.base = 0

    def start(self) -> None:
        tracemalloc.reset_peak()
        self.base = tracemalloc.get_traced_memory()[0]

    def cut(self) -> None:
        self.numpy.append(max(0, tracemalloc.get_traced_memory()[1] - self.base))
        tracemalloc.reset_peak()
        marker = torch.empty(_CUT, dtype=torch.uint8)
        del marker

    @contextmanager
    def bracketing(self) -> Iterator[None]:
        saved = []
        for module_name, name in _NUMPY_USERS:
            module = importlib.import_module(module_name)
            original = getattr(module, name)

            def wrapped(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                self.cut()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.cut()

            saved.append((module, name, original))
            setattr(module, name, wrapped)
        try:
            yield
        finally:
            for module, name, original in saved:
                setattr(module, name, original)


def peaks(calls: Iterable[Callable[[], object]]) -> list[int]:
    """The peak bytes each call allocates beyond what was live when it started (its result included).

    Everything each call's closure holds (its inputs) must exist before the call: only allocations made between
    the call's start and the release of its result count. numpy's allocations (the CPU rankers select and sort
    in numpy) are invisible to torch's profiler; tracemalloc sees them but keeps no timeline. So each call is cut
    into segments at the entry and exit of the functions that use numpy, and a segment's figure is torch's peak
    in it plus the most numpy memory it held: exact where a segment has no numpy memory, and an upper bound
    (numpy's and torch's peaks assumed to coincide) inside the short numpy-using functions.
    """
    segments = _Segments()
    tracing = tracemalloc.is_tracing()
    with segments.bracketing(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        # Started inside the session: the profiler's first start imports and initialises much, slowly when traced.
        if not tracing:
            tracemalloc.start()
        try:
            for fn in calls:
                opened = torch.empty(_OPEN, dtype=torch.uint8)
                segments.start()
                result = fn()
                segments.cut()
                closed = torch.empty(_CLOSE, dtype=torch.uint8)
                del result, opened, closed
        finally:
            if not tracing:
                tracemalloc.stop()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())  # sort is stable: equal timestamps keep the recorded order
    found: list[int] = []
    numpy = iter(segments.numpy)
    live = start = top = best = 0
    for e in events:
        size = e.nbytes()
        if size == _OPEN:
            start = top = live
            best = 0
        elif size == _CUT:
            best = max(best, top - start + next(numpy))
            top = live
        elif size == _CLOSE:
            found.append(best)
        elif abs(size) not in _MARKERS:
            live += size
            top = max(top, live)
    return found


def measure(jobs: Sequence[tuple[Case, Sequence[int], torch.dtype]]) -> list[int]:
    """Peak working bytes of each (case, shape, dtype) job on inputs from :func:`make_inputs` (one session)."""
    inputs: dict[tuple[int, tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
    for case, shape, dtype in jobs:
        key = (case.inputs, tuple(shape), dtype)
        if key not in inputs:
            inputs[key] = make_inputs(shape, case.inputs, dtype)
    calls = [(lambda c=c, k=(c.inputs, tuple(s), d): call(c, inputs[k])) for c, s, d in jobs]
    found = peaks(calls)
    assert len(found) == len(jobs), f"{len(found)} peaks for {len(jobs)} calls"
    return found

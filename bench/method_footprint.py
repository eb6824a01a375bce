"""Every merge method's working memory, measured, next to what the memory governor reserves for it.

Usage::

    python bench/method_footprint.py [--shape 1024x512] [--inputs 3] [--large 2048x2048]
    python bench/method_footprint.py --fit [--saved measurements.json]

For each registered method and compute dtype (float32, bfloat16, float16, float64) the table gives, in tensor-sizes
of the compute dtype (elements × its size), the peak memory one call allocates beyond its inputs — result included
— measured by ``tests/methods/footprint_cases.py`` (torch's profiler replayed, numpy's selection copies added from
tracemalloc), at ``--inputs`` inputs (the nearest count the method allows) on a ``--shape`` tensor; then what the
old estimate reserved for the same thing (a cast copy of every input and ``8 × (1 or inputs + 1)`` bytes per
element) and what :func:`resumerge.merge.methods.footprint.working_bytes` reserves now. The last column is the
measurement per element on ``--large`` over the one on ``--shape`` (float32): 1.00 means the working set scales
linearly, so the small tensors of the test stand for large ones.

``--fit`` instead measures every case and variant on the fitting shapes and prints, per method, the figures of
the ``footprint=measured(...)`` argument of its registration derived from them (per element: the largest slope
over the input counts, the offset that covers every count, scratch per block from the shapes whose blocks are
not diluted; each × 1.25 and rounded up to a quarter byte; :data:`~resumerge.merge.methods.footprint.MARGIN` is
applied where they are used).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from methods.footprint_cases import DTYPES, Case, cases, measure, variants  # noqa: E402

from resumerge.merge.methods import get_method, method_names  # noqa: E402
from resumerge.merge.methods.footprint import (  # noqa: E402
    CALL_BYTES,
    MethodFootprint,
    counted_inputs,
    dot_scratch,
    scratch_elements,
    working_bytes,
)

NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float64: "float64"}
FIT_SHAPES = ((1024, 512), (256, 128), (64, 512), (8192,), (32768,), (131072,))
# slerp works through 2²⁰-element chunks: its scratch stops growing only beyond the other shapes.
EXTRA_SHAPES = {"slerp": ((2048, 1024),)}
LONE = {"multislerp"}  # with a base and one other input it returns a copy


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.lower().split("x"))


def _elements(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _footprint(method: str) -> MethodFootprint:
    spec = get_method(method)
    assert spec is not None and spec.footprint is not None, method
    return spec.footprint


def _pick(method: str, inputs: int) -> Case:
    found = cases(method)
    return min(found, key=lambda c: (abs(c.inputs - inputs), c.base is None))


def _old(method: str, inputs: int, size: int) -> float:
    """The old formula's bytes per element beyond stored inputs and output: cast copies and working set."""
    spec = get_method(method)
    assert spec is not None
    return inputs * size + 8 * (1 if spec.elementwise else inputs + 1)


def table(shape: tuple[int, ...], large: tuple[int, ...], inputs: int) -> None:
    picked = {m: _pick(m, inputs) for m in method_names()}
    jobs = [(picked[m], shape, d) for m in picked for d in DTYPES]
    jobs += [(picked[m], large, torch.float32) for m in picked]
    got = measure(jobs)
    by_job = {(c.method, s, d): p for (c, s, d), p in zip(jobs, got)}
    el = _elements(shape)
    print(f"Working memory beyond the inputs, tensor-sizes of the compute dtype, {shape} "
          f"(threads {torch.get_num_threads()}); measured / old estimate / new estimate\n")
    print("| method | inputs | " + " | ".join(NAMES[d] for d in DTYPES) + f" | linear to {large} |")
    print("|---|---|" + "---|" * len(DTYPES) + "---|")
    for method, case in picked.items():
        cells = []
        for dtype in DTYPES:
            size = torch.empty((), dtype=dtype).element_size()
            measured = by_job[(method, shape, dtype)] / (el * size)
            new = working_bytes(_footprint(method), NAMES[dtype], shape, case.inputs,
                                base=case.base is not None) / (el * size)
            old = _old(method, case.inputs, size) / size
            cells.append(f"{measured:.2f} / {old:.1f} / {new:.2f}")
        ratio = (by_job[(method, large, torch.float32)] / _elements(large)) / (
            by_job[(method, shape, torch.float32)] / el)
        base = "base" if case.base is not None else "no base"
        print(f"| {method} | {case.inputs}, {base} | " + " | ".join(cells) + f" | {ratio:.2f} |")


def _up(value: float) -> float:
    """Rounded up to a quarter byte (a negative offset too: towards more memory), ignoring the last 0.05 byte: the
    scalars and index lists every call makes add hundredths of a byte per element on the fitting shapes."""
    return math.ceil(value * 4 - 0.2) / 4


Point = tuple[int, int, tuple[int, ...], float, bool]  # counted inputs, inputs, shape, bytes/element, typical


def _terms(point: Point, method: str, dtype: str) -> list[float]:
    """A point's coefficients of (1, counted inputs, block share, line share)."""
    count, inputs, shape, _, _ = point
    el = _elements(shape)
    block, line = scratch_elements(_footprint(method), dtype, shape, inputs)
    return [1.0, float(count), block / el, line / el]


def _programme(points: list[Point], method: str, dtype: str, slope: float, phased: bool,
               main_covers: Callable[[Point], bool] = lambda _: True) -> list[float] | None:
    """Figures covering every point with the smallest worst ratio of estimate to measurement over the typical
    points (a parameter variant that skips work must be covered, but may use far less), and among those the
    smallest sum of ratios (minimax alone leaves figures free and picks an arbitrary corner).

    Without ``phased``: (fixed, per_input, block, line, _, _, ratio), all terms added. With it the scratch has
    its own phase, ``(fixed, per_input)`` for the main one and ``(c, d)`` + scratch for the scratch phase, the
    estimate being the larger: the points ``main_covers`` are the main phase's to cover, the others the scratch
    phase's. None when the programme has no solution.
    """
    from scipy.optimize import linprog  # a bench-only dependency

    rows, bounds = [], []
    cost = [0.0] * 7
    for point in points:
        value, typical = point[3], point[4]
        one, count, block, line = _terms(point, method, dtype)
        main = [one, count, 0.0, 0.0, 0.0, 0.0] if phased else [one, count, block, line, 0.0, 0.0]
        side = [0.0, 0.0, block, line, one, count]
        lines = [main, side] if phased else [main]
        covering = main if not phased or main_covers(point) else side
        rows.append([-t for t in covering] + [0.0])
        bounds.append(-value)
        if typical:
            for terms in lines:
                rows.append([*terms, -value])
                bounds.append(0.0)
            cost = [c + t / value for c, t in zip(cost, [*covering, 0.0], strict=True)]
    used = [any(_terms(p, method, dtype)[i] for p in points) for i in (2, 3)]
    scratch = [(0, None) if u else (0, 0) for u in used]
    side_limits = [(None, None), (0, None)] if phased else [(0, 0), (0, 0)]
    limits = [(None, None), (slope, None), *scratch, *side_limits, (1, None)]
    worst = linprog([0.0] * 6 + [1.0], A_ub=rows, b_ub=bounds, bounds=limits)
    if not worst.success:
        return None
    limits[-1] = (1, worst.x[6] * 1.001)
    result = linprog(cost, A_ub=rows, b_ub=bounds, bounds=limits)
    return [float(v) for v in result.x] if result.success else None


def _solve(points: list[Point], method: str, dtype: str, slope: float) -> tuple[list[float], float]:
    """The figures of :class:`~resumerge.merge.methods.footprint.Footprint` (as a table row) and their worst ratio:
    the scratch in its own phase where that fits the measurements more tightly, the per-input slope at least
    ``slope`` (the steepest measured step, so that more inputs than measured stay covered)."""
    plain = _programme(points, method, dtype, slope, phased=False)
    assert plain is not None, (method, dtype)
    phased = None
    if any(plain[2:4]):
        # The main phase is what the largest shape measures (its scratch is the most diluted); a point that
        # line already covers is the main phase's, any other the scratch phase's.
        big = max(_elements(p[2]) for p in points)
        main = _programme([p for p in points if _elements(p[2]) == big], method, dtype, slope, phased=False)
        assert main is not None

        def covered(point: Point) -> bool:
            return main[0] + main[1] * point[0] >= point[3] * 0.999

        phased = _programme(points, method, dtype, slope, phased=True, main_covers=covered)
    if phased is not None and phased[6] < plain[6] - 0.02:
        return [*phased[:4], float("nan"), *phased[4:6]], phased[6]
    return plain[:4], plain[6]


def _key(job: tuple[Case, tuple[int, ...], torch.dtype, bool]) -> str:
    case, shape, dtype, _ = job
    return f"{case.label} {sorted(case.per_model.items())} {shape} {dtype}"


def fit(saved: Path | None) -> None:
    calls = [(c, True) for m in method_names() for c in cases(m)] + [(c, False) for m in method_names()
                                                                   for c in variants(m)]
    jobs = [(c, s, d, t) for c, t in calls for d in DTYPES for s in FIT_SHAPES + EXTRA_SHAPES.get(c.method, ())]
    known: dict[str, int] = json.loads(saved.read_text()) if saved is not None and saved.exists() else {}
    missing = [j for j in jobs if _key(j) not in known]
    known.update((_key(j), p) for j, p in zip(missing, measure([j[:3] for j in missing]), strict=True))
    if saved is not None:
        saved.write_text(json.dumps(known))
    threads = torch.get_num_threads()
    points: dict[tuple[str, str], list[Point]] = defaultdict(list)
    lone: dict[tuple[str, str], float] = {}
    for case, shape, dtype, typical in jobs:
        peak = known[_key((case, shape, dtype, typical))]
        key = (case.method, NAMES[dtype])
        el = _elements(shape)
        value = (peak - CALL_BYTES - dot_scratch(_footprint(case.method), NAMES[dtype], el, threads)) / el
        count = counted_inputs(_footprint(case.method), case.inputs, base=case.base is not None)
        if case.method in LONE and count == 1 and case.base is not None:
            lone[key] = max(lone.get(key, 0.0), value)
        else:
            points[key].append((count, case.inputs, shape, value, typical))
    rows: dict[str, dict[str, str]] = defaultdict(dict)
    ratios: dict[str, list[str]] = defaultdict(list)
    for (method, dtype), found in sorted(points.items()):
        big = defaultdict(float)
        for count, _, shape, value, _ in found:
            if shape == FIT_SHAPES[0]:
                big[count] = max(big[count], value)
        counts = sorted(big)
        slope = max([0.0] + [(big[b] - big[a]) / (b - a) for a, b in itertools.pairwise(counts)])
        solved, ratio = _solve(found, method, dtype, slope)
        ratios[method].append(f"{dtype} {ratio:.2f}")
        figures: list[str] = [f"{_up(f):g}" for f in solved[:4]]
        if len(solved) > 4:
            figures += ["None", f"({_up(solved[5]):g}, {_up(solved[6]):g})"]
        if len(figures) == 4 and figures[2:] == ["0", "0"] and (method, dtype) not in lone:
            figures = figures[:2]  # the table's cells are (fixed, per_input) or carry both scratch figures
        if (method, dtype) in lone:
            figures.append(f"{_up(lone[(method, dtype)]):g}")
        rows[method][dtype] = "(" + ", ".join(figures) + ")"
    print("    # worst estimate / measurement before the margin: " + "; ".join(
        f"{m} {', '.join(r)}" for m, r in ratios.items()), file=sys.stderr)
    print("# each method's registration: footprint=measured(float32, bfloat16, float16, float64, ...)")
    for method, by_dtype in rows.items():
        columns = [by_dtype[NAMES[d]] for d in DTYPES]
        print(f"{method}: measured(" + ", ".join(columns) + ")")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1024x512")
    parser.add_argument("--large", default="2048x2048")
    parser.add_argument("--inputs", type=int, default=3)
    parser.add_argument("--fit", action="store_true")
    parser.add_argument("--saved", type=Path, help="with --fit: measurements to reuse, or where to keep them")
    args = parser.parse_args()
    if args.fit:
        fit(args.saved)
    else:
        table(_shape(args.shape), _shape(args.large), args.inputs)


if __name__ == "__main__":
    main()

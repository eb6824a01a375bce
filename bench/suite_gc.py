"""The cyclic garbage collector's full collections in a test run: how many each worker made, and their CPU seconds,
those the product asked for (``gc.collect()`` called from resumerge's own modules: tokensurgeon's ``_give_back``,
``give_back_heap``, the memory probe's ``reclaim``...) apart from those the collector started itself. A test worker
holds ~660k objects after its collection, and a full collection walks every one not frozen.

Usage (a pytest plugin, loaded in each worker; one JSON line per worker as its session ends)::

    RESUMERGE_TEST_GCLOG=/tmp/gc.jsonl python -m pytest -p bench.suite_gc tests/...
    python bench/suite_gc.py /tmp/gc.jsonl

``RESUMERGE_TEST_GCLOG_FREEZE=1`` freezes what the collection left alive as it ends (:func:`gc.freeze`): the figures
with a frozen worker, to compare. A run then keeps that freeze and freezes nothing of its own
(resumerge.machine.memory.collector.alive_frozen), so the product's collections get cheaper and a run's own may get
dearer: compare the whole run's CPU too (``RESUMERGE_TEST_CPULOG``).

Each line: the worker, ``tracked`` (the objects the collector tracks as the collection ends, before the freeze) and,
for the product's calls and the collector's own, the count and the CPU seconds of the collecting thread from the
collection's end to the session's (the tests', not the collection's own).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_PRODUCT = os.sep + "resumerge" + os.sep
_FIGURES: dict[str, Any] = {"product": 0, "product_s": 0.0, "auto": 0, "auto_s": 0.0, "tracked": None}
_started: list[float] = []  # the collecting thread's CPU as the current full collection started
_asked: list[bool] = [False]  # whether the product's gc.collect() runs now
_collect = gc.collect


def _counted_collect(generation: int = 2) -> int:
    """``gc.collect``, noting whether resumerge's own code asked for it."""
    caller = sys._getframe(1).f_code.co_filename
    _asked[0] = _PRODUCT in caller
    try:
        return _collect(generation)
    finally:
        _asked[0] = False


def _callback(phase: str, info: dict[str, int]) -> None:
    if info["generation"] != 2:
        return
    if phase == "start":
        _started[:] = [time.thread_time()]
        return
    spent = time.thread_time() - _started[0] if _started else 0.0
    which = "product" if _asked[0] else "auto"
    _FIGURES[which] += 1
    _FIGURES[which + "_s"] += spent


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("RESUMERGE_TEST_GCLOG"):
        gc.collect = _counted_collect  # type: ignore[assignment]
        gc.callbacks.append(_callback)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection_finish(session: pytest.Session) -> Iterator[None]:
    _FIGURES.update(product=0, product_s=0.0, auto=0, auto_s=0.0, tracked=len(gc.get_objects()))  # the tests' own
    yield
    if os.environ.get("RESUMERGE_TEST_GCLOG_FREEZE"):
        gc.collect()
        gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    log = os.environ.get("RESUMERGE_TEST_GCLOG")
    if not log:
        return
    with open(log, "a", encoding="utf-8") as out:
        row = {"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "frozen": gc.get_freeze_count(),
               **{k: round(v, 3) if isinstance(v, float) else v for k, v in _FIGURES.items()}}
        out.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="the JSON lines RESUMERGE_TEST_GCLOG named")
    rows = [json.loads(line) for line in parser.parse_args().log.read_text().splitlines() if line.strip()]
    for row in rows:
        print(f"{row['worker']}: {row['tracked']} objects tracked after the collection; the product's full "
              f"collections {row['product']} ({row['product_s']:.1f} CPU s), the collector's own {row['auto']} "
              f"({row['auto_s']:.1f} CPU s)")
    if len(rows) > 1:
        print(f"all: the product's {sum(r['product'] for r in rows)} ({sum(r['product_s'] for r in rows):.1f} CPU s), "
              f"the collector's own {sum(r['auto'] for r in rows)} ({sum(r['auto_s'] for r in rows):.1f} CPU s)")


if __name__ == "__main__":
    main()

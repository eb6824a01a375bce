"""A command a bench times with a given resumerge tree: its wall seconds and the CPU seconds of it and of every
descendant it waited for (user + system, ``RUSAGE_CHILDREN``); a failed one stops the bench with its stderr's
tail. Shared by the start-up and status benches (``bench_eval_start``, ``bench_moe_start``, ``bench_start_parts``,
``status_plan_costs``, ``bench_evolve``)."""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path


def ab_parser(doc: str, work: str, pairs: int = 3) -> argparse.ArgumentParser:
    """The command line of a bench that alternates two resumerge trees, A_ROOT and B_ROOT (each on ``PYTHONPATH`` in
    turn), for ``--pairs`` pairs of runs in ``--work`` (default: ``work`` under the temporary folder); ``doc``'s first
    line its description."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("a_root")
    parser.add_argument("b_root")
    parser.add_argument("--pairs", type=int, default=pairs)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / work)
    return parser


def tree_env(tree: str | Path | None, **extra: str) -> dict[str, str]:
    """This process's environment with ``tree``'s resumerge on ``PYTHONPATH`` (None: the environment's own) and
    ``extra`` set."""
    return {**os.environ, **({"PYTHONPATH": str(tree)} if tree is not None else {}), **extra}


def children_cpu() -> float:
    """CPU seconds (user + system) of every child this process has waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def reap() -> None:
    """Wait for every process left to this process as a subreaper (a killed run's workers die a moment after it)."""
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return


def timed_run(argv: list[str], env: Mapping[str, str], *, cwd: Path | None = None, stdin: str | None = None,
              reaped: bool = False) -> tuple[float, float, str]:
    """(wall s, CPU s of it and its descendants, stdout) of ``argv`` run to its end in ``env`` (``reaped``: the
    processes it left to this subreaper waited for too, their CPU counted); exits the bench where it fails."""
    before = children_cpu()
    start = time.perf_counter()
    done = subprocess.run(argv, env=dict(env), cwd=cwd, input=stdin, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if reaped:
        reap()
    cpu = children_cpu() - before
    if done.returncode != 0:
        raise SystemExit(f"{argv} failed ({done.returncode}): {done.stderr[-3000:]}")
    return wall, cpu, done.stdout

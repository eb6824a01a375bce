"""``resumerge plan --json``'s time estimate for a bench's config, and its text beside a measured run.

Shared by the benches that print ``plan``'s estimate next to what they measure (bench_vs_mergekit.py,
bench_quant.py): the plan runs in a fresh process like the run it estimates, so its start-up counts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def plan_estimate(config: Path, out: Path, state: Path, flags: list[str]) -> dict[str, object]:
    """``resumerge plan CONFIG OUT --json --state-dir STATE FLAGS...``'s ``time`` document (``out`` removed first:
    the plan of a fresh run). Raises SystemExit with the plan's stderr when it fails."""
    shutil.rmtree(out, ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "resumerge", "plan", str(config), str(out), "--json", "--state-dir",
                           str(state), *flags], capture_output=True, text=True, check=False, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"resumerge plan {config} failed:\n{done.stderr[-3000:]}")
    timing: dict[str, object] = json.loads(done.stdout)["time"]
    return timing


def planned_seconds(timing: dict[str, object], key: str = "seconds") -> float:
    """One figure of the ``time`` document (NaN when the plan could not give it)."""
    value = timing.get(key)
    return float(value) if isinstance(value, (int, float)) else float("nan")


def planned_text(timing: dict[str, object]) -> str:
    """The estimate and its parts, e.g. ``6.7 s (start-up 2.5, compute 0.2, disk 4.2, last shard's flush 0.6)``."""
    num = lambda key: planned_seconds(timing, key)  # noqa: E731
    return (f"{num('seconds'):.1f} s (start-up {num('startup_seconds'):.1f}, compute {num('compute_seconds'):.1f}, "
            f"disk {num('disk_seconds'):.1f}, last shard's flush {num('tail_seconds'):.1f})")


def compute_lines(timing: dict[str, object]) -> list[str]:
    """``plan``'s line per compute group (what was sampled, its rate, threads and tensors at once)."""
    groups = timing.get("compute")
    if not isinstance(groups, list):
        return []
    lines = []
    for g in groups:
        if isinstance(g, dict):
            rate = g.get("seconds_per_element")
            per = f"{rate * 1e9:.2f} ns/element" if isinstance(rate, (int, float)) else str(g.get("note"))
            lines.append(f"{g.get('method')} {g.get('dtype')}: {per}, {g.get('threads')} thread(s) x "
                         f"{g.get('at_once')} at once, {g.get('tensors')} tensors, {g.get('seconds')} s")
    return lines


def against_measured(timing: dict[str, object], wall: float, cpu: float, cores: int) -> str:
    """The estimate over the measured wall, and over the run's CPU seconds spread on ``cores`` (what a quiet
    machine's wall tends to when the run keeps them busy: on a loaded one the wall counts others' turns on the
    cores, the CPU hardly moves)."""
    estimated = planned_seconds(timing)
    return (f"{estimated / wall:.2f}x the measured wall {wall:.2f} s, {estimated / (cpu / cores):.2f}x its CPU "
            f"{cpu:.2f} s over {cores} cores")

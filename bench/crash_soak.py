"""Crash soak: hundreds of random SIGKILLs across many merge configs, each followed by resume, checked byte for byte.

Usage::

    python bench/crash_soak.py [--trials N] [--quick] [--seed S] [--work DIR] [--only NAME ...]

For every scenario (methods including the randomised ``dare_ties`` and ``della``, float32 / bfloat16 / float16
inputs and outputs, shard sizes from 40 kB to one shard, a passthrough self-stack) the script generates small
models, runs one uninterrupted reference merge and times it, then runs trials: each trial starts ``resumerge
run``, SIGKILLs it at a random moment of the merge (or at a random commit-protocol kill point, see
``resumerge/killpoints.py``), resumes and kills again up to three times, sometimes deletes the whole state dir in
between (forcing the ledger to be rebuilt from OUT's manifest), and finally resumes to the end (the reference run
and that last resume are never killed: they run in the soak's own process, without an interpreter start each).
Every output file must equal the reference's. Prints one table row per scenario and exits 1 on any mismatch or failure.
``--quick`` runs three scenarios with three trials each (about a minute on 2 cores); tests/test_soak.py runs
that in CI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from resumerge.cli.modelgen import ModelSpec, make_model  # noqa: E402
from resumerge.machine.killpoints import POINTS  # noqa: E402

ConfigBuilder = Callable[[list[Path]], dict[str, object]]
# Starts a killable run or resume: its command line (``python -m resumerge ...``) and environment in, a process out
# (subprocess.Popen, or what quacks like it: pid, poll, send_signal, communicate, returncode).
Starter = Callable[[list[str], dict[str, str]], "subprocess.Popen[str]"]


@dataclass(frozen=True)
class Scenario:
    """One merge to soak: the models to generate (dtype, count), the config, and the output shard size."""

    name: str
    build: ConfigBuilder
    models: int
    shard: str
    dtype: torch.dtype = torch.float32
    seed_flag: int = 0


def _weighted(method: str, **extra: object) -> ConfigBuilder:
    def build(paths: list[Path]) -> dict[str, object]:
        base, *rest = paths
        weights = [0.5, 0.3, 0.2]
        models: list[dict[str, object]] = [{"model": str(base)}]
        models += [{"model": str(p), "parameters": {"weight": weights[i], "density": 0.6}} for i, p in
                   enumerate(rest)]
        return {"merge_method": method, "base_model": str(base), "models": models, **extra}

    return build


def _linear(paths: list[Path]) -> dict[str, object]:
    return {"merge_method": "linear", "models": [
        {"model": str(paths[0]), "parameters": {"weight": [0.2, 0.8]}},
        {"model": str(paths[1]), "parameters": {"weight": 0.5}},
    ], "dtype": "float32"}


def _slerp(paths: list[Path]) -> dict[str, object]:
    return {"merge_method": "slerp", "base_model": str(paths[0]), "models": [{"model": str(p)} for p in paths],
            "parameters": {"t": [0.1, 0.5, 0.9]}, "out_dtype": "float16"}


def _stack(paths: list[Path]) -> dict[str, object]:
    return {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": str(paths[0]), "layer_range": [0, 3]}]},
        {"sources": [{"model": str(paths[0]), "layer_range": [1, 4]}]},
    ]}


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("linear-f32-100k", _linear, 2, "100k"),
    Scenario("dare_ties-bf16-60k", _weighted("dare_ties", dtype="bfloat16"), 3, "60k", torch.bfloat16, 7),
    Scenario("ties-f16-40k", _weighted("ties", dtype="float32", out_dtype="float16"), 3, "40k", torch.float16),
    Scenario("slerp-f32-1shard", _slerp, 2, "1B"),
    Scenario("della-f32-150k", _weighted("della", parameters={"epsilon": 0.05}), 3, "150k", torch.float32, 3),
    Scenario("task_arithmetic-bf16-80k", _weighted("task_arithmetic"), 3, "80k", torch.bfloat16),
    Scenario("passthrough-stack-bf16-50k", _stack, 1, "50k", torch.bfloat16),
)
QUICK = ("dare_ties-bf16-60k", "ties-f16-40k", "passthrough-stack-bf16-50k")


@dataclass(frozen=True)
class Prepared:
    """A scenario ready to soak: its config file, reference digests, how long its merge phase lasts, how many
    files it commits (the manifest in OUT lists them as they are committed) and how many of them are shards (committed
    first: the side files follow the last one)."""

    scenario: Scenario
    config: Path
    reference: dict[str, str]
    window: float
    files: int
    shards: int


@dataclass
class Row:
    """Counts for one scenario."""

    name: str
    trials: int = 0
    starts: int = 0
    kills: int = 0
    state_losses: int = 0
    identical: int = 0
    problems: list[str] = field(default_factory=list)


def digests(directory: Path) -> dict[str, str]:
    """sha256 of every regular file directly in ``directory``."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def _command(prepared: Prepared, out: Path, state: Path, command: str) -> list[str]:
    args = [sys.executable, "-m", "resumerge", command]
    if command == "run":
        args += [str(prepared.config), str(out), "--out-shard-size", prepared.scenario.shard,
                 "--random-seed", str(prepared.scenario.seed_flag)]
    else:
        args.append(str(out))
    return [*args, "--state-dir", str(state), "--quiet"]


def _env(kill_at: str | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("RESUMERGE_KILL_AT", None)
    if kill_at:
        env["RESUMERGE_KILL_AT"] = kill_at
    return env


def fresh_process(command: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """The soak's own way to start a killed run or resume: a fresh interpreter (its stderr kept for the report)."""
    return subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def prepare(scenario: Scenario, work: Path) -> Prepared:
    """Generate the scenario's models, run the reference merge, and time its merge phase."""
    home = work / scenario.name
    shutil.rmtree(home, ignore_errors=True)
    spec = ModelSpec(layers=4, hidden=64, intermediate=160, vocab=256, dtype=scenario.dtype, shard_bytes=120_000)
    paths = [make_model(home / f"m{i}", spec, seed=i + 1) for i in range(scenario.models)]
    config = home / "config.yml"
    config.write_text(yaml.safe_dump(scenario.build(paths), sort_keys=False))
    ref = home / "reference"
    placeholder = Prepared(scenario, config, {}, 0.0, 0, 0)
    # In this process: an uninterrupted run needs no process of its own (an interpreter start with torch, about
    # 3 CPU seconds). Its merge phase is timed from the manifest's first write, as the kills see it.
    written: list[float] = []
    ended = threading.Event()
    watcher = threading.Thread(target=_first_write, args=(ref / "resumerge-manifest.json", written, ended),
                               daemon=True)
    watcher.start()
    try:
        code = _in_process(_command(placeholder, ref, home / "ref-state", "run"))
    finally:
        ended.set()
        watcher.join()
    if code != 0 or not written:
        raise SystemExit(f"{scenario.name}: reference run failed: exit {code}")
    window = time.monotonic() - written[0]
    planned = json.loads((ref / "resumerge-manifest.json").read_text())["planned"]
    shards = sum(1 for name in planned if name.endswith(".safetensors"))
    return Prepared(scenario, config, digests(ref), window, len(planned), shards)


def _first_write(manifest: Path, written: list[float], ended: threading.Event) -> None:
    """Append to ``written`` the moment ``manifest`` first exists, polling as :func:`_wait_for_change` does, unless
    ``ended`` is set first."""
    while not ended.is_set():
        if manifest.exists():
            written.append(time.monotonic())
            return
        time.sleep(0.003)


def _in_process(command: list[str]) -> int:
    """Run ``command`` (a ``python -m resumerge ...`` command line) in this process; its exit code."""
    from resumerge.cli.commands import main

    return main(command[3:])


def _committed(manifest: Path) -> int:
    """How many files the manifest lists as committed (it is replaced atomically, so a read is never torn)."""
    try:
        return len(json.loads(manifest.read_text())["committed"])
    except (FileNotFoundError, ValueError, KeyError):
        return 0


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def _wait_for_change(path: Path, before: tuple[int, int] | None, proc: subprocess.Popen[str], limit: float) -> None:
    """Wait until ``path`` is (re)written by ``proc`` — the manifest is, once the merge proper starts — or it exits."""
    deadline = time.monotonic() + limit
    while proc.poll() is None and time.monotonic() < deadline:
        now = _stamp(path)
        if now is not None and now != before:
            return
        time.sleep(0.003)


def _one_start(prepared: Prepared, out: Path, state: Path, rng: random.Random, *, may_kill: bool,
               start: Starter = fresh_process) -> tuple[int, bool]:
    """Start run/resume; unless finishing, kill it at a random moment or kill point. Returns (exit code, killed)."""
    command = "resume" if (out / "resumerge-manifest.json").exists() else "run"
    use_point = may_kill and rng.random() < 0.3
    kill_at = f"{rng.choice(POINTS)}:{rng.randint(1, 3)}" if use_point else None
    if not may_kill:  # the finishing start needs no process of its own: in this one, an interpreter start saved
        code = _in_process(_command(prepared, out, state, command))
        if code != 0:
            raise RuntimeError(f"{command} exited {code}")
        return code, False
    manifest = out / "resumerge-manifest.json"
    before = _stamp(manifest)
    proc = start(_command(prepared, out, state, command), _env(kill_at))
    if not use_point:
        # Kill at a random point of progress (after a random number of commits, then a random fraction of the
        # time one commit takes) rather than at a random time, which misses whenever the machine is faster than
        # when the reference was timed. The point is among the shards' commits: the side files after them take
        # milliseconds, so a kill aimed there mostly came too late (a start wasted, and its trial ended); the kill
        # points cover their writes.
        _wait_for_change(manifest, before, proc, 120)
        target = rng.randint(min(_committed(manifest), prepared.shards - 1), prepared.shards - 1)
        while proc.poll() is None and _committed(manifest) < target:
            time.sleep(0.004)
        time.sleep(rng.uniform(0.0, 1.5 * prepared.window / prepared.files))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    if proc.returncode not in (0, -signal.SIGKILL):
        raise RuntimeError(f"{command} exited {proc.returncode}: {err.strip()[-500:]}")
    return proc.returncode, proc.returncode == -signal.SIGKILL


def trial(prepared: Prepared, row: Row, rng: random.Random, work: Path, start: Starter = fresh_process) -> None:
    """One trial: up to three killed starts (state dir sometimes lost in between), then a finishing resume."""
    out, state = work / prepared.scenario.name / "out", work / prepared.scenario.name / "state"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)
    row.trials += 1
    try:
        for _ in range(rng.randint(1, 3)):
            code, killed = _one_start(prepared, out, state, rng, may_kill=True, start=start)
            row.starts += 1
            row.kills += killed
            if code == 0:
                break
            if rng.random() < 0.15 and state.exists():
                shutil.rmtree(state)
                row.state_losses += 1
        code, _ = _one_start(prepared, out, state, rng, may_kill=False)
        row.starts += 1
        got = digests(out)
        if got == prepared.reference:
            row.identical += 1
        else:
            differ = sorted(n for n in set(got) | set(prepared.reference) if got.get(n) != prepared.reference.get(n))
            row.problems.append(f"trial {row.trials}: files differ: {', '.join(differ)}")
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        row.problems.append(f"trial {row.trials}: {exc}")


def soak(names: Sequence[str], trials: int, seed: int, work: Path, *, deadline: float | None = None,
         report: Callable[[str], None] = print, start: Starter = fresh_process) -> list[Row]:
    """Soak the named scenarios; stops starting new trials after ``deadline`` (a time.monotonic value). ``start``
    starts each killed run or resume (tests/test_soak.py forks them from its fork server: torch imported once)."""
    rows = []
    chosen = [s for s in SCENARIOS if s.name in names]
    for index, scenario in enumerate(chosen):
        prepared = prepare(scenario, work)
        row = Row(scenario.name)
        rng = random.Random(seed * 1000 + index)
        for _ in range(trials):
            if deadline is not None and time.monotonic() > deadline and row.trials:
                break
            trial(prepared, row, rng, work, start)
        report(f"{row.name}: {row.trials} trials, {row.kills} kills, {row.identical} identical"
               + (f", {len(row.problems)} problems" if row.problems else ""))
        rows.append(row)
    return rows


def table(rows: Sequence[Row]) -> str:
    """The summary as a markdown table."""
    lines = ["| scenario | trials | starts | SIGKILLs landed | state dir lost | identical | mismatched / failed |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.trials} | {r.starts} | {r.kills} | {r.state_losses} | {r.identical} | "
                     f"{len(r.problems)} |")
    total = Row("total", sum(r.trials for r in rows), sum(r.starts for r in rows), sum(r.kills for r in rows),
                sum(r.state_losses for r in rows), sum(r.identical for r in rows),
                [p for r in rows for p in r.problems])
    lines.append(f"| **total** | {total.trials} | {total.starts} | {total.kills} | {total.state_losses} | "
                 f"{total.identical} | {len(total.problems)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20, help="trials per scenario [default: 20]")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, 3 trials each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=HERE / "work" / "soak")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="scenarios to run (default: all)")
    args = parser.parse_args()
    names = list(QUICK) if args.quick else args.only or [s.name for s in SCENARIOS]
    trials = 3 if args.quick else args.trials
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows = soak(names, trials, args.seed, args.work)
    print()
    print(table(rows))
    print(f"\n{time.monotonic() - started:.0f} s; command: python bench/crash_soak.py "
          + ("--quick" if args.quick else f"--trials {trials}") + f" --seed {args.seed}")
    problems = [p for r in rows for p in r.problems]
    for p in problems:
        print("PROBLEM:", p)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()

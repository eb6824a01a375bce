"""The start-up of a hidden-gates MoE run: wall and CPU of ``resumerge run`` (fresh; and of the same config with
``gate_mode: cheap_embed``, whose prompts are tokenised in a process of their own), of ``resumerge run`` again
after a kill past the gates (the pass's routers finished in the state dir, the routers' shard not committed), and
of ``resumerge resume`` after such a kill, for two checkouts of resumerge side by side, alternated.

Usage::

    python bench/bench_moe_start.py A_ROOT B_ROOT [--pairs 3] [--work DIR] [--layers 8] [--hidden 512]
                                                  [--out-shard-size 20MB] [--only SCENARIO,...]

Generates three float32 Llama-style models (``--layers``, ``--hidden``; the base and two experts), writes a
``gate_mode: hidden`` config over them, and for each pair runs every scenario with A's code then B's (the next pair
B then A), each with a fresh OUT and state dir. The kill is this script's: it polls the state dir and SIGKILLs the
run as soon as the pass's ``routers.safetensors`` exists (the pass's process dies with the run), and the slot is
reported only if OUT was left unfinished. CPU is the whole process tree's: this script is a child subreaper, so
every process the run started (the prompt pass's included, killed or not) is reaped here and counted in its
``RUSAGE_CHILDREN``. Prints one JSON line per timed command and a summary (means per scenario and code), with
``os.getloadavg()`` at each start (it counts other sessions' niced work too).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from childtime import ab_parser, children_cpu, reap, tree_env

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_PR_SET_CHILD_SUBREAPER = 36
PROMPTS = (["ab cd ef gh", "Ab Cd Ef"], ["zz yy xx", "Zq rs tu vw"])


def make_models(work: Path, layers: int, hidden: int) -> list[Path]:
    from resumerge.cli.modelgen import ModelSpec, make_model

    spec = ModelSpec(layers=layers, hidden=hidden, intermediate=hidden * 11 // 4, heads=8, kv_heads=4,
                     shard_bytes=1 << 30)
    return [m if (m / "config.json").is_file() else make_model(m, spec, seed=60 + i)
            for i, m in enumerate(work / f"m{i}" for i in range(3))]


def write_config(work: Path, models: list[Path], mode: str = "hidden") -> Path:
    lines = [f"base_model: {models[0]}", f"gate_mode: {mode}", "experts:"]
    for i, model in enumerate(models[1:]):
        lines += [f"  - source_model: {model}", "    positive_prompts:"]
        lines += [f"      - {p!r}" for p in PROMPTS[i]]
    path = work / f"{mode}.yml"
    path.write_text("\n".join(lines) + "\n")
    return path


def past_the_gates(state: Path, out: Path) -> bool:
    """The pass's routers are finished in ``state`` and the run recorded its plan (a shard of OUT is committed)."""
    return any(state.glob("moe-routers/*/routers.safetensors")) and any(out.glob("model-*.safetensors"))


def timed(argv: list[str], root: str, *, kill_when: tuple[Path, Path] | None = None) -> dict[str, object]:
    """Run ``argv`` with ``root``'s resumerge; SIGKILL it once it is past the gates (``kill_when``: its state dir
    and OUT). Wall, tree CPU, exit code."""
    env = tree_env(root)
    before = children_cpu()
    load = os.getloadavg()
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if kill_when is not None:
        while proc.poll() is None and not past_the_gates(*kill_when):
            time.sleep(0.005)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    wall = time.perf_counter() - start
    reap()
    cpu = children_cpu() - before
    if proc.returncode not in (0, -9):
        raise SystemExit(f"{argv} failed ({proc.returncode}): {err[-2000:]}")
    return {"wall": round(wall, 2), "cpu": round(cpu, 2), "rc": proc.returncode,
            "load": [round(x, 1) for x in load]}


SCENARIOS = ("run", "run cheap_embed", "run again past the gates", "resume past the gates")


def slot(code: str, root: str, config: Path, scratch: Path, shard: str,
         only: tuple[str, ...] = SCENARIOS) -> list[dict[str, object]]:
    """The scenarios ``only`` once with ``root``'s code, OUT in shards of ``shard``."""
    python = [sys.executable, "-P", "-m", "resumerge"]
    rows = []
    for scenario, path in (("run", config), ("run cheap_embed", config.with_name("cheap_embed.yml"))):
        if scenario not in only:
            continue
        out, state = scratch / f"{code}-{path.stem}", scratch / f"{code}-{path.stem}-state"
        rows.append({"scenario": scenario, **timed([*python, "run", str(path), str(out), "--state-dir", str(state),
                                                    "--out-shard-size", shard, "--quiet"], root)})
    for scenario in ("run again past the gates", "resume past the gates"):
        if scenario not in only:
            continue
        out, state = scratch / f"{code}-{scenario[:3]}", scratch / f"{code}-{scenario[:3]}-state"
        killed = timed([*python, "run", str(config), str(out), "--state-dir", str(state), "--out-shard-size", shard,
                        "--quiet"], root,
                       kill_when=(state, out))
        if killed["rc"] != -9 or (out / "model.safetensors.index.json").exists():
            rows.append({"scenario": scenario, "skipped": "the run ended before the kill"})
            continue
        again = ([*python, "run", str(config), str(out), "--out-shard-size", shard]
                 if scenario.startswith("run") else [*python, "resume", str(out)])
        rows.append({"scenario": scenario, **timed([*again, "--state-dir", str(state), "--quiet"], root)})
        assert (out / "model.safetensors.index.json").exists()
    for path in scratch.iterdir():
        shutil.rmtree(path)
    return [{"code": code, **row} for row in rows]


def main() -> None:
    parser = ab_parser(__doc__, "bench-moe-start")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--out-shard-size", default="20MB")
    parser.add_argument("--only", default=",".join(SCENARIOS), help="scenarios, comma-separated")
    args = parser.parse_args()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    args.work.mkdir(parents=True, exist_ok=True)
    models = make_models(args.work, args.layers, args.hidden)
    config = write_config(args.work, models)
    write_config(args.work, models, "cheap_embed")  # its prompts tokenised in a process of their own
    scratch = args.work / "runs"
    shutil.rmtree(scratch, ignore_errors=True)  # a broken earlier run's
    scratch.mkdir()
    rows: list[dict[str, object]] = []
    for pair in range(args.pairs):
        order = [("A", args.a_root), ("B", args.b_root)]
        for code, root in order if pair % 2 == 0 else order[::-1]:
            for row in slot(code, root, config, scratch, args.out_shard_size, tuple(args.only.split(","))):
                row["pair"] = pair + 1
                print(json.dumps(row), flush=True)
                rows.append(row)
    for scenario in SCENARIOS:
        for code in ("A", "B"):
            got = [r for r in rows if r["scenario"] == scenario and r["code"] == code and "wall" in r]
            if got:
                wall = sum(float(str(r["wall"])) for r in got) / len(got)
                cpu = sum(float(str(r["cpu"])) for r in got) / len(got)
                print(f"{scenario:26} {code}: wall {wall:.2f} s, CPU {cpu:.2f} s (mean of {len(got)})")


if __name__ == "__main__":
    main()

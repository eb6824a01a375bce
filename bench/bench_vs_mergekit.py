"""resumerge vs mergekit 0.1.5 on generated models of a chosen size, with the machine's floor and durability's cost.

Usage::

    python bench/bench_vs_mergekit.py [--size 1.7GB] [--methods linear,ties,dare_ties,slerp | all] [--runs 3]
        [--out-shard-size 1B] [--work DIR] [--cold] [--skip-mergekit] [--resumerge-args "..."]
        [--mergekit-args "..."]

Generates three Llama-style float32 models of about ``--size`` bytes each (once; kept in ``--work``), then for
every method (any of the twenty both tools implement, each with a config both accept; ``--methods all`` runs
them all and reports them side by side) runs the same YAML through ``resumerge run`` (fully durable),
``resumerge run`` with ``RESUMERGE_UNSAFE_NO_FSYNC=1`` (every fsync and the ledger's on-disk journal skipped:
what durability costs) and ``mergekit-yaml``, alternating the order run by run, and reports for each: median
wall time, peak RSS of the merge process alone (``ru_maxrss`` from ``wait4`` in a tiny launcher, so this
script's own memory never counts),
bytes read and written (the launcher's ``/proc/self/io`` after reaping the merge, which the kernel credits with
the child's I/O), the size of the output, and ``resumerge resume`` on the finished merge (which re-hashes every
committed file). Before the runs, ``resumerge plan --json`` estimates each method's wall time (start-up, disk work
and the compute it times on a sample of the inputs); the estimate is printed next to the measured median.

The floor for the same bytes: ``import torch`` in a fresh interpreter; a warm read of every input file the
method reads (page cache primed first); a cold read of them (only with ``--cold``, which drops the page cache
through ``/proc/sys/vm/drop_caches`` and says so when the machine does not allow it); and writing the output's
size to one new file followed by ``fsync``. ``floor = import + warm read + fsynced write`` (cold read when
measured); the ratio ``resumerge / floor`` is printed with the mergekit ratio. Ends with the results as markdown
rows and the exact command line, ready for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from launcher import launched  # noqa: E402
from plan_estimate import against_measured, plan_estimate, planned_text  # noqa: E402

from resumerge.machine.memory.sizes import format_size, parse_size  # noqa: E402


def _config(method: str, body: str, parameters: str = "") -> str:
    """A YAML config for both tools: ``body`` lists the models (``{a}``, ``{b}``, ``{c}`` are filled in later)."""
    text = f"merge_method: {method}\n{body}"
    if parameters:
        text += f"parameters:\n{parameters}"
    return text + "dtype: float32\n"


_TWO = """models:
  - model: {a}
    parameters: {{weight: 0.5}}
  - model: {b}
    parameters: {{weight: 0.5}}
"""
# base a plus two fine-tunes; `extra` goes into each fine-tune's parameters
_TASK = """base_model: {a}
models:
  - model: {b}
    parameters: {{weight: 0.6%(extra)s}}
  - model: {c}
    parameters: {{weight: 0.4%(extra)s}}
"""
_BASE_AND = """base_model: {a}
models:
  - model: {a}
%(others)s"""
_B = "  - model: {b}\n"
_C = "  - model: {c}\n"

# Every method mergekit 0.1.5 and resumerge both implement, with a config each accepts as is.
METHODS: dict[str, str] = {
    "linear": _config("linear", _TWO),
    "slerp": _config("slerp", _BASE_AND % {"others": _B}, "  t: 0.4\n"),
    "nuslerp": _config(
        "nuslerp",
        "models:\n  - model: {b}\n    parameters: {{weight: 0.4}}\n  - model: {c}\n    parameters: {{weight: 0.6}}\n",
    ),
    "multislerp": _config("multislerp", _TASK % {"extra": ""}),
    "karcher": _config("karcher", "models:\n  - model: {a}\n  - model: {b}\n  - model: {c}\n"),
    "task_arithmetic": _config("task_arithmetic", _TASK % {"extra": ""}),
    "ties": _config("ties", _TASK % {"extra": ", density: 0.5"}),
    "dare_ties": _config("dare_ties", _TASK % {"extra": ", density: 0.5"}),
    "dare_linear": _config("dare_linear", _TASK % {"extra": ", density: 0.5"}),
    "breadcrumbs": _config("breadcrumbs", _TASK % {"extra": ", density: 0.5, gamma: 0.01"}),
    "breadcrumbs_ties": _config("breadcrumbs_ties", _TASK % {"extra": ", density: 0.5, gamma: 0.01"}),
    "della": _config("della", _TASK % {"extra": ", density: 0.5, epsilon: 0.1"}),
    "della_linear": _config("della_linear", _TASK % {"extra": ", density: 0.5, epsilon: 0.1"}),
    "sce": _config("sce", _BASE_AND % {"others": _B + _C}, "  select_topk: 0.5\n"),
    "ram": _config("ram", _BASE_AND % {"others": _B + _C}),
    "ramplus_tl": _config("ramplus_tl", _BASE_AND % {"others": _B + _C}),
    "model_stock": _config("model_stock", _BASE_AND % {"others": _B + _C}),
    "nearswap": _config("nearswap", _BASE_AND % {"others": _B}, "  t: 0.0001\n"),
    "arcee_fusion": _config("arcee_fusion", _BASE_AND % {"others": _B}),
    "passthrough": _config("passthrough", "models:\n  - model: {a}\n"),
}


@dataclass(frozen=True)
class Measure:
    """One measured command."""

    wall: float
    peak_rss: int
    rchar: int
    wchar: int
    read_bytes: int
    write_bytes: int
    out_bytes: int = 0
    cpu: float = 0.0  # user + system seconds of the command and its children


def run_measured(argv: list[str], env: dict[str, str] | None = None) -> Measure:
    """Run ``argv`` through the launcher; raises SystemExit with its stderr when it fails."""
    done = launched(argv, env, cwd=ROOT)
    if done.code != 0:
        raise SystemExit(f"{shlex.join(argv)} failed:\n{done.stderr[-3000:]}")
    return Measure(done.wall, done.peak_rss, done.rchar, done.wchar, done.read_bytes, done.write_bytes, cpu=done.cpu)


def model_spec(size: int) -> tuple[object, int]:
    """A ModelSpec whose float32 weights take about ``size`` bytes, and that exact size."""
    from resumerge.cli.modelgen import ModelSpec, tensor_shapes

    hidden, inter, vocab = (2048, 5504, 8000) if size >= 1_000_000_000 else (1024, 2816, 8000)
    per_layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * 4
    fixed = (2 * vocab * hidden + hidden) * 4
    layers = max(1, round((size - fixed) / per_layer))
    spec = ModelSpec(layers=layers, hidden=hidden, intermediate=inter, vocab=vocab, heads=16, kv_heads=16,
                     shard_bytes=min(450_000_000, max(50_000_000, size // 4)), tokenizer=True)
    exact = 0
    for shape in tensor_shapes(spec).values():
        n = 4
        for d in shape:
            n *= d
        exact += n
    return spec, exact


def make_inputs(work: Path, size: int) -> tuple[list[Path], int]:
    """Generate models a, b, c of about ``size`` bytes (kept between invocations of the same size)."""
    from resumerge.cli.modelgen import make_model

    spec, exact = model_spec(size)
    paths = []
    for index, name in enumerate("abc"):
        path = work / f"models-{exact}" / name
        if not (path / "config.json").exists():
            print(f"generating {path} ({format_size(exact)}) ...", flush=True)
            shutil.rmtree(path, ignore_errors=True)
            make_model(path, spec, seed=index + 1)  # type: ignore[arg-type]
        paths.append(path)
    return paths, exact


def _read_all(files: list[Path]) -> None:
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass


def drop_caches() -> str | None:
    """Drop the page cache (needs root outside a locked-down container); returns why not, or None when dropped."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        return f"cannot drop the page cache here ({exc.strerror}); cold read not measured"
    return None


def floors(inputs: list[Path], out_bytes: int, work: Path, cold: bool) -> dict[str, float | str]:
    """The machine's floor for the same bytes: torch import, warm (and cold) read, fsynced write."""
    files = [p for d in inputs for p in sorted(d.glob("*.safetensors"))]
    result: dict[str, float | str] = {}
    imports = [run_measured([sys.executable, "-c", "import torch"]).wall for _ in range(3)]
    result["torch import s"] = statistics.median(imports)
    if cold:
        why = drop_caches()
        if why is None:
            start = time.monotonic()
            _read_all(files)
            result["cold read s"] = time.monotonic() - start
        else:
            result["cold read s"] = why
    _read_all(files)
    start = time.monotonic()
    _read_all(files)
    result["warm read s"] = time.monotonic() - start
    target = work / "floor.bin"
    block = os.urandom(64 << 20)
    start = time.monotonic()
    with open(target, "wb", buffering=0) as fh:
        left = out_bytes
        while left > 0:
            left -= fh.write(block[: min(left, len(block))])
        os.fsync(fh.fileno())
    result["fsynced write s"] = time.monotonic() - start
    target.unlink()
    read = result.get("cold read s")
    read_s = read if isinstance(read, float) else float(result["warm read s"])
    result["floor s"] = float(result["torch import s"]) + read_s + float(result["fsynced write s"])
    return result


def _output_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file())


@dataclass(frozen=True)
class MethodResult:
    """Everything measured for one method: runs per label, resumes of the finished merge, floors, input bytes,
    and ``resumerge plan``'s time estimate (its ``time`` document)."""

    measures: dict[str, list[Measure]]
    resumes: list[Measure]
    floor: dict[str, float | str]
    inputs: int
    planned: dict[str, object] | None = None


@dataclass(frozen=True)
class Tool:
    """A way of running the merge."""

    name: str
    unsafe: bool = False


def _argv(tool: Tool, config: Path, out: Path, state: Path, shard: str, extra: list[str],
          mergekit_extra: list[str]) -> list[str]:
    if tool.name == "mergekit":
        exe = shutil.which("mergekit-yaml")
        assert exe is not None
        return [exe, str(config), str(out), "--random-seed", "0", "--quiet", "--out-shard-size", shard,
                *mergekit_extra]
    return [sys.executable, "-m", "resumerge", "run", str(config), str(out), "--quiet", "--state-dir", str(state),
            "--out-shard-size", shard, *extra]


def bench_method(method: str, models: list[Path], args: argparse.Namespace, tools: list[Tool]) -> MethodResult:
    """Alternate the tools ``args.runs`` times on ``method``; returns medians, the resume time and floors."""
    config = args.work / f"{method}.yml"
    config.write_text(METHODS[method].format(a=models[0], b=models[1], c=models[2]))
    used = [m for m, key in zip(models, "abc") if "{" + key + "}" in METHODS[method]]
    extra = shlex.split(args.resumerge_args)
    mergekit_extra = shlex.split(args.mergekit_args)
    planned = plan_estimate(config, args.work / "out-plan", args.work / "state-plan",
                            ["--out-shard-size", args.out_shard_size])
    print(f"{method} plan estimate {planned_text(planned)}", flush=True)
    measures: dict[str, list[Measure]] = {t.name + ("-unsafe" if t.unsafe else ""): [] for t in tools}
    for run in range(args.runs):
        order = tools if run % 2 == 0 else list(reversed(tools))
        for tool in order:
            label = tool.name + ("-unsafe" if tool.unsafe else "")
            out, state = args.work / f"out-{label}", args.work / f"state-{label}"
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(state, ignore_errors=True)
            env = dict(os.environ, PYTHONHASHSEED="0")
            if tool.unsafe:
                env["RESUMERGE_UNSAFE_NO_FSYNC"] = "1"
            m = run_measured(_argv(tool, config, out, state, args.out_shard_size, extra, mergekit_extra), env)
            m = Measure(**{**m.__dict__, "out_bytes": _output_bytes(out)})
            measures[label].append(m)
            print(f"{method} run {run + 1} {label:17s} wall {m.wall:7.2f} s  CPU {m.cpu:6.2f} s  "
                  f"peak RSS {m.peak_rss / 1e6:7.0f} MB  "
                  f"written {m.write_bytes / 1e6:8.1f} MB  output {m.out_bytes / 1e6:8.1f} MB", flush=True)
    resumes = [run_measured([sys.executable, "-m", "resumerge", "resume", str(args.work / "out-resumerge"),
                             "--quiet", "--state-dir", str(args.work / "state-resumerge")]) for _ in range(2)]
    out_bytes = measures["resumerge"][-1].out_bytes
    return MethodResult(measures, resumes, floors(used, out_bytes, args.work, args.cold),
                        sum(p.stat().st_size for d in used for p in d.glob("*.safetensors")), planned)


def _median(rows: list[Measure], attr: str) -> float:
    return float(statistics.median(getattr(r, attr) for r in rows))


def report(method: str, result: MethodResult) -> list[str]:
    """Markdown table rows and note lines for one method."""
    measures, floor, resumes = result.measures, result.floor, result.resumes
    mergekit = measures.get("mergekit") or []
    lines = []
    for label, rows in measures.items():
        if not rows:
            continue
        wall = _median(rows, "wall")
        walls = ", ".join(f"{r.wall:.2f}" for r in rows)
        vs = f"{wall / _median(mergekit, 'wall'):.2f}×" if mergekit and label != "mergekit" else "—"
        rss_vs = (f"{_median(rows, 'peak_rss') / _median(mergekit, 'peak_rss'):.2f}×"
                  if mergekit and label != "mergekit" else "—")
        lines.append(f"| {method} | {label} | {wall:.2f} ({walls}) | {_median(rows, 'peak_rss') / 1e6:.0f} | "
                     f"{_median(rows, 'read_bytes') / 1e6:.0f} / {_median(rows, 'rchar') / 1e6:.0f} | "
                     f"{_median(rows, 'write_bytes') / 1e6:.0f} / {_median(rows, 'wchar') / 1e6:.0f} | "
                     f"{_median(rows, 'out_bytes') / 1e6:.0f} | {vs} | {rss_vs} | "
                     f"{wall / float(floor['floor s']):.2f}× |")
    safe, unsafe = measures.get("resumerge") or [], measures.get("resumerge-unsafe") or []
    notes = [f"- {method}: inputs read {result.inputs / 1e6:.0f} MB (page-cache reads show as rchar, not "
             "read_bytes); " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k}: {v}"
                                          for k, v in floor.items())]
    if safe and unsafe:
        cost = _median(safe, "wall") - _median(unsafe, "wall")
        notes.append(f"- {method}: durability costs {cost:.2f} s ({cost / _median(safe, 'wall') * 100:.0f} % of the "
                     f"durable run's {_median(safe, 'wall'):.2f} s)")
    if result.planned is not None and safe:
        vs = against_measured(result.planned, _median(safe, "wall"), _median(safe, "cpu"), os.cpu_count() or 1)
        notes.append(f"- {method}: `resumerge plan` estimated {planned_text(result.planned)}: {vs} (durable run)")
    resume_wall = statistics.median(r.wall for r in resumes)
    resume_rss = statistics.median(r.peak_rss for r in resumes)
    notes.append(f"- {method}: `resumerge resume` of the finished merge (re-hashes every committed file): "
                 f"{resume_wall:.2f} s, {resume_rss / 1e6:.0f} MB")
    return lines + notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1.7GB", help="bytes per input model, e.g. 200MB, 1.7GB [default: 1.7GB]")
    parser.add_argument("--methods", default="linear,ties,dare_ties,slerp",
                        help=f"comma list from {', '.join(METHODS)}, or 'all' [default: linear,ties,dare_ties,slerp]")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs per tool [default: 3]")
    parser.add_argument("--out-shard-size", default="1B", help="for both tools [default: 1B]")
    parser.add_argument("--work", type=Path, default=HERE / "work" / "vs-mergekit")
    parser.add_argument("--cold", action="store_true", help="also measure a cold read (drops the page cache)")
    parser.add_argument("--skip-mergekit", action="store_true")
    parser.add_argument("--no-unsafe", action="store_true", help="skip the RESUMERGE_UNSAFE_NO_FSYNC=1 runs")
    parser.add_argument("--resumerge-args", default="", help="extra flags for resumerge run")
    parser.add_argument("--mergekit-args", default="", help="extra flags for mergekit-yaml (e.g. --cuda)")
    args = parser.parse_args()
    methods = list(METHODS) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    args.work.mkdir(parents=True, exist_ok=True)
    models, exact = make_inputs(args.work, parse_size(args.size, option="--size"))
    tools = [Tool("resumerge")]
    if not args.no_unsafe:
        tools.append(Tool("resumerge", unsafe=True))
    if not args.skip_mergekit:
        if shutil.which("mergekit-yaml") is None:
            parser.error("mergekit-yaml is not on PATH (pip install mergekit==0.1.5) or pass --skip-mergekit")
        tools.append(Tool("mergekit"))
    lines = []
    for method in methods:
        lines += report(method, bench_method(method, models, args, tools))
    print()
    print(f"Inputs: three generated float32 models of {exact / 1e6:.0f} MB each; {args.runs} alternating runs per "
          f"tool; {os.cpu_count()} CPUs.")
    print(f"Command: `python bench/bench_vs_mergekit.py {shlex.join(sys.argv[1:])}`")
    print()
    print("| method | run | median wall s (each run) | peak RSS MB | read MB (disk / all) | written MB (disk / all) "
          "| output MB | wall vs mergekit | RSS vs mergekit | wall vs floor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for line in lines:
        if line.startswith("|"):
            print(line)
    print()
    for line in lines:
        if line.startswith("-"):
            print(line)


if __name__ == "__main__":
    main()

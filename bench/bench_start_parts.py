"""Two start-up parts alone, for two checkouts of resumerge side by side, alternated, each in a fresh process: the
MoE prompt work's process tokenising a config's prompts (``cheap_embed``'s job, started with its job as ``run``
starts it) and an evaluation's tokenizer (``resumerge.analyses.evaluation.run._tokenizer``, after the module's own
imports, which are not counted).

Usage::

    python bench/bench_start_parts.py A_ROOT B_ROOT MODEL... [--pairs 6]

Each MODEL is a folder with a tokenizer. Wall and CPU of the tokenizer process (its ``RUSAGE_CHILDREN``) and of the
tokenizer's load (``time.process_time`` around ``_tokenizer`` in its process); ``os.getloadavg()`` at each start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from childtime import timed_run, tree_env

_TOKENIZER = """
import inspect, sys, time
from types import SimpleNamespace
from pathlib import Path
from resumerge.analyses.evaluation import run
model = SimpleNamespace(path=sys.argv[1], opened=SimpleNamespace(directory=Path(sys.argv[1])))
start, wall = time.process_time(), time.perf_counter()
args = (model, False) if len(inspect.signature(run._tokenizer).parameters) == 2 else (model,)
tokenizer = run._tokenizer(*args)
print(time.process_time() - start, time.perf_counter() - wall, type(tokenizer).__name__, "transformers" in sys.modules)
"""


def encode_child(root: str, model: Path, given: bool) -> dict[str, object]:
    """The prompt work's process tokenising two prompt sets (``--job-given`` where ``root``'s ``run`` gives it)."""
    job = {"job": "encode", "mode": "cheap_embed", "prompts": [[["ab cd ef gh", "Ab Cd Ef"], None],
                                                               [["zz yy xx", "Zq rs tu vw"], ["mn op"]]],
           "tokenizer_dir": str(model), "workdir": "/tmp", "parent": os.getpid()}
    argv = [sys.executable, "-P", "-m", "resumerge.runs.moe.passmain", str(os.getpid()),
            *(["--job-given"] if given else [])]
    wall, cpu, out = timed_run(argv, tree_env(root), stdin=json.dumps(job))
    return {"wall": round(wall, 2), "cpu": round(cpu, 2), "answer": out.strip().splitlines()[-1][:60]}


def eval_tokenizer(root: str, model: Path) -> dict[str, object]:
    wall, cpu, out = timed_run([sys.executable, "-P", "-c", _TOKENIZER, str(model)], tree_env(root))
    part_cpu, part_wall, kind, imported = out.split()
    return {"process_wall": round(wall, 2), "process_cpu": round(cpu, 2), "cpu": round(float(part_cpu), 2),
            "wall": round(float(part_wall), 2), "tokenizer": kind, "transformers_imported": imported == "True"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a_root")
    parser.add_argument("b_root")
    parser.add_argument("models", type=Path, nargs="+")
    parser.add_argument("--pairs", type=int, default=6)
    args = parser.parse_args()
    given = {"A": "--job-given" in (Path(args.a_root) / "resumerge/runs/moe/passproc.py").read_text(),
             "B": "--job-given" in (Path(args.b_root) / "resumerge/runs/moe/passproc.py").read_text()}
    rows: list[dict[str, object]] = []
    for pair in range(args.pairs):
        order = [("A", args.a_root), ("B", args.b_root)]
        for code, root in order if pair % 2 == 0 else order[::-1]:
            for model in args.models:
                load = [round(x, 1) for x in os.getloadavg()]
                for part, row in (("moe encode", encode_child(root, model, given[code])),
                                  ("eval tokenizer", eval_tokenizer(root, model))):
                    row = {"pair": pair + 1, "code": code, "part": part, "model": model.name, **row, "load": load}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    for part in ("moe encode", "eval tokenizer"):
        for model in args.models:
            for code in ("A", "B"):
                got = [r for r in rows if r["part"] == part and r["model"] == model.name and r["code"] == code]
                wall = sum(float(str(r["wall"])) for r in got) / len(got)
                cpu = sum(float(str(r["cpu"])) for r in got) / len(got)
                print(f"{part:15} {model.name:30} {code}: wall {wall:.2f} s, CPU {cpu:.2f} s (mean of {len(got)})")


if __name__ == "__main__":
    main()

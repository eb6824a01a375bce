"""CPU seconds of the suite's forked commands (tests/forkserver.py): a tiny local ``run``, its ``status`` and a
``resume`` of the finished run, each forked from one tree's fork server, as the tests' ``support.cli`` runs them.

Usage (one tree per process; alternate the trees, niced: the figure is CPU, not wall)::

    git archive <commit> | tar -x -C /tmp/A
    python bench/suite_fork_cpu.py /tmp/A --repeat 3

A command's CPU is what the server's reaped children add to its own counters (``/proc/PID/stat`` cutime + cstime):
the child's whole life, from the fork to its exit. The first round also compiles the tree's bytecode: only the later
rounds are reported.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path


def _reaped_cpu(pid: int) -> float:
    """CPU seconds of the reaped children of ``pid``."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", type=Path, help="a resumerge source tree (its tests/forkserver.py is the server)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path[:0] = [str(tree), str(tree / "tests")]
    os.environ["PYTHONPATH"] = str(tree)
    from forkserver import ForkServer  # the tree's own
    from support import linear_config, write_config

    from resumerge.cli.modelgen import ModelSpec, make_model

    work = Path(tempfile.mkdtemp(prefix="suite-fork-cpu-"))
    spec = ModelSpec(layers=4, hidden=64, intermediate=128, vocab=200, shard_bytes=200_000)
    a, b = make_model(work / "a", spec, seed=0), make_model(work / "b", spec, seed=1)
    config = write_config(work / "c.yml", linear_config(a, b))
    out, state = work / "out", work / "state"
    commands = {"run": ["run", str(config), str(out), "--state-dir", str(state), "--out-shard-size", "100k",
                        "--quiet"],
                "status": ["status", str(out), "--state-dir", str(state), "--json"],
                "resume": ["resume", str(out), "--state-dir", str(state), "--quiet"]}
    server = ForkServer()
    env = dict(os.environ)
    seconds: dict[str, list[float]] = {name: [] for name in commands}
    try:
        for round_ in range(args.repeat + 1):
            for name, argv in commands.items():
                before = _reaped_cpu(server.process.pid)
                done = server.run(argv, env, 600)
                assert done is not None and done.returncode == 0, done and done.stderr
                if round_:
                    seconds[name].append(_reaped_cpu(server.process.pid) - before)
            shutil.rmtree(out)
            shutil.rmtree(state)
    finally:
        server.close()
        shutil.rmtree(work)
    print(tree, "  ".join(f"{name} {sum(v) / len(v):.2f} CPU s ({', '.join(f'{x:.2f}' for x in v)})"
                          for name, v in seconds.items()))


if __name__ == "__main__":
    main()

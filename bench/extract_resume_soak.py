"""Issue 87 item 2: an extraction SIGKILLed mid shard write, resumed again and again, beside CPU hogs.

The kind contract's extraction case (tests/test_kind_contract.py) as a loop: the same tiny pair (2 layers, hidden 32,
rank 4), one uninterrupted reference run, then ``--repeats`` times a run killed by a real SIGKILL at
``mid_shard_write`` and resumed twice from a copy of the killed state: once as it was recorded, once with its ledger
made the version before kinds were recorded. Every resumed adapter's digest must equal the reference's. With
``--hogs N`` (default 2) N ``python -c 'while 1: pass'`` processes run at normal priority for the whole loop, and are
killed at its end. Every command is forked from the suite's fork server (tests/forkserver.py), as the test runs them.

    PYTHONPATH=$PWD python bench/extract_resume_soak.py --repeats 20 --hogs 2

Prints one line per resume and, at the end, the set of digests seen; exits 1 when any resume differed (its
adapter is kept under ``--keep`` for a look).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support import cli

from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.locations import LEDGER_NAME

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
ADAPTER = "adapter_model.safetensors"


def _digest(out: Path) -> str:
    return hashlib.sha256((out / ADAPTER).read_bytes()).hexdigest()


def _as_recorded_before(state: Path) -> None:
    """The ledgers under ``state`` as the version before kinds were recorded left them (as the kind contract does)."""
    for path in state.rglob(LEDGER_NAME):
        with sqlite3.connect(path) as db:
            db.execute("ALTER TABLE run DROP COLUMN kind")
            db.execute("DELETE FROM _sqlite_migrations WHERE name = 'm005_run_kind'")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--keep", type=Path, default=None, help="where a differing adapter is kept")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="extract-soak-"))
    hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.hogs)]
    seen: dict[str, int] = {}
    started = time.monotonic()
    try:
        base, ft = (make_model(root / f"m{i}", SPEC, seed=20 + i) for i in range(2))

        def extraction(out: Path, state: Path) -> list[str | Path]:
            return ["extract-lora", "--model", ft, "--base-model", base, "--out-path", out, "--max-rank", "4",
                    "--state-dir", state, "-q"]

        done = cli(*extraction(root / "reference" / "out", root / "reference" / "state"), timeout=600)
        assert done.returncode == 0, done.stderr
        reference = _digest(root / "reference" / "out")
        print(f"reference {reference[:12]}", flush=True)
        differed = 0
        for repeat in range(args.repeats):
            run = root / f"run{repeat}"
            killed = cli(*extraction(run / "out", run / "state"), env={"RESUMERGE_KILL_AT": "mid_shard_write"},
                         timeout=600)
            assert killed.returncode == -9, killed.stderr
            shutil.copytree(run, root / "killed")
            for recorded in ("kind", "before kinds"):
                if recorded != "kind":
                    shutil.rmtree(run)
                    shutil.copytree(root / "killed", run)
                    _as_recorded_before(run / "state")
                resumed = cli("resume", run / "out", "--state-dir", run / "state", "-q", timeout=600)
                assert resumed.returncode == 0, resumed.stderr
                digest = _digest(run / "out")
                seen[digest] = seen.get(digest, 0) + 1
                same = digest == reference
                print(f"{repeat + 1:3d} {recorded:12s} {digest[:12]} {'same' if same else 'DIFFERENT'} "
                      f"({time.monotonic() - started:.0f} s)", flush=True)
                if not same:
                    differed += 1
                    if args.keep is not None:
                        args.keep.mkdir(parents=True, exist_ok=True)
                        shutil.copy(run / "out" / ADAPTER, args.keep / f"{repeat}-{recorded.replace(' ', '-')}.st")
            shutil.rmtree(root / "killed")
            shutil.rmtree(run)
        print(f"digests seen: { {d[:12]: n for d, n in seen.items()} }; {differed} resumes differed "
              f"of {2 * args.repeats}; {time.monotonic() - started:.0f} s with {args.hogs} hogs")
        return 1 if differed else 0
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

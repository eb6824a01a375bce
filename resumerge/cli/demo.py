"""``resumerge demo``: the whole promise on a laptop in seconds, with nothing to download.

Generates two small Llama-style models, starts a real ``resumerge run`` in a child process that is killed
(SIGKILL) just after committing its second shard, shows the status, resumes, and checks that every output
file is byte-identical to an uninterrupted run of the same config. Only the killed run is a process of its own
(a fresh interpreter: the kill must end a real process); the status, the resume, the verify and the uninterrupted
run are the same commands run here, through the command line's own ``main`` (each fresh interpreter cost an
import of torch, 1-2.5 CPU s apiece: a demo spent 6-8 CPU s in the six it started).

Without a DIR it works in ``demo/`` under the state dir (``$XDG_STATE_HOME/resumerge``, else
``~/.local/state/resumerge``, or ``RESUMERGE_STATE_DIR``), never in the current directory (often a clone), and
says where; the next demo there replaces it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.locations import state_root
from resumerge.merge.store.manifest import MANIFEST_NAME

CONFIG = """\
# A layer-wise linear merge whose weights follow a gradient over the layers.
merge_method: linear
slices:
  - sources:
      - model: {a}
        layer_range: [0, 6]
        parameters:
          weight: [1.0, 0.0]
      - model: {b}
        layer_range: [0, 6]
        parameters:
          weight: [0.0, 1.0]
dtype: float32
"""
SHARD_SIZE = "120k"


def _digests(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def _killed_run(*args: str) -> int:
    """``resumerge run ARGS`` in a fresh interpreter that kills itself (SIGKILL) right after its second committed
    shard; its exit status (negative: the signal that ended it)."""
    sys.stdout.flush()
    env = dict(os.environ, RESUMERGE_KILL_AT="after_manifest_write:2")
    return subprocess.run([sys.executable, "-m", "resumerge", "run", *args], env=env, check=False).returncode


def _cli(*args: str) -> int:
    """``resumerge ARGS`` in this process; its exit code. The handlers a merging command installs for SIGINT and
    SIGTERM (its stop flag) are put back afterwards: a Ctrl-C between the demo's steps ends the demo, as before."""
    kept = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        return main(list(args))
    finally:
        sys.stdout.flush()
        for number, handler in kept.items():
            if handler is not None:  # (None: not installed from Python, nothing to put back)
                signal.signal(number, handler)


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo in ``args.dir`` (None: ``demo/`` under the state dir; created, earlier demo output there is
    replaced). Returns an exit code."""
    root = Path(args.dir if args.dir is not None else state_root() / "demo").absolute()
    for sub in ("models", "out", "out-reference", "state"):
        shutil.rmtree(root / sub, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    spec = ModelSpec(layers=6, hidden=64, intermediate=128, vocab=128, shard_bytes=150_000)
    a = make_model(root / "models" / "model-a", spec, seed=1)
    b = make_model(root / "models" / "model-b", spec, seed=2)
    config = root / "merge.yml"
    config.write_text(CONFIG.format(a=a, b=b))
    state = str(root / "state")
    out = str(root / "out")
    print(f"resumerge demo in {root}" + ("" if args.dir is not None else " (give a DIR to put it elsewhere)"))
    print(f"1. generated two models in {root / 'models'}; config: {config}")

    print("2. resumerge run ... (killed with SIGKILL right after its second shard is committed)")
    code = _killed_run(str(config), out, "--state-dir", state, "--out-shard-size", SHARD_SIZE, "--quiet")
    print(f"   the merge process died (exit status {code}); what survived:")
    _cli("status", out, "--state-dir", state)

    print("3. resumerge resume ... (picks up from the last committed shard)")
    if _cli("resume", out, "--state-dir", state) != 0:
        return 1
    _cli("status", out, "--state-dir", state)
    _cli("verify", out, "--state-dir", state)

    print("4. the same merge without interruption, for comparison")
    ref = str(root / "out-reference")
    if _cli("run", str(config), ref, "--state-dir", state, "--out-shard-size", SHARD_SIZE, "--quiet") != 0:
        return 1
    got, want = _digests(Path(out)), _digests(Path(ref))
    same = got == want
    # verify counted the committed files; OUT holds them and the manifest that lists them (which verify reads)
    committed = sum(1 for name in got if name != MANIFEST_NAME)
    print(f"   out/ holds {committed} committed files and {MANIFEST_NAME}; byte-identical to the uninterrupted "
          f"run: {'yes' if same else 'NO'}")
    print(f"everything is in {root}: the config, the models, out/ and out-reference/")
    return 0 if same else 1

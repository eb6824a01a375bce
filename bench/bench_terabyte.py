"""A simulated terabyte hub-to-hub run (issue 45): DeepSeek-V3 x R1's first layers merged from the stand-in hub into
``hf://`` behind a 150/75 MB/s link, measured per byte and extrapolated to the whole 689 GB pair.

Usage::

    python bench/bench_terabyte.py [--layers 1] [--down 150] [--up 75] [--shard 1GB] [--work DIR]

Writes DeepSeek-V3's real headers over holes (``tests/sparse_checkpoints.py``: ``--layers`` decoder layers with the
embedding, final norm and head, no MTP layer) once, and the stand-in hub of ``tests/hub`` (in this process, on
127.0.0.1) serves that folder as two repos (``deepseek-ai/v3`` and ``deepseek-ai/r1``) through mapped files
(:class:`hub.fakehub.SparseFile`): the holes are served as zeros, never read from disk nor held in memory. Two runs,
each ``resumerge run`` in a fresh process with an empty HF cache, a linear merge at 0.5/0.5:

- ``compute``: the local sparse folders into a local OUT (no network): the merge's own rate, per input byte;
- ``hub``: the hub repos into ``hf://bench/merged`` (``--stream-inputs``: every input read by byte range) behind
  the link (``tests/hub/fakehub_link.py``): wall against the link floor ``max(down bytes / down rate, up bytes /
  up rate)``, bytes down and up, commits.

Then the full pair (the plan's 1,346 GB in, 673 GB out, from ``tests/sparse_checkpoints.py``): the link floor at
the given rates, the compute time at the measured rate, the wall the pipeline would take (the larger of the two,
times the measured run's wall over its own larger one: what the pipeline loses to its start, its tail and the
machine), and the 12-hour sessions that wall needs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from hub.fakehub import FakeHub, sparse_files_of  # noqa: E402
from hub.fakehub_link import Link  # noqa: E402
from hub.fakehub_write import HubWriter  # noqa: E402
from sparse_checkpoints import DEEPSEEK_V3, nbytes, tensor_specs, write_sparse_checkpoint  # noqa: E402

MB, GB = 10**6, 10**9
TOKEN = "bench-token"
SESSION = 12 * 3600


def _config(path: Path, a: str, b: str) -> Path:
    path.write_text(f"merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: 0.5}}\n"
                    f"  - model: {b}\n    parameters: {{weight: 0.5}}\n")
    return path


def _run(argv: list[str], env: dict[str, str]) -> float:
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "resumerge", *argv], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"resumerge {argv[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--down", type=float, default=150.0, help="MB/s")
    parser.add_argument("--up", type=float, default=75.0, help="MB/s")
    parser.add_argument("--shard", default="1GB", help="--out-shard-size of both runs")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--compute-seconds", type=float, default=None,
                        help="the compute run's wall measured before on the same --work (skips that run)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-terabyte-"))
    model = write_sparse_checkpoint(work / "v3", DEEPSEEK_V3, layers=args.layers, mtp=False)
    other = work / "r1"
    if not other.exists():
        other.symlink_to(model, target_is_directory=True)
    inputs = 2 * sum(p.stat().st_size for p in model.glob("*.safetensors"))
    print(f"inputs: 2 x {inputs / 2 / GB:.2f} GB (DeepSeek-V3, {args.layers} layer(s), embedding and head), "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env |= {"HF_HOME": str(work / "hf"), "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": str(ROOT)}

    out = work / "local-out"
    shutil.rmtree(out, ignore_errors=True)
    written = inputs // 2  # a linear merge keeps the inputs' formats
    compute = args.compute_seconds
    if compute is None:
        compute = _run(["run", str(_config(work / "local.yml", str(model), str(other))), str(out), "--state-dir",
                        str(work / "local-state"), "--out-shard-size", args.shard, "--quiet"], env)
        written = sum(p.stat().st_size for p in out.iterdir())
        shutil.rmtree(out)
        shutil.rmtree(work / "local-state")
    print(f"compute: {compute:.1f} s for {inputs / GB:.2f} GB in, {written / GB:.2f} GB out: "
          f"{inputs / compute / MB:.0f} MB/s of input, load {os.getloadavg()[0]:.1f}", flush=True)

    hub = FakeHub()
    writer = HubWriter.attach(hub)
    writer.add_token(TOKEN, "bench")
    shutil.rmtree(work / "hub-state", ignore_errors=True)  # a failed run's ledger
    served = sparse_files_of(model, hashed_below=1 << 62)  # hashed: a file streamed whole is checked
    for repo in ("deepseek-ai/v3", "deepseek-ai/r1"):
        hub.push(repo, served)
    down, up = args.down * MB, args.up * MB
    with hub:
        hub.link = Link(down=down, up=up)
        hub.reset_counters()
        shutil.rmtree(work / "hf", ignore_errors=True)
        wall = _run(["run", str(_config(work / "hub.yml", "deepseek-ai/v3", "deepseek-ai/r1")), "hf://bench/merged",
                     "--state-dir", str(work / "hub-state"), "--out-shard-size", args.shard, "--stream-inputs",
                     "--quiet"], env | {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN})
        got, sent, commits = hub.link.down_bytes, hub.link.up_bytes, writer.commits.get("bench/merged", 0)
        hub.drop("bench/merged")
    shutil.rmtree(work / "hub-state", ignore_errors=True)
    floor = max(got / down, sent / up)
    print(f"hub to hub at {args.down:g}/{args.up:g} MB/s: {wall:.1f} s, link floor {floor:.1f} s "
          f"({wall / floor:.2f}x), down {got / GB:.2f} GB, up {sent / GB:.2f} GB, {commits} commits, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)

    full_in = 2 * sum(map(nbytes, tensor_specs(DEEPSEEK_V3)))
    full_out = full_in // 2
    full_floor = max(full_in / down, full_out / up)
    full_compute = full_in / (inputs / compute)
    loss = wall / max(floor, compute)
    full_wall = max(full_floor, full_compute) * loss
    sessions = math.ceil(full_wall / SESSION)
    summary = {"measured": {"inputs_gb": round(inputs / GB, 2), "output_gb": round(written / GB, 2),
                            "compute_s": round(compute, 1), "hub_wall_s": round(wall, 1),
                            "link_floor_s": round(floor, 1),
                            "down_gb": round(got / GB, 2), "up_gb": round(sent / GB, 2), "commits": commits},
               "full": {"inputs_gb": round(full_in / GB), "output_gb": round(full_out / GB),
                        "link_floor_h": round(full_floor / 3600, 2), "compute_h": round(full_compute / 3600, 2),
                        "pipeline_factor": round(loss, 2), "wall_h": round(full_wall / 3600, 2),
                        "sessions_12h": sessions}}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

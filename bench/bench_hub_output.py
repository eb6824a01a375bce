"""An hf:// merge next to a local merge of the same config, against the stand-in hub on 127.0.0.1.

Usage::

    python bench/bench_hub_output.py [--layers 8] [--hidden 512] [--out-shard-size 20MB] [--runs 3]
        [--max-disk SIZE] [--work DIR]

Generates two Llama-style float32 models (once, in ``--work``), then alternates ``resumerge.run`` into a local
directory and into ``hf://bench/merged-N`` (the stand-in hub of ``tests/hub``, with its upload side), in this
process, and reports for each: median wall time, commits per run, LFS objects PUT per file, and the peak of the
staging folder sampled every 2 ms against the output's size (and ``--max-disk`` when given). The stand-in hub is on
loopback, so the figures show resumerge's own cost of staging, hashing, uploading and committing — not a network.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
os.environ["HF_HUB_DISABLE_XET"] = "1"  # the stand-in hub speaks LFS; hf_xet would take over uploads
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

from hub.fakehub import FakeHub  # noqa: E402
from hub.fakehub_write import HubWriter  # noqa: E402

from resumerge import api  # noqa: E402
from resumerge.cli.modelgen import ModelSpec, make_model  # noqa: E402
from resumerge.config.locations import run_dir  # noqa: E402
from resumerge.machine.memory import format_size, parse_size  # noqa: E402
from tests.support import linear_config, sampled_sizes, write_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--out-shard-size", default="20MB")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-disk", default=None)
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-hub-"))
    spec = ModelSpec(layers=args.layers, hidden=args.hidden, intermediate=args.hidden * 3, vocab=4096)
    a = make_model(work / "a", spec, seed=1) if not (work / "a").exists() else work / "a"
    b = make_model(work / "b", spec, seed=2) if not (work / "b").exists() else work / "b"
    config = write_config(work / "merge.yml", linear_config(a, b))
    max_disk = parse_size(args.max_disk) if args.max_disk else None
    fake = FakeHub()
    hub = HubWriter.attach(fake)
    hub.add_token("bench-token", "bench")
    local_times, hub_times, commits, peaks_all = [], [], [], []
    output = 0
    with fake:
        os.environ.update(HF_ENDPOINT=fake.url, HF_TOKEN="bench-token", HF_HOME=str(work / "hf"))
        for i in range(args.runs):
            out = work / f"local-{i}"
            for old in (out, work / f"state-l{i}", work / f"state-h{i}"):  # a finished run would only be resumed
                shutil.rmtree(old, ignore_errors=True)
            started = time.perf_counter()
            api.run(config, out, settings=api.Settings(state_dir=work / f"state-l{i}",
                                                       output=api.Output(out_shard_size=args.out_shard_size)))
            local_times.append(time.perf_counter() - started)
            output = sum(p.stat().st_size for p in out.iterdir())
            target = f"hf://bench/merged-{i}"
            state = work / f"state-h{i}"
            started = time.perf_counter()
            with sampled_sizes(run_dir(target, state) / "staging") as peaks:
                api.run(config, target, settings=api.Settings(state_dir=state,
                                                              output=api.Output(out_shard_size=args.out_shard_size),
                                                              resources=api.Resources(max_disk=max_disk),
                                                              hub=api.Hub(commit_every=20, commit_interval=5)))
            hub_times.append(time.perf_counter() - started)
            commits.append(hub.commits[f"bench/merged-{i}"])
            peaks_all.append(max(peaks))
            repo = hub.head_files(f"bench/merged-{i}")
            assert all(repo[p.name] == p.read_bytes() for p in out.iterdir()), "hf:// output differs from local"
    puts = list(hub.puts.values())
    print(f"output {format_size(output)} in shards of {args.out_shard_size}; {args.runs} runs each")
    print(f"local OUT : median {statistics.median(local_times):.2f} s  ({', '.join(f'{t:.2f}' for t in local_times)})")
    print(f"hf:// OUT : median {statistics.median(hub_times):.2f} s  ({', '.join(f'{t:.2f}' for t in hub_times)})")
    print(f"commits per hf:// run: {commits}; LFS PUTs per object: max {max(puts)} over {len(puts)} objects")
    bound = f" (--max-disk {format_size(max_disk)})" if max_disk else ""
    print(f"staging peak: {format_size(max(peaks_all))} of a {format_size(output)} output{bound}")


if __name__ == "__main__":
    main()

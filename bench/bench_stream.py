"""Hub inputs read by HTTP Range against download-then-merge, on the stand-in hub (issue 15), plus the paper estimate.

Usage: ``python bench/bench_stream.py [--work DIR] [--layers N] [--hidden H]``

1. Streamed vs download-then-merge, in one run: a linear merge of two generated fp32 models served by the
   stand-in hub on 127.0.0.1 (``tests/hub/fakehub.py``), each mode from an empty HF cache; wall time, bytes the hub
   served, bytes left in the cache, and whether the outputs are identical.
2. Bytes fetched for a slice config: a passthrough of the first quarter of the layers of one model, auto mode.
3. On paper: a 2×70B bf16 linear merge to hf:// on a free Colab runtime (about 107 GB of disk), today and with
   streaming, at 100 MB/s down and 50 MB/s up.

Loopback has no latency and no bandwidth limit, so (1) measures resumerge's own overhead of range reads, not a
network; the figures a slow link gives follow from bytes fetched, which (1) and (2) report.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for extra in (ROOT, ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))
os.environ.update({"HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                   "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"})
os.environ.pop("HF_TOKEN", None)

GB = 1e9


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*.safetensors"))}


def _cache_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def _run(config: str, out: Path, work: Path, label: str, **kwargs: object) -> tuple[float, Path]:
    from resumerge import api
    from resumerge.api.flagmap import grouped

    cache = work / f"cache-{label}"
    os.environ["HF_HUB_CACHE"] = str(cache)
    started = time.perf_counter()
    api.run(config, out, **grouped(api.run, {"state_dir": work / f"state-{label}", **kwargs}))
    return time.perf_counter() - started, cache


def measure(work: Path, layers: int, hidden: int) -> None:
    from hub.fakehub import FakeHub, files_of

    from resumerge.cli.modelgen import ModelSpec, make_model

    spec = ModelSpec(layers=layers, hidden=hidden, intermediate=hidden * 11 // 4, vocab=8000, heads=8, kv_heads=4,
                     shard_bytes=2 * 10**9)
    hub = FakeHub()
    sizes = {}
    for repo, seed in (("bench/a", 1), ("bench/b", 2)):
        files = files_of(make_model(work / repo.replace("/", "-"), spec, seed=seed))
        sizes[repo] = sum(len(v) for k, v in files.items() if k.endswith(".safetensors"))
        hub.push(repo, files)
    linear = ("merge_method: linear\ndtype: float32\nmodels:\n  - model: bench/a\n    parameters: {weight: 0.4}\n"
              "  - model: bench/b\n    parameters: {weight: 0.6}\n")
    quarter = max(1, layers // 4)
    piece = (f"merge_method: passthrough\ndtype: float32\nslices:\n  - sources:\n      - model: bench/a\n"
             f"        layer_range: [0, {quarter}]\n")
    with hub:
        os.environ["HF_ENDPOINT"] = hub.url
        print(f"inputs: 2 models x {sizes['bench/a'] / GB:.3f} GB ({layers} layers, hidden {hidden}, fp32)")
        rows = []
        for label, kwargs in (("download", {}), ("stream", {"stream_inputs": True})):
            hub.reset_counters()
            seconds, cache = _run(linear, work / f"out-{label}", work, label, **kwargs)
            served = sum(v for k, v in hub.file_bytes().items() if k.endswith(".safetensors"))
            rows.append((label, seconds, served, _cache_bytes(cache)))
        for label, seconds, served, cached in rows:
            print(f"  linear {label:8s}: {seconds:6.2f} s, hub served {served / GB:.3f} GB, "
                  f"cache holds {cached / GB:.3f} GB")
        same = _digests(work / "out-download") == _digests(work / "out-stream")
        print(f"  outputs identical: {same}")
        hub.reset_counters()
        seconds, cache = _run(piece, work / "out-slice", work, "slice")
        served = sum(v for k, v in hub.file_bytes().items() if k.endswith(".safetensors"))
        print(f"  slice layers [0, {quarter}) of {layers} (auto): {seconds:.2f} s, hub served {served / GB:.3f} GB of "
              f"a {sizes['bench/a'] / GB:.3f} GB file ({100 * served / sizes['bench/a']:.1f} %), "
              f"cache holds {_cache_bytes(cache) / GB:.4f} GB")


def paper() -> None:
    """2×70B bf16 linear merge to hf:// on a free Colab runtime (~107 GB disk), 100 MB/s down, 50 MB/s up."""
    model = 141.1 * GB  # Llama-3-70B in bf16: 70.6e9 parameters × 2 bytes
    output, down, up, disk = model, 100e6, 50e6, 107 * GB
    shard = 5 * GB
    today = 2 * model + shard  # both inputs in the HF cache, plus at least one staged output shard
    streamed = 2 * shard  # no input on disk; two shards staged while one uploads
    print("paper: 2x70B bf16 linear merge to hf:// on free Colab (about 107 GB of disk)")
    print(f"  disk today (download then merge): {today / GB:.0f} GB, over the {disk / GB:.0f} GB available: "
          "cannot run")
    print(f"  disk with --stream-inputs and hf:// OUT: about {streamed / GB:.0f} GB (staged output shards only)")
    fetch, send = 2 * model / down, output / up
    print(f"  time: fetch {2 * model / GB:.0f} GB at 100 MB/s = {fetch / 60:.0f} min, upload {output / GB:.0f} GB at "
          f"50 MB/s = {send / 60:.0f} min; overlapped, about {max(fetch, send) / 60:.0f} min "
          f"(sequential bound {(fetch + send) / 60:.0f} min); a resume after a reset fetches only uncommitted "
          f"shards' tensors")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-stream-"))
    os.environ["HF_HOME"] = str(work / "hf_home")
    measure(work, args.layers, args.hidden)
    paper()


if __name__ == "__main__":
    main()

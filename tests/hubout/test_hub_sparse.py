"""A terabyte run in miniature (issue 45): two DeepSeek-V3-shaped repos (its tensor names, block-FP8 weights with
their scales, MTP layer and 6-digit shard names, at small dimensions) written as sparse files and served by the
stand-in hub as mapped files, so their holes are never read nor allocated. A merge of their first four layers and
the MTP module into ``hf://`` reads by byte range about the bytes the plan needs, commits many files per commit at
the paced rate (a scaled-down ``Batching.pipelined``), and a SIGKILL after its first batch, resumed on a fresh
runtime (new state dir, empty HF cache: only the repo is known), ends with the repo a local run writes, named like
the parents. The full-size run is ``bench/bench_terabyte.py``'s."""

from __future__ import annotations

import shutil
import signal
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path

import pytest
from hub.fakehub import SparseFile, files_of, sparse_files_of
from hub.fakehub_write import HubWriter
from sparse_checkpoints import DEEPSEEK_V3, disk_usage, write_sparse_checkpoint
from support import cli

from hubout.conftest import repo_files
from resumerge import api
from resumerge.config.settings import Batching

# DeepSeek-V3's layout at small dimensions: 16 layers (3 dense), 4 experts, MTP layer 16, 24 shards.
MINI = replace(DEEPSEEK_V3, vocab=512, hidden=256, layers=16, experts=4, heads=2, shards=24, intermediate=256,
               moe_intermediate=128, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
               v_head_dim=64)
A, B = "deepseek-ai/mini-v3", "deepseek-ai/mini-r1"
SHARD = "200k"
# The resume's pacing, ``Batching.pipelined``'s minute scaled to a second: past its first commit, one commit per
# spacing at most, each holding every file uploaded meanwhile.
PACED = Batching(every=1, interval=60.0, burst=1, spacing=1.0)


@dataclass(frozen=True)
class Pair:
    dirs: dict[str, Path]
    config: Path  # names the hub repos
    reference: dict[str, bytes]  # a local run's weight files, index and config


def _config(path: Path, a: str | Path, b: str | Path) -> Path:
    sources = "".join(f"      - model: {m}\n        layer_range: [0, 4]\n        parameters: {{weight: {w}}}\n"
                      for m, w in ((a, 0.7), (b, 0.3)))
    path.write_text(f"merge_method: linear\nslices:\n  - sources:\n{sources}")
    return path


def _weights(files: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in files.items() if k.endswith((".safetensors", ".index.json", "config.json"))}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    root = tmp_path_factory.mktemp("sparse")
    dirs = {A: write_sparse_checkpoint(root / "v3", MINI), B: write_sparse_checkpoint(root / "r1", MINI)}
    local = root / "local-out"
    api.run(_config(root / "local.yml", *dirs.values()), local, settings=api.Settings(state_dir=root / "state",
                                                                                      output=api.Output(out_shard_size=SHARD)))
    return Pair(dirs, _config(root / "hub.yml", A, B), _weights(files_of(local)))


def test_a_sparse_deepseek_pair_merges_hub_to_hub_by_range_paced_and_resumes_from_the_repo_alone(
        hub: HubWriter, pair: Pair, tmp_path: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for repo, directory in pair.dirs.items():
        served = sparse_files_of(directory)
        assert all(isinstance(v, SparseFile) for k, v in served.items() if k.endswith(".safetensors"))
        hub.hub.push(repo, served)
        assert disk_usage(directory) < sum(len(v) for v in served.values()) / 10  # holes, not bytes
    shards = sorted(k for k in pair.reference if k.endswith(".safetensors"))
    assert len(shards) > 8 and shards[0] == f"model-00001-of-{len(shards):06d}.safetensors"  # the parents' names
    plan = api.plan_merge(pair.config, settings=api.Settings(output=api.Output(out_shard_size=SHARD)))
    ranges = {(r.model, r.file, r.start, r.end) for t in plan.tensors.values() for ref in t.inputs
              for r in (ref, *(c for _, c in ref.companions))}
    needed = sum(end - start for _, _, start, end in ranges)
    hub.hub.reset_counters()
    out, state = "hf://alice/mini-deepseek", tmp_path / "state"
    killed = cli("run", pair.config, out, "--state-dir", state, "--out-shard-size", SHARD, "--stream-inputs",
                 "--quiet", env={"RESUMERGE_KILL_AT": "hub_after_commit:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    first = sum(v for k, v in hub.hub.file_bytes().items() if k.endswith(".safetensors"))
    committed = {k for k in repo_files(hub, "alice/mini-deepseek") if k.endswith(".safetensors")}
    assert 0 < len(committed) < len(shards)
    # A fresh runtime: no state dir, no HF cache; the scaled-down pacing.
    shutil.rmtree(state)
    shutil.rmtree(hf_env, ignore_errors=True)
    monkeypatch.setattr(Batching, "pipelined", classmethod(lambda cls: PACED))
    hub.hub.reset_counters()
    api.resume(out, settings=api.Settings(state_dir=tmp_path / "fresh"))
    assert _weights(repo_files(hub, "alice/mini-deepseek")) == pair.reference
    served = {k: v for k, v in hub.hub.file_bytes().items() if k.endswith(".safetensors")}
    # By range: the inputs' bytes the plan names (plus headers), the killed run's share once more at most.
    headers = sum(8 + int.from_bytes(bytes(f[:8]), "little") for d in pair.dirs.values()
                  for f in (SparseFile.open(p) for p in d.glob("*.safetensors")))
    total = sum(len(v) for d in pair.dirs.values() for v in sparse_files_of(d).values())
    print(f"plan needs {needed} of {total} input bytes; served {first} before the kill, {sum(served.values())} "
          f"after; {len(shards)} shards, {hub.commits['alice/mini-deepseek']} commits")
    assert needed < total / 2 and sum(served.values()) <= needed + headers
    assert first + sum(served.values()) <= 2 * needed + 2 * headers
    times = [t for repo, t in hub.hub.commit_times if repo == "alice/mini-deepseek"]
    # Paced past the burst, but for the last batch (once all is uploaded) and the manifest's "done" commit.
    assert all(b - a >= PACED.spacing * 0.95 for a, b in pairwise(times[PACED.burst:-2])), times
    # Files per commit: as many as came in a spacing (all of them on a quiet machine), never one commit each.
    assert len(times) - 1 < len(shards) - len(committed), times

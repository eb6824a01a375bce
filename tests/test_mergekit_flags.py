"""Every ``mergekit-yaml`` 0.1.5 flag is accepted, and those with a meaning here do what mergekit does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import ModelFactory
from support import digests, write_config

from resumerge.cli.commands import build_parser, main
from resumerge.errors import UsageError
from resumerge.merge.engine.devices import normalise_device

# Every option of mergekit 0.1.5's ``add_merge_options`` (read from its click parameters: opts and secondary
# opts), listed here because importing mergekit costs seconds.
MERGEKIT_FLAGS = (
    "--allow-crimes", "--no-allow-crimes", "--unsafe-truncate-embeddings", "--no-unsafe-truncate-embeddings",
    "--transformers-cache", "--lora-merge-cache", "--lora-merge-dtype", "--cuda", "--no-cuda", "--device",
    "--low-cpu-memory", "--no-low-cpu-memory", "--out-shard-size", "--copy-tokenizer", "--no-copy-tokenizer",
    "--clone-tensors", "--no-clone-tensors", "--trust-remote-code", "--no-trust-remote-code", "--random-seed",
    "--lazy-unpickle", "--no-lazy-unpickle", "--write-model-card", "--no-write-model-card", "--safe-serialization",
    "--no-safe-serialization", "-v", "--quiet", "--no-quiet", "--read-to-gpu", "--no-read-to-gpu", "--multi-gpu",
    "--no-multi-gpu", "--num-threads", "-j", "--gpu-rich", "--async-write", "--no-async-write", "--write-threads",
)
VALUES = {"--transformers-cache": "cache", "--lora-merge-cache": "cache", "--lora-merge-dtype": "float16",
          "--device": "cpu", "--out-shard-size": "1B", "--random-seed": "0", "--num-threads": "1", "-j": "1",
          "--write-threads": "1"}


def test_every_mergekit_yaml_flag_parses() -> None:
    parser = build_parser()
    for flag in MERGEKIT_FLAGS:
        value = [VALUES[flag]] if flag in VALUES else []
        parser.parse_args(["run", "c.yml", "out", flag, *value])


def test_no_write_model_card_skips_the_card_and_yaml(tmp_path: Path, make: ModelFactory) -> None:
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": [
        {"model": str(make("a", seed=1)), "parameters": {"weight": 0.5}},
        {"model": str(make("b", seed=2)), "parameters": {"weight": 0.5}}]})
    with_card, without = tmp_path / "with", tmp_path / "without"
    assert main(["run", str(cfg), str(with_card), "--quiet"]) == 0
    assert main(["run", str(cfg), str(without), "--quiet", "--no-write-model-card"]) == 0
    skipped = {"README.md", "mergekit_config.yml"}
    mine, full = digests(without), digests(with_card)
    assert skipped <= full.keys() and not skipped & mine.keys()
    assert {k: v for k, v in full.items() if k not in skipped | {"resumerge-manifest.json"}} == {
        k: v for k, v in mine.items() if k != "resumerge-manifest.json"}
    assert main(["verify", str(without)]) == 0


def test_num_threads_sets_torch_threads(tmp_path: Path, make: ModelFactory) -> None:
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "models": [str(make("a"))]})
    before = torch.get_num_threads()
    try:
        assert main(["run", str(cfg), str(tmp_path / "out"), "--quiet", "-j", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert main(["run", str(cfg), str(tmp_path / "out2"), "--quiet", "--num-threads", "0"]) == 2


def test_device_auto_is_the_gpu_when_there_is_one() -> None:
    assert normalise_device("auto") == ("cuda:0" if torch.cuda.is_available() else "cpu")
    with pytest.raises(UsageError) as refused:
        normalise_device("xpu")
    assert "auto" in str(refused.value.hint)


# Every option of mergekit 0.1.5's ``mergekit-extract-lora`` (its own and its ``add_merge_options``).
EXTRACT_LORA_FLAGS = (
    "--model", "--base-model", "--out-path", "--max-rank", "--distribute-scale", "--no-distribute-scale",
    "--embed-lora", "--no-embed-lora", "--save-module", "--exclude-regex", "-e", "--include-regex", "-i",
    "--sv-epsilon", "--skip-undecomposable", "--verbose", *MERGEKIT_FLAGS,
)
EXTRACT_VALUES = {**VALUES, "--model": "ft", "--base-model": "base", "--out-path": "out", "--max-rank": "8",
                  "--save-module": "lm_head", "--exclude-regex": "x", "-e": "x", "--include-regex": "x", "-i": "x",
                  "--sv-epsilon": "0", "--out-shard-size": "5B"}


def test_every_mergekit_extract_lora_flag_parses(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    required = ["--model", "ft", "--base-model", "base", "--out-path", "out"]
    for flag in EXTRACT_LORA_FLAGS:
        value = [EXTRACT_VALUES[flag]] if flag in EXTRACT_VALUES else []
        parser.parse_args(["extract-lora", *required, flag, *value])
    assert capsys.readouterr().err == ""


def test_extract_lora_notes_the_flags_it_ignores(tmp_path: Path, make: ModelFactory,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    base, ft = make("base", seed=1), make("ft", seed=2)
    code = main(["extract-lora", "--model", str(ft), "--base-model", str(base), "--out-path", str(tmp_path / "o"),
                 "--max-rank", "2", "--plan", "--out-shard-size", "5B", "--trust-remote-code", "-v",
                 "--lazy-unpickle", "--no-copy-tokenizer"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "note: --out-shard-size is not needed by resumerge (the adapter is written as one file); ignored" in err
    assert "note: --no-copy-tokenizer is not needed" in err and "note: --trust-remote-code is not needed" in err

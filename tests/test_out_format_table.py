"""One row per output format (issue 98): ``--out-type``'s choices, the container factory and the API's guards read
the one ``OUT_FORMATS`` table of :mod:`resumerge.config.outformats`; a new output format is its container class and
one row, shown by a toy format plugged in from outside as the toy codec and the toy command are."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import pytest
from conftest import ModelFactory
from safetensors.torch import load_file
from support import cli_here, linear_config, write_config

from resumerge.config import outformats
from resumerge.config.outformats import GGUF_OPTIONS, OUT_FORMATS, OutFormat, out_types, takes
from resumerge.outputs.containers import OutputContainer, SafetensorsShards, container_class


@dataclass(frozen=True)
class ToyShards(SafetensorsShards):
    """A toy output format: safetensors shards whose model card has a section and a tag of its own."""

    name: ClassVar[str] = "toy"
    card_tags: ClassVar[tuple[str, ...]] = ("toy-format",)

    def card_lines(self, files: Sequence[str], out_config: Mapping[str, Any]) -> list[str]:
        return ["## Toy format", "", f"Written as {len(files)} toy file(s).", ""]


def test_every_row_names_a_container_that_exists() -> None:
    assert out_types() == ("safetensors", "gguf")
    for name, row in OUT_FORMATS.items():
        assert row.name == name and issubclass(container_class(name), OutputContainer)
    assert takes("gguf", "gguf_type") and takes("gguf", "gguf_split_max_size")
    assert not takes("safetensors", "gguf_type") and not takes("nonesuch", "gguf_type")
    assert OUT_FORMATS["gguf"].options == GGUF_OPTIONS


def test_an_unknown_out_type_is_refused_in_one_line_before_any_work() -> None:
    # (the API names its own field where the CLI says --out-type, whose choices argparse holds)
    from resumerge.api import Output
    from resumerge.api.options import plan_options
    from resumerge.errors import UsageError

    with pytest.raises(UsageError, match=r"^out_type onnx: one of safetensors, gguf$"):
        plan_options(Output(out_type="onnx"), out_shard_size=None)


def _run(tmp_path: Path, config: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return cli_here("run", config, tmp_path / "out", "--state-dir", tmp_path / "state", *flags)


def test_a_new_output_format_is_its_container_and_one_row(tmp_path: Path, make: ModelFactory,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    config = write_config(tmp_path / "c.yml", linear_config(a, b))
    refused = _run(tmp_path, config, "--out-type", "toy")
    assert refused.returncode == 2 and "invalid choice: 'toy'" in refused.stderr
    monkeypatch.setattr(outformats, "OUT_FORMATS",
                        MappingProxyType({**OUT_FORMATS, "toy": OutFormat("toy", f"{__name__}:ToyShards")}))
    # the format's own options only: a GGUF option given with it is refused as with safetensors
    wrong = _run(tmp_path, config, "--out-type", "toy", "--gguf-type", "q8_0")
    assert wrong.returncode == 2 and "--gguf-type chooses a GGUF output's types" in wrong.stderr
    done = _run(tmp_path, config, "--out-type", "toy")
    assert done.returncode == 0, done.stderr
    card = (tmp_path / "out" / "README.md").read_text()
    assert "- toy-format" in card and "## Toy format" in card
    assert load_file(tmp_path / "out" / "model.safetensors").keys()  # the shards are safetensors' own

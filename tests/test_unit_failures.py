"""A merge method that fails part way through a run: whether the failing tensor was computed in a group of small
tensors or streamed in row chunks, the run ends with the method's own error (exit code and line) and every byte it
reserved from the memory governor is given back."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from safetensors import safe_open

from resumerge.cli.commands import main
from resumerge.machine.memory import MemoryGovernor
from resumerge.machine.torch_import import torch
from resumerge.merge.engine import drive
from resumerge.merge.methods import builtin, linear
from resumerge.merge.methods.spec import MergeContext
from tests.manylayers import many_layer_merge

# In the middle of the merge's only shard, so the middle of its group of small tensors.
FAILING = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A linear merge of two four-layer models of tiny tensors (one output shard)."""
    return many_layer_merge(tmp_path_factory.mktemp("failing"), 4)


def _failing_linear(config: Path, rows: slice) -> Any:
    """Linear, except that it raises ValueError when handed rows ``rows`` of :data:`FAILING`'s first input."""
    path = next(p for p in sorted((config.parent / "a").glob("*.safetensors"))
                if FAILING in safe_open(str(p), "pt").keys())  # noqa: SIM118 (safe_open is no mapping)
    target = safe_open(str(path), "pt").get_tensor(FAILING)[rows].to(torch.float32)

    def method(ctx: MergeContext) -> torch.Tensor:
        first = ctx.tensors[0]
        if first.shape == target.shape and torch.equal(first.to(torch.float32), target):
            raise ValueError("injected failure")
        return linear.linear(ctx)

    return method


def _holds_nothing(governor: MemoryGovernor) -> bool:
    """Whether ``governor`` holds no reservation: only then does it admit its whole budget at once (over its
    headroom, nothing else in flight), rather than wait."""
    try:
        governor.acquire(governor.budget, timeout=0).release()
    except TimeoutError:
        return False
    return True


@pytest.mark.parametrize("streamed", [False, True], ids=["in-a-group", "in-row-chunks"])
def test_a_method_failing_mid_run_releases_every_reservation_and_keeps_its_error(
        config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        streamed: bool) -> None:
    spec = replace(linear.SPEC, fn=_failing_linear(config, slice(4, 6) if streamed else slice(None)),
                   row_chunk=16 if streamed else None)  # 16 entries: each 8-wide tensor streams 2 rows a chunk
    monkeypatch.setattr(builtin, "BY_NAME", MappingProxyType({**builtin.BY_NAME, "linear": spec}))
    governors: list[MemoryGovernor] = []
    made = drive.make_governor

    def keep(*args: Any, **kwargs: Any) -> MemoryGovernor:
        governors.append(made(*args, **kwargs))
        return governors[-1]

    monkeypatch.setattr(drive, "make_governor", keep)
    code = main(["run", str(config), str(tmp_path / "out"), "--state-dir", str(tmp_path / "state"), "--quiet"])
    assert (code, capsys.readouterr().err) == (1, f"error: linear failed on {FAILING}: injected failure\n")
    assert len(governors) == 1 and _holds_nothing(governors[0])

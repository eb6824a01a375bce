"""Non-float tensors (integer buffers, bool masks, int64 position ids) are never blended (issue 44): copied from the
base when equal across the models, refused with the tensor's name when not — at plan time when the headers tell or
the files are on disk (issue 96: DeepSeek-V4's hash-routing tables), else when read, in the same words."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import write_config
from test_filters import write_glm

from resumerge.api import plan_merge
from resumerge.cli.commands import main
from resumerge.errors import ModelInputError
from resumerge.merge.plan.nonfloat import CHECKED_EQUAL

MASK, POSITIONS = "model.layers.1.self_attn.causal_mask", "model.position_ids"


def _buffers(positions: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    return {MASK: torch.tril(torch.ones(4, 4, dtype=torch.bool)),
            POSITIONS: torch.arange(8, dtype=torch.int64)[None] if positions is None else positions}


def _ties(tmp_path: Path, *models: Path, **extra: object) -> Path:
    return write_config(tmp_path / "c.yml", {"merge_method": "ties", "base_model": str(models[0]), "models": [
        {"model": str(m), "parameters": {"weight": 0.5, "density": 0.5}} for m in models], **extra})


def test_equal_non_float_tensors_are_copied_from_the_base_in_their_own_dtype(tmp_path: Path) -> None:
    a, b = write_glm(tmp_path / "a", 1, _buffers()), write_glm(tmp_path / "b", 2, _buffers())
    cfg = _ties(tmp_path, a, b, dtype="bfloat16", out_dtype="float16")
    accounting = plan_merge(cfg).accounting
    assert accounting is not None
    assert accounting.models[str(b)].dropped == {CHECKED_EQUAL: 2}
    assert main(["run", str(cfg), str(tmp_path / "out"), "--quiet"]) == 0
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, value in _buffers().items():
        assert out[name].dtype == value.dtype and torch.equal(out[name], value), name
    assert out["lm_head.weight"].dtype == torch.float16  # the float tensors were merged and cast as before


def test_non_float_tensors_of_other_dtypes_are_refused_when_planned(tmp_path: Path) -> None:
    a = write_glm(tmp_path / "a", 1, _buffers())
    b = write_glm(tmp_path / "b", 2, _buffers(torch.arange(8, dtype=torch.int32)[None]))
    with pytest.raises(ModelInputError) as refused:
        plan_merge(_ties(tmp_path, a, b))
    assert refused.value.tensor == POSITIONS
    assert f"non-float tensor {POSITIONS} differs between {a} and {b} (I64 and I32)" in refused.value.one_line()


def test_non_float_tensors_of_other_values_are_refused_when_planned(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    a = write_glm(tmp_path / "a", 1, _buffers())
    b = write_glm(tmp_path / "b", 2, _buffers(torch.arange(1, 9, dtype=torch.int64)[None]))
    assert main(["plan", str(_ties(tmp_path, a, b))]) == 2  # local files: compared before anything runs
    capsys.readouterr()
    assert main(["run", str(_ties(tmp_path, a, b)), str(tmp_path / "out"), "--quiet"]) == 2
    assert not (tmp_path / "out").exists()
    err = capsys.readouterr().err
    assert f"non-float tensor {POSITIONS} differs between {a} and {b} (values): non-float tensors are copied, " \
           "never blended" in err

"""extract-lora refuses, in one line and before a weight is read, a module PEFT could not wrap in the model
transformers builds (tests/newest_families.py): GLM-5's experts stored one by one, which transformers 5 fuses into
one stack as it loads, and LFM2-MoE's router, a module of the family's own. Before, both were written into an
adapter (exit 0) whose expert factors PEFT drops on load, or that PEFT refuses to load. Leaving them out with the
``-e`` the refusal names gives an adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from newest_families import make_newest_model

from resumerge.cli.commands import main

pytest.importorskip("transformers")

# family -> (the refusals' parts, one -e at a time, with the -e each names)
REFUSED = {
    "glm5": [("model.layers.1.mlp.experts.0.down_proj", "transformers builds no module", r"\.mlp\.experts\."),
             ("model.layers.1.mlp.gate", "GlmMoeDsaTopkRouter", r"\.mlp\.gate$")],
    "lfm2_moe": [("model.layers.2.feed_forward.experts.0.w1", "transformers builds no module",
                  r"\.feed_forward\.experts\."),
                 ("model.layers.2.feed_forward.gate", "Lfm2MoeTopKRouter", r"\.feed_forward\.gate$")],
}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_modules_peft_cannot_wrap_are_refused_in_one_line(family: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    base = make_newest_model(tmp_path / "base", family, 1)
    ft = make_newest_model(tmp_path / "ft", family, 2)
    out = tmp_path / "lora"
    excluded: list[str] = []
    for name, why, regex in REFUSED[family]:
        capsys.readouterr()
        args = ["extract-lora", "--model", str(ft), "--base-model", str(base), "--out-path", str(out), "--quiet"]
        assert main([*args, *excluded]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and name in lines[0] and why in lines[0] and f"-e '{regex}'" in lines[0], lines
        assert not out.exists()
        excluded += ["-e", regex]
    assert main([*args, *excluded]) == 0
    targets = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    assert "gate" not in targets and {"o_proj", "out_proj"} & set(targets)  # the attention's still decomposed

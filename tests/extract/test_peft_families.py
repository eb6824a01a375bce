"""PEFT loads extract-lora's adapters of the newest families (tests/newest_families.py) onto BASE and gives the
logits of BASE with FT's weights in every module the adapter holds, or the extraction is refused in one line.

Before: Gemma 4's ``embed_tokens_per_layer`` (an ``nn.Embedding`` not named like one) was written as a linear's
``lora_A/B``, which PEFT drops on load (0.08 off the fine-tune's logits); LFM2's ``modules_to_save`` entry ``conv``
also matched its ``ShortConv`` module and PEFT failed on load (KeyError); Nemotron-H's adapter was named by the
checkpoint's ``backbone.`` where PEFT names the model's ``model.`` (its factors dropped), without the Mamba mixers'
``A_log``, ``D`` and ``dt_bias``, and with a LoRA on ``out_proj``, which PEFT refuses for Mamba models. Now the
adapter follows the modules transformers builds: names, embeddings, unambiguous ``modules_to_save`` ends, and a
module holding parameters of its own saved whole. And with ``--embed-lora`` Gemma 4's adapter was 0.3 off where
the text starts with its pad token (below); a row the fine-tune left unchanged is now exactly zero in the factors.
"""

from __future__ import annotations

import importlib.util
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from newest_families import make_newest_model

from resumerge import api
from resumerge.cli.commands import main

# Found, not imported: peft imports transformers' modeling stack (several CPU s), paid at collection by every worker
# whether or not it runs these tests; the tests import it where they use it.
if importlib.util.find_spec("peft") is None:
    pytest.skip("peft is not installed", allow_module_level=True)
pytest.importorskip("transformers")

# the -e the families' MoE modules need (refused in one line: tests/extract/test_family_modules.py)
NEMOTRON_E = (r"\.mixer\.experts\.", r"\.mixer\.gate$")
CASES: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "gemma4": ("gemma4", (), False), "gemma4-embed-lora": ("gemma4", (), True), "lfm2": ("lfm2", (), False),
    "nemotron_h": ("nemotron_h", NEMOTRON_E, False),
}


def _logits(model: Any) -> torch.Tensor:
    # led by id 0, the pad token, whose embedding rows Gemma 4 holds at zero: the hidden state of a leading pad is
    # exactly zero, and an adapter giving 1e-8 there instead was 0.3 off after its RMSNorms (--embed-lora)
    ids = torch.arange(0, 128, 7).reshape(1, -1)
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float()


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_gives_base_with_the_fine_tuned_modules(case: str, tmp_path: Path) -> None:
    import transformers
    from peft import PeftModel

    family, excluded, embed_lora = CASES[case]
    base = make_newest_model(tmp_path / "base", family, 1)
    ft = make_newest_model(tmp_path / "ft", family, 2)
    out = tmp_path / "adapter"
    api.extract_lora(str(ft), str(base), out, lora=api.Lora(max_rank=256, embed_lora=embed_lora,
                                                             exclude_regexes=excluded))
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fine = transformers.AutoModelForCausalLM.from_pretrained(ft)
        # by hand: BASE with FT's weights but in the modules left out
        reference = transformers.AutoModelForCausalLM.from_pretrained(base)
        state = {n: t for n, t in fine.state_dict().items()
                 if not any(re.search(e, n) or re.search(e, n.rpartition(".")[0]) for e in excluded)}
        reference.load_state_dict(state, strict=False)
        adapted = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), str(out))
        want, got = _logits(reference), _logits(adapted)
    assert (want - _logits(transformers.AutoModelForCausalLM.from_pretrained(base))).abs().max() > 0.1
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    written = json.loads((out / "adapter_config.json").read_text())
    if family == "lfm2":  # the Conv1d inside each ShortConv, never the ShortConv (which holds LoRA targets)
        assert "conv.conv" in written["modules_to_save"] and "conv" not in written["modules_to_save"]
    if family == "gemma4":
        kind = "target_modules" if embed_lora else "modules_to_save"
        assert "embed_tokens_per_layer" in written[kind]


def test_a_lora_peft_refuses_on_a_mamba_model_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = make_newest_model(tmp_path / "base", "nemotron_h", 1)
    ft = make_newest_model(tmp_path / "ft", "nemotron_h", 2)
    out = tmp_path / "lora"
    # --skip-undecomposable: the Mamba mixers are not saved whole (for their A_log, D, dt_bias), their
    # projections are decomposed, and PEFT refuses out_proj's
    args = ["extract-lora", "--model", str(ft), "--base-model", str(base), "--out-path", str(out), "--quiet",
            "--skip-undecomposable", *(x for e in NEMOTRON_E for x in ("-e", e))]
    capsys.readouterr()
    assert main(args) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "backbone.layers.0.mixer.out_proj" in lines[0] and "PEFT refuses" in lines[0], lines
    assert r"-e '\.mixer\.out_proj$'" in lines[0], lines
    assert not out.exists()
    assert main([*args, "-e", r"\.mixer\.out_proj$"]) == 0
    targets = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    assert "in_proj" in targets and "out_proj" not in targets

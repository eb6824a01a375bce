"""PEFT loads the extracted adapter onto BASE, and BASE + adapter gives FT's logits: equal within 1e-4 at full rank,
and within the truncation's error below it."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from resumerge import api

# Found, not imported: peft imports transformers' modeling stack (several CPU s), paid at collection by every worker
# whether or not it runs these tests; the tests import it where they use it.
if importlib.util.find_spec("peft") is None:
    pytest.skip("peft is not installed", allow_module_level=True)


def _logits(model: Any) -> torch.Tensor:
    ids = torch.arange(0, 64, 3).reshape(1, -1)
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float()


def _models(base: Path, ft: Path, adapter: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import transformers
    from peft import PeftModel

    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fine = _logits(transformers.AutoModelForCausalLM.from_pretrained(ft))
        plain = _logits(transformers.AutoModelForCausalLM.from_pretrained(base))
        model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), str(adapter))
        return fine, plain, _logits(model)


def test_full_rank_gives_the_fine_tune(tmp_path: Path, pair: Callable[[str], tuple[Path, Path]]) -> None:
    base, ft = pair("llama")
    out = tmp_path / "adapter"
    api.extract_lora(str(ft), str(base), out, lora=api.Lora(max_rank=48))  # every module's full rank
    fine, plain, adapted = _models(base, ft, out)
    assert (fine - plain).abs().max() > 0.1  # the fine-tune does differ
    assert torch.allclose(adapted, fine, atol=1e-4, rtol=0)


def test_truncated_embed_lora_is_close(tmp_path: Path, pair: Callable[[str], tuple[Path, Path]]) -> None:
    """Rank 6 keeps the planted deltas (ranks 2 to 6) and drops the noise; embeddings and head as LoRA too."""
    base, ft = pair("llama")
    out = tmp_path / "adapter"
    api.extract_lora(str(ft), str(base), out, lora=api.Lora(max_rank=6, embed_lora=True))
    fine, plain, adapted = _models(base, ft, out)
    assert float(torch.linalg.norm(adapted - fine)) < 0.05 * float(torch.linalg.norm(plain - fine))

"""``resumerge check OUT`` of a transplant (issue 97): its record names MODEL as the base, as a merge's names its
base (it was read as a merge config: exit 2 "unknown key 'tokensurgeon'"); the built-in texts are never refused for
a token one tokenizer's chat template writes (they are read as plain text where the vocabularies differ); each
model reads a text after its own BOS (the special tokens of one role are one token); no KL is negative."""

from __future__ import annotations

import json
from pathlib import Path

from support import cli_here

from resumerge import api
from transplant.pairs import make_pair
from transplant.test_bos import add_bos

TEMPLATE = ("{% for m in messages %}<|begin|>{{ m.role }}\n{{ m.content }}<|endoftext|>\n{% endfor %}")


def test_check_of_a_transplant_compares_it_with_model_on_the_built_in_texts(tmp_path: Path) -> None:
    model, donor = make_pair(tmp_path / "pair")
    add_bos(model, "<s>")
    config = json.loads((donor / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE  # DONOR's chat writes its own special tokens, which MODEL's lacks
    (donor / "tokenizer_config.json").write_text(json.dumps(config))
    out, state = tmp_path / "out", tmp_path / "state"
    api.tokensurgeon(str(model), str(donor), out, surgery=api.Surgery(k=8), settings=api.Settings(state_dir=state))
    done = cli_here("check", out, "--state-dir", state)  # the CLI's main in this process: no interpreter started
    assert done.returncode in (0, 5), done.stdout + done.stderr  # works or "no effect": compared, not refused
    report = api.check(out, settings=api.Settings(state_dir=state))
    assert [m.role for m in report.models] == ["merge", "base"]
    base = report.models[1]
    assert Path(base.path).resolve() == model.resolve()
    assert base.kl is not None and 0.0 <= base.kl < 1e-6 and base.kl_p95 is not None and base.kl_p95 >= 0.0
    assert base.top1 == 1.0
    assert report.prompts.startswith("built-in")


def test_a_kl_below_zero_by_rounding_is_reported_as_zero() -> None:
    """Per-position KL of two models that are one is 0 up to rounding, of either sign: the report printed
    ``-2.4e-09``. The mean and the 95th percentile are of the values clamped at 0."""
    import torch

    from resumerge.forward.compared.heads import kl_summary

    assert kl_summary(torch.tensor([-2.4e-09, -1e-09, 0.0, -3e-10])) == (0.0, 0.0)
    mean, p95 = kl_summary(torch.tensor([-1e-08, 2e-08], dtype=torch.float64))
    assert mean == 1e-08 and p95 > 0.0

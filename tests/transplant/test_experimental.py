"""``stb`` and ``mp_rope``, which mergekit-tokensurgeon 0.1.5 offers but fails on (``stb`` always, ``mp_rope`` on
transformers 5 configs): each checked on tables whose expected rows are computed independently here, its parts
against 0.1.5's functions where those run, and end to end where 0.1.5 fails."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from mergekit_oracle import Mergekit
from support import output_tensors

from resumerge import api
from resumerge.api.options import Surgery
from resumerge.errors import UsageError
from resumerge.runs.transplant.approximate import Rope, apply_rope, mp_rope, token_basis
from resumerge.runs.transplant.planner import rope_of
from transplant.pairs import make_pair
from transplant.test_parity import _shared_rows


def _turned(x: torch.Tensor, position: float, heads: int, base: float) -> torch.Tensor:
    """RoPE written independently: each head's pair (i, i + h/2) as a complex number times e^(i·p·base^(−2i/h))."""
    width = x.shape[-1]
    head = width // heads
    half = head // 2
    out = x.clone()
    for h in range(heads):
        for i in range(half):
            angle = position * base ** (-2 * i / head)
            a, b = x[..., h * head + i], x[..., h * head + half + i]
            z = complex(1.0, 0.0) * math.cos(angle) + 1j * math.sin(angle)
            out[..., h * head + i] = a * z.real - b * z.imag
            out[..., h * head + half + i] = b * z.real + a * z.imag
    return out


def test_stb_carries_an_affine_map_exactly() -> None:
    """MODEL's shared rows an affine image of DONOR's (O = D W + c): with as many atoms as DONOR's width the sparse
    basis spans DONOR's centred rows, so every new token lands on t W + c (narrower DONOR or narrower MODEL)."""
    g = torch.Generator().manual_seed(0)
    for donor_width, model_width in ((16, 24), (24, 16)):
        donor = torch.randn(60, donor_width, generator=g, dtype=torch.float64)
        w = torch.randn(donor_width, model_width, generator=g, dtype=torch.float64)
        c = torch.randn(model_width, generator=g, dtype=torch.float64)
        targets = torch.randn(7, donor_width, generator=g, dtype=torch.float64)
        if model_width < donor_width:  # an injective map needs the wider side in front: MODEL → DONOR lifted
            model = torch.randn(60, model_width, generator=g, dtype=torch.float64)
            lift = torch.randn(model_width, donor_width, generator=g, dtype=torch.float64)
            donor = model @ lift
            targets = torch.randn(7, model_width, generator=g, dtype=torch.float64) @ lift
            expected = torch.linalg.lstsq(lift.T, targets.T).solution.T
        else:
            model = donor @ w + c
            expected = targets @ w + c
        got = token_basis(targets.float(), donor.float(), model.float(), min(donor_width, model_width))
        torch.testing.assert_close(got.double(), expected, atol=2e-3, rtol=1e-4)


def test_stb_basis_is_mergekits_sparse_basis() -> None:
    """The basis step that 0.1.5 never reaches (its caller passes the options as k) runs in its own function:
    resumerge's pursuit over the centred rows picks the same rows with the same weights."""
    from mergekit.tokensurgeon.token_basis import sparse_linear_basis

    from resumerge.runs.transplant.omp import batch_omp

    g = torch.Generator().manual_seed(1)
    points = torch.randn(80, 16, generator=g)
    theirs_i, theirs_c = sparse_linear_basis(points, k=6, d=16)
    centred = points - points.mean(dim=0)
    axes = torch.linalg.svd(centred.T @ centred / points.shape[0]).U
    ours_i, ours_c = batch_omp(axes.T.contiguous(), centred, 6)
    assert torch.equal(ours_i, theirs_i)
    torch.testing.assert_close(ours_c, theirs_c, atol=1e-5, rtol=1e-5)


def test_rope_turns_as_written() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 24, generator=g, dtype=torch.float64)
    got = apply_rope(x, torch.full((3,), 1.7, dtype=torch.float64), Rope(2, 500.0))
    torch.testing.assert_close(got, _turned(x, 1.7, 2, 500.0))


def test_mp_rope_finds_a_turned_atom() -> None:
    """A target that is 2.5 × DONOR's shared row 1 turned to position 0.5: one atom recovers the row, the position
    and the coefficient, and the result is 2.5 × MODEL's row 1 turned to 0.5 in MODEL's heads and base."""
    g = torch.Generator().manual_seed(3)
    donor = torch.randn(3, 32, generator=g, dtype=torch.float64)
    model = torch.randn(3, 48, generator=g, dtype=torch.float64)
    target = 2.5 * _turned(donor[1:2], 0.5, 4, 10000.0)
    got = mp_rope(target, donor, model, 1, (Rope(4, 10000.0), Rope(6, 500000.0)))
    torch.testing.assert_close(got, 2.5 * _turned(model[1:2], 0.5, 6, 500000.0), atol=1e-6, rtol=0)


def test_mp_rope_same_as_mergekit() -> None:
    """0.1.5's pursuit itself runs: the same rows on random tables, heads and bases."""
    from mergekit.tokensurgeon.omp import batch_mp_rope

    g = torch.Generator().manual_seed(4)
    targets, donor, model = (torch.randn(9, 32, generator=g), torch.randn(50, 32, generator=g),
                             torch.randn(50, 48, generator=g))
    for k in (1, 6):
        ours = mp_rope(targets, donor, model, k, (Rope(4, 10000.0), Rope(6, 1e6)))
        _, _, theirs, _ = batch_mp_rope(targets, donor, model, k, 4, 6, a_rope_base=10000.0, b_rope_base=1e6)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_rope_read_from_either_transformers_config() -> None:
    assert rope_of({"num_attention_heads": 4, "rope_theta": 5e5}, 64, "MODEL") == Rope(4, 5e5)
    assert rope_of({"num_attention_heads": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 64,
                   "MODEL") == Rope(4, 1e6)
    assert rope_of({"num_attention_heads": 4}, 64, "MODEL") == Rope(4, 10000.0)
    with pytest.raises(UsageError, match="num_attention_heads"):
        rope_of({"num_attention_heads": 5}, 64, "DONOR")


@pytest.mark.parametrize("method", ["stb", "mp_rope"])
def test_runs_where_mergekit_fails(method: str, tmp_path: Path, mergekit: Mergekit) -> None:
    """End to end on a transformers 5 pair: 0.1.5 fails; resumerge writes shared rows bit for bit, approximated
    rows that are finite and not zero, and says in the card how it differs."""
    model, donor = make_pair(tmp_path / "pair")
    cfg = json.loads((donor / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (donor / "config.json").write_text(json.dumps(cfg))
    ran = mergekit.run(model, donor, tmp_path / "theirs", "-a", method, "-k", "8", script="tokensurgeon")
    assert ran.returncode != 0 and ("rope_theta" if method == "mp_rope" else "TokenSurgeonOptions") in ran.stderr, \
        ran.stderr
    api.tokensurgeon(str(model), str(donor), tmp_path / "ours", surgery=Surgery(approximation_method=method, k=8),
                     settings=api.Settings(state_dir=tmp_path / "state"))
    out = output_tensors(tmp_path / "ours")
    _shared_rows(model, donor, out)
    embed = out["model.embed_tokens.weight"]
    assert torch.isfinite(embed).all() and int((embed.abs().sum(dim=1) == 0).sum()) == 0
    card = (tmp_path / "ours" / "README.md").read_text()
    assert f"{method} (k=8)" in card and "0.1.5" in card

"""Differential tests against mergekit-tokensurgeon 0.1.5 (the oracle) on tiny models of different tokenizers: per
method and weight scheme, tied and untied heads, the same tensors (to the tolerance named per method), rows of
tokens both vocabularies hold copied bit for bit, the same token ids in config.json; and where 0.1.5 fails or departs
from the method's definition, the difference shown."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from mergekit_oracle import Mergekit
from safetensors.torch import load_file, save_file
from support import output_tensors

from resumerge import api
from resumerge.api.options import Merging, Surgery
from transplant.pairs import make_pair

# name -> (mergekit-tokensurgeon options, absolute tolerance): omp's and the interpolations' rows are the same float32
# operations in the same order (bit for bit here); the least-squares solvers may round differently; mean is summed in
# float64 over MODEL's row ranges (never whole in memory), 0.1.5's in float32 over the whole matrix.
CASES: dict[str, tuple[tuple[str, ...], float]] = {
    "omp": (("-k", "8"), 0.0),
    "omp-default-k-one-batch": (("--batch-size", "0"), 1e-5),
    "interp-distance": (("-a", "common_interpolation", "-k", "8"), 0.0),
    "interp-cosine": (("-a", "common_interpolation", "-k", "8", "-c"), 0.0),
    "interp-barycentric": (("-a", "common_interpolation", "-k", "8", "-w", "barycentric"), 1e-5),
    "interp-least-squares": (("-a", "common_interpolation", "-k", "8", "-w", "least_squares"), 1e-5),
    "subword-mean": (("-a", "subword",), 0.0),
    "subword-sum": (("-a", "subword", "-s", "sum"), 0.0),
    "subword-weighted": (("-a", "subword", "-s", "weighted_mean"), 0.0),
    "subword-first-last": (("-a", "subword", "-s", "first_last"), 0.0),
    "mean": (("-a", "mean",), 1e-6),
    "zero": (("-a", "zero",), 0.0),
    "scaled": (("-k", "8", "-nvs", "0.5"), 0.0),
    "prefix-and-bytes": (("-k", "8", "-pm", "yes", "-bm", "yes"), 0.0),
    "magikarp": (("-k", "8", "--magikarp"), 0.0),
}
# name -> (MODEL tied, DONOR tied)
HEADS = {"untied": (False, False), "tied-model": (True, False), "tied-donor": (False, True)}
_FLAGS = {"-a": "approximation_method", "-k": "k", "-w": "weight_scheme", "-s": "subword_method",
          "--batch-size": "batch_size", "-nvs": "new_vocab_scale", "-pm": "prefix_match", "-bm": "byte_match"}


def surgery(options: tuple[str, ...]) -> Surgery:
    """The API's options of a mergekit-tokensurgeon command line."""
    given: dict[str, object] = {}
    words = list(options)
    while words:
        flag = words.pop(0)
        if flag in ("-c", "--magikarp"):
            given["cosine_similarity" if flag == "-c" else "magikarp"] = True
            continue
        value = words.pop(0)
        name = _FLAGS[flag]
        given[name] = int(value) if name in ("k", "batch_size") else float(value) if name == "new_vocab_scale" \
            else value
    return Surgery(**given)  # type: ignore[arg-type]



@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path]]:
    made: dict[str, tuple[Path, Path]] = {}

    def pair(heads: str) -> tuple[Path, Path]:
        if heads not in made:
            model_tied, donor_tied = HEADS[heads]
            made[heads] = make_pair(tmp_path_factory.mktemp(heads), model_tied=model_tied, donor_tied=donor_tied)
        return made[heads]

    return pair


def _both(mergekit: Mergekit, model: Path, donor: Path, root: Path, options: tuple[str, ...],
          merging: Merging = Merging()) -> tuple[Path, Path]:
    ours, theirs = root / "ours", root / "theirs"
    ran = mergekit.run(model, donor, theirs, *options, script="tokensurgeon")
    assert ran.returncode == 0, ran.stderr
    api.tokensurgeon(str(model), str(donor), ours, api.Settings(merging=merging, state_dir=root / "state"),
                     surgery=surgery(options))
    return ours, theirs


def _shared_rows(model: Path, donor: Path, out: dict[str, torch.Tensor]) -> None:
    """Every token both tokenizers hold (same string) has MODEL's rows, bit for bit."""
    mine = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    theirs = json.loads((donor / "tokenizer.json").read_text())["model"]["vocab"]
    source = output_tensors(model)
    both = [(theirs[t], mine[t]) for t in mine if t in theirs]
    assert len(both) > 150
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in source:
            rows = torch.tensor(both)
            assert torch.equal(out[name][rows[:, 0]], source[name][rows[:, 1]]), name


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_as_mergekit(case: str, heads: str, pairs: Callable[[str], tuple[Path, Path]], tmp_path: Path,
                          mergekit: Mergekit) -> None:
    if heads != "untied" and case not in ("omp", "interp-distance", "subword-weighted", "prefix-and-bytes",
                                          "magikarp"):
        pytest.skip("tied heads are compared on one method of each family")
    options, tolerance = CASES[case]
    model, donor = pairs(heads)
    ours, theirs = _both(mergekit, model, donor, tmp_path, options)
    a, b = output_tensors(ours), output_tensors(theirs)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        if tolerance == 0.0:
            assert torch.equal(a[name], b[name]), (name, (a[name] - b[name]).abs().max())
        else:
            torch.testing.assert_close(a[name], b[name], atol=tolerance, rtol=0)
    if case != "magikarp":  # --magikarp approximates the rows of shared tokens a model trained poorly
        _shared_rows(model, donor, a)
    ours_config, their_config = (json.loads((f / "config.json").read_text()) for f in (ours, theirs))
    for key in ("vocab_size", "eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings"):
        assert ours_config.get(key) == their_config.get(key), key
    assert (ours / "tokenizer.json").read_bytes() == (donor / "tokenizer.json").read_bytes()


def test_prefix_match_targets_the_matrix_it_names(pairs: Callable[[str], tuple[Path, Path]], tmp_path: Path,
                                                  mergekit: Mergekit) -> None:
    """0.1.5 applies ``-pm embed`` to the head and ``-pm lm_head`` to the embedding; resumerge to the one named: its
    ``embed`` output is 0.1.5's ``lm_head`` one, and the card says so."""
    model, donor = pairs("untied")
    ran = mergekit.run(model, donor, tmp_path / "theirs", "-k", "8", "-pm", "lm_head", script="tokensurgeon")
    assert ran.returncode == 0, ran.stderr
    api.tokensurgeon(str(model), str(donor), tmp_path / "ours", surgery=Surgery(k=8, prefix_match="embed"),
                     settings=api.Settings(state_dir=tmp_path / "state"))
    a, b = output_tensors(tmp_path / "ours"), output_tensors(tmp_path / "theirs")
    assert all(torch.equal(a[n], b[n]) for n in a)
    plain = tmp_path / "plain"
    api.tokensurgeon(str(model), str(donor), plain, surgery=Surgery(k=8),
                     settings=api.Settings(state_dir=tmp_path / "state"))
    c = output_tensors(plain)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    card = (tmp_path / "ours" / "README.md").read_text()
    assert "matched by prefix" in card and "applies each to the other one" in card


def test_half_precision_donor_interpolates_in_float32(tmp_path: Path, mergekit: Mergekit) -> None:
    """0.1.5 fails on a float16 DONOR with common_interpolation's default weights; resumerge measures and weighs in
    float32: the same rows as for the DONOR's values cast to float32."""
    model, donor = make_pair(tmp_path / "half", donor_dtype=torch.float16)
    ran = mergekit.run(model, donor, tmp_path / "theirs", "-a", "common_interpolation", "-k", "8",
                       script="tokensurgeon")
    assert ran.returncode != 0 and "Half" in ran.stderr, ran.stderr
    options = Surgery(approximation_method="common_interpolation", k=8)
    api.tokensurgeon(str(model), str(donor), tmp_path / "ours", surgery=options,
                     settings=api.Settings(state_dir=tmp_path / "state"))
    # the float32 twin: the same DONOR values, widened from float16
    twin = tmp_path / "twin-donor"
    shutil.copytree(donor, twin)
    for path in sorted(twin.glob("*.safetensors")):
        save_file({n: t.float() for n, t in load_file(str(path)).items()}, str(path), metadata={"format": "pt"})
    widened = (model, twin)
    api.tokensurgeon(str(widened[0]), str(widened[1]), tmp_path / "twin", surgery=options,
                     settings=api.Settings(state_dir=tmp_path / "state"))
    a, b = output_tensors(tmp_path / "ours"), output_tensors(tmp_path / "twin")
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert "half-precision DONOR" in (tmp_path / "ours" / "README.md").read_text()


def test_mean_with_noise_runs_and_is_seeded(pairs: Callable[[str], tuple[Path, Path]], tmp_path: Path,
                                           mergekit: Mergekit) -> None:
    """0.1.5 fails on ``-a mean -nvn``; resumerge adds the noise to each row, drawn per batch from --random-seed."""
    model, donor = pairs("untied")
    ran = mergekit.run(model, donor, tmp_path / "theirs", "-a", "mean", "-nvn", "0.01", script="tokensurgeon")
    assert ran.returncode != 0
    options = Surgery(approximation_method="mean", new_vocab_noise=0.01)
    outs = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        api.tokensurgeon(str(model), str(donor), tmp_path / name, surgery=options,
                         settings=api.Settings(merging=Merging(random_seed=seed), state_dir=tmp_path / "state"))
        outs.append(output_tensors(tmp_path / name)["model.embed_tokens.weight"])
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    mean = output_tensors(model)["model.embed_tokens.weight"].mean(dim=0)
    drift = (outs[0] - mean).abs().max().item()
    assert 0 < drift < 0.2  # noise of σ 0.01 around the mean, not an error


def test_john_hewitt_with_fewer_rows_than_width(tmp_path: Path, mergekit: Mergekit) -> None:
    """0.1.5's fallback for a covariance that is not positive definite raises (``len`` of an int); resumerge draws
    N(0, 0.02²) rows."""
    model, donor = make_pair(tmp_path / "wide", model_hidden=512, donor_hidden=64)
    ran = mergekit.run(model, donor, tmp_path / "theirs", "-a", "john_hewitt", script="tokensurgeon")
    assert ran.returncode != 0 and "len()" in ran.stderr, ran.stderr
    api.tokensurgeon(str(model), str(donor), tmp_path / "ours", surgery=Surgery(approximation_method="john_hewitt"),
                     settings=api.Settings(state_dir=tmp_path / "state"))
    embed = output_tensors(tmp_path / "ours")["model.embed_tokens.weight"]
    mine = json.loads((donor / "tokenizer.json").read_text())["model"]["vocab"]
    theirs = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    new = torch.tensor([i for t, i in mine.items() if t not in theirs and not t.startswith("<")])
    assert 0.01 < embed[new].float().std().item() < 0.04


def test_omp_selects_and_solves_as_mergekit() -> None:
    """The pursuit on random matrices: the same atoms, coefficients to float32 rounding; with repeated atoms (the
    first on ties, a picked one never again) and targets that are atoms (their residual gone after one step, later
    picks decided by rounding alone)."""
    from mergekit.tokensurgeon import batch_omp as theirs

    from resumerge.runs.transplant.omp import batch_omp

    g = torch.Generator().manual_seed(0)
    targets, atoms = torch.randn(40, 32, generator=g), torch.randn(300, 32, generator=g)
    atoms[150:160] = atoms[10:20]
    targets[:5] = atoms[[3, 12, 155, 7, 299]]
    for k in (1, 8, 24):
        i, c = batch_omp(targets, atoms, k)
        j, d = theirs(targets, atoms, k)
        assert torch.equal(i, j)
        torch.testing.assert_close(c, d, atol=1e-6, rtol=1e-5)


def test_landmark_pca_rotation_fits_better_than_mergekits() -> None:
    """landmark_pca's own definition: the rotation carrying DONOR's landmarks onto MODEL's. A pure rotation is
    recovered exactly (both agree there); for landmarks that are not one, resumerge's map fits them better than
    0.1.5's transposed rotation."""
    from mergekit.tokensurgeon import landmark_pca_approximate as theirs

    from resumerge.runs.transplant.approximate import landmark_pca

    g = torch.Generator().manual_seed(3)
    model_points = torch.randn(200, 16, generator=g)
    rotation = torch.linalg.qr(torch.randn(16, 16, generator=g)).Q
    donor_points = model_points @ rotation
    torch.testing.assert_close(landmark_pca(donor_points[:10], donor_points, model_points), model_points[:10],
                               atol=1e-4, rtol=0)
    mixed = model_points @ (rotation + 0.6 * torch.randn(16, 16, generator=g))
    ours = (landmark_pca(mixed, mixed, model_points) - model_points).norm()
    torch.manual_seed(0)
    mergekits = (theirs(mixed, mixed, model_points) - model_points).norm()
    assert ours < 0.9 * mergekits, (ours, mergekits)

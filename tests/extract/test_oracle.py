"""Differential tests against mergekit-extract-lora 0.1.5 (the oracle) on tiny generated models: the same files,
tensor names, shapes, dtypes and adapter_config fields; with ``--exact`` the same factors up to each SVD
component's sign (B·A equal); tensors saved whole and bias deltas bit-identical."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from mergekit_oracle import Mergekit
from safetensors.torch import load_file

from resumerge import api
from resumerge.api.flagmap import grouped

# name -> (pair, mergekit-extract-lora options)
CASES: dict[str, tuple[str, list[str]]] = {
    # --sv-epsilon between the planted deltas' singular values and the noise's: ranks 2..5 by module.
    "llama-epsilon": ("llama", ["--max-rank", "5", "--sv-epsilon", "0.1"]),
    # A tied bf16 qwen2 (q/k/v biases): embeddings and tied head as LoRA, k_proj excluded, o_proj saved whole,
    # the singular values all on A, norms left out (mergekit 0.1.5 fails with --save-module unless nothing else
    # joins modules_to_save: it appends to click's tuple).
    "qwen2-embed": ("qwen2-tied-bf16", ["--max-rank", "4", "--embed-lora", "-e", "k_proj", "--no-distribute-scale",
                                        "--save-module", "o_proj", "--skip-undecomposable"]),
}

pytestmark = pytest.mark.skipif(shutil.which("mergekit-extract-lora") is None, reason="mergekit is not installed")


@pytest.fixture(scope="session")
def oracle(tmp_path_factory: pytest.TempPathFactory, pair: Callable[[str], tuple[Path, Path]],
           mergekit: Mergekit) -> Callable[[str], Path]:
    """``oracle(case)`` -> mergekit-extract-lora's output folder for ``CASES[case]``, run once per session by the
    worker's mergekit process (tests/mergekit_oracle.py: its imports, torch, transformers and mergekit, are most of
    a run's time on these tiny models, and are already paid there)."""
    root = tmp_path_factory.mktemp("mergekit-extract")
    done: dict[str, Path] = {}

    def run(case: str) -> Path:
        if case not in done:
            name, options = CASES[case]
            base, ft = pair(name)
            ran = mergekit.run("--model", ft, "--base-model", base, "--out-path", root / case, *options,
                               script="extract_lora")
            assert ran.returncode == 0, ran.stderr
            done[case] = root / case
        return done[case]

    return run


def _ours(case: str, pair: Callable[[str], tuple[Path, Path]], out: Path, **extra: object) -> Path:
    base, ft = pair(CASES[case][0])
    args = CASES[case][1]
    kwargs: dict[str, object] = {"max_rank": int(args[args.index("--max-rank") + 1])}
    if "--sv-epsilon" in args:
        kwargs["sv_epsilon"] = float(args[args.index("--sv-epsilon") + 1])
    if "--embed-lora" in args:
        kwargs["embed_lora"] = True
    if "--no-distribute-scale" in args:
        kwargs["distribute_scale"] = False
    if "-e" in args:
        kwargs["exclude_regexes"] = [args[args.index("-e") + 1]]
    if "--skip-undecomposable" in args:
        kwargs["skip_undecomposable"] = True
    if "--save-module" in args:
        kwargs["save_modules"] = [args[args.index("--save-module") + 1]]
    kwargs.update(extra)
    api.extract_lora(str(ft), str(base), out, **grouped(api.extract_lora, kwargs))
    return out


def _factor_pairs(tensors: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    return [(a, a.replace("_A", "_B")) for a in sorted(tensors) if "lora_A" in a or "lora_embedding_A" in a]


@pytest.fixture(scope="module")
def ours_exact(tmp_path_factory: pytest.TempPathFactory,
               pair: Callable[[str], tuple[Path, Path]]) -> Callable[[str], Path]:
    """``ours_exact(case)`` -> our ``--exact`` extraction of ``CASES[case]`` (run once per module)."""
    root = tmp_path_factory.mktemp("ours-exact")
    done: dict[str, Path] = {}

    def run(case: str) -> Path:
        if case not in done:
            done[case] = _ours(case, pair, root / case, exact=True)
        return done[case]

    return run


@pytest.mark.parametrize("case", sorted(CASES))
def test_exact_matches_mergekit(case: str, oracle: Callable[[str], Path],
                                ours_exact: Callable[[str], Path]) -> None:
    theirs = oracle(case)
    ours = ours_exact(case)
    expected_files = {p.name for p in theirs.iterdir()}
    assert expected_files == {"README.md", "adapter_config.json", "adapter_model.safetensors"}
    assert expected_files <= {p.name for p in ours.iterdir()}
    mine, ref = load_file(ours / "adapter_model.safetensors"), load_file(theirs / "adapter_model.safetensors")
    assert sorted(mine) == sorted(ref)
    for name in ref:
        assert (mine[name].shape, mine[name].dtype) == (ref[name].shape, ref[name].dtype), name
    factors = {n for p in _factor_pairs(ref) for n in p}
    assert factors, "the case extracts no LoRA module"
    for name in sorted(set(ref) - factors):  # saved whole, bias deltas: the same bits
        assert torch.equal(mine[name], ref[name]), name
    half = ref[next(iter(factors))].dtype != torch.float32
    for a, b in _factor_pairs(ref):
        product, expected = mine[b].float() @ mine[a].float(), ref[b].float() @ ref[a].float()
        scale = expected.abs().max().item()
        assert (product - expected).abs().max().item() <= (2e-2 if half else 1e-5) * scale, a
        # Each component equal up to its sign.
        signs = torch.sign((mine[a].float() * ref[a].float()).sum(dim=1, keepdim=True))
        assert torch.allclose(mine[a].float(), signs * ref[a].float(), atol=(2e-2 if half else 1e-4) * scale), a
    mine_cfg = json.loads((ours / "adapter_config.json").read_text())
    ref_cfg = json.loads((theirs / "adapter_config.json").read_text())
    assert mine_cfg.keys() == ref_cfg.keys()
    for key in ("target_modules", "modules_to_save"):
        assert sorted(mine_cfg.pop(key)) == sorted(ref_cfg.pop(key)), key
    assert mine_cfg == ref_cfg


def test_epsilon_lowers_ranks_like_mergekit(oracle: Callable[[str], Path]) -> None:
    """The --sv-epsilon case does exercise rank_pattern (else the comparison above proves little)."""
    cfg = json.loads((oracle("llama-epsilon") / "adapter_config.json").read_text())
    assert cfg["rank_pattern"] and cfg["rank_pattern"] == cfg["alpha_pattern"]


def test_card_names_the_base(pair: Callable[[str], tuple[Path, Path]], ours_exact: Callable[[str], Path]) -> None:
    base, _ = pair("llama")
    out = ours_exact("llama-epsilon")  # the comparison's own output: any extraction's card names its base
    text = (out / "README.md").read_text()
    meta = yaml.safe_load(text.split("---")[1])
    assert meta["base_model"] == [str(base)] and meta["library_name"] == "peft"
    assert "resumerge extract-lora --model" in text

"""Genotype → merge config: mergekit 0.1.5's own ``ModelGenome.genotype_merge_config`` is the oracle for its
methods (linear, task_arithmetic, ties, dare_ties, slerp) with every granularity, filters, smooth, normalize and
negative weights, on the first genotype and on random ones; resumerge's numeric methods (della, breadcrumbs, tsv,
iso_c) get configs ``run`` plans, their numbers held to the bounds each method declares; ``random_init`` starts a
search from a seeded random genotype.

Tiny generated models (four layers, width 32): headers only, nothing merged."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.errors import ConfigError
from resumerge.runs.evolve.genome import initial_genotype, layout_of, merge_config
from resumerge.runs.evolve.spec import Genome

SPEC = ModelSpec(layers=4, hidden=32, intermediate=48, vocab=64)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    root = tmp_path_factory.mktemp("models")
    # type: ignore[return-value]
    return tuple(str(make_model(root / name, SPEC, seed=i)) for i, name in enumerate(("base", "a", "b")))


CASES = [(method, granularity, filters, smooth, normalize, negative)
         for method, granularity, filters, smooth, normalize, negative in itertools.product(
             ("linear", "task_arithmetic", "ties", "dare_ties", "slerp"), (0, 1, 2), ((), ("mlp", "self_attn")),
             (False, True), (None, False), (False, True))
         if method != "slerp" or not (smooth or filters)]


@pytest.mark.parametrize("method", ["linear", "task_arithmetic", "ties", "dare_ties", "slerp"])
def test_each_genotype_becomes_the_config_mergekit_evolve_builds(models: tuple[str, str, str], method: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from mergekit.config import MergeConfiguration
        from mergekit.evo.genome import ModelGenome, ModelGenomeDefinition
    base, a, b = models
    checked = 0
    for _, granularity, filters, smooth, normalize, negative in [c for c in CASES if c[0] == method]:
        with_base = base if method in ("ties", "dare_ties", "task_arithmetic") else None
        oracle = ModelGenome(ModelGenomeDefinition(
            models=[a, b], merge_method=method, base_model=with_base, layer_granularity=granularity,
            filters=list(filters) or None, smooth=smooth, normalize=normalize, allow_negative_weights=negative))
        genome = Genome((a, b), method, with_base, granularity, filters, smooth, normalize, negative)
        layout = layout_of(genome, 4)
        draws = np.random.default_rng(granularity)
        for genotype in (np.array(initial_genotype(layout)), *(draws.normal(size=layout.size) for _ in range(3))):
            theirs = oracle.genotype_merge_config(genotype)
            ours = merge_config(genome, layout, 4, [float(v) for v in genotype])
            assert MergeConfiguration.model_validate(ours) == theirs, (granularity, filters, smooth, yaml.dump(ours))
            checked += 1
    assert checked >= 16


@pytest.mark.parametrize("method", ["della", "breadcrumbs", "tsv", "iso_c"])
def test_resumerges_numeric_methods_get_configs_run_plans(models: tuple[str, str, str], method: str) -> None:
    base, a, b = models
    genome = Genome((a, b), method, base, 2, ("mlp",))
    layout = layout_of(genome, 4)
    first = initial_genotype(layout)
    assert len(first) == layout.size and layout.groups == 2 and layout.sets == 2
    wild = [(-1) ** i * 3.0 for i in range(layout.size)]  # negative and past every bound
    for genotype in (first, wild):
        config = merge_config(genome, layout, 4, genotype)
        api.plan_merge(yaml.safe_dump(config, sort_keys=False))  # run plans it: every number within its bounds
    config = merge_config(genome, layout, 4, wild)
    if layout.per_model:
        params = config["slices"][0]["sources"][0]["parameters"]
        assert params["weight"][0]["value"] == 3.0 and params["density"][0]["value"] == 1.0
        assert config["slices"][0]["sources"][1]["parameters"]["weight"][1]["value"] == 3.0  # abs()
    else:
        assert set(config["slices"][0]["parameters"]) == {"scaling"}
    assert config["slices"][1]["sources"][0]["layer_range"] == [2, 4]


def test_a_method_without_numbers_or_a_base_it_needs_is_refused(models: tuple[str, str, str]) -> None:
    base, a, b = models
    with pytest.raises(ConfigError, match="no numeric parameter"):
        layout_of(Genome((a, b), "arcee_fusion", base), 4)
    with pytest.raises(ConfigError, match="needs a base_model"):
        layout_of(Genome((a, b), "ties"), 4)
    with pytest.raises(ConfigError, match="not a multiple of 3"):
        layout_of(Genome((a, b), "linear", granularity=3), 4)


def test_the_first_genotype_is_mergekits(models: tuple[str, str, str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from mergekit.evo.genome import ModelGenome, ModelGenomeDefinition
    base, a, b = models
    for method in ("slerp", "ties"):
        oracle = ModelGenome(ModelGenomeDefinition(models=[a, b], merge_method=method, base_model=base,
                                                   layer_granularity=2, filters=None if method == "slerp" else ["mlp"]))
        layout = layout_of(Genome((a, b), method, base, 2, () if method == "slerp" else ("mlp",)), 4)
        assert initial_genotype(layout) == oracle.initial_genotype().flatten().tolist()
    della = layout_of(Genome((a, b), "della", base), 4)
    assert della.per_model == ("weight", "density", "epsilon") and initial_genotype(della)[:3] == [0.5, 1.0, 0.15]


def test_random_init_starts_from_a_seeded_random_genotype_else_from_mergekits(models: tuple[str, str, str],
                                                                              tmp_path: Path) -> None:
    from resumerge.runs.evolve.search import SearchOptions, plan_search
    from resumerge.runs.evolve.spec import read_spec

    base, a, b = models
    (tmp_path / "t.txt").write_text("some words\n")
    doc = {"genome": {"models": [a, b], "merge_method": "ties", "base_model": base, "layer_granularity": 2},
           "tasks": [{"nll": {"texts": str(tmp_path / "t.txt")}}]}
    plain = plan_search(read_spec(yaml.safe_dump(doc)), 4, SearchOptions(random_seed=3)).settings.x0
    assert list(plain) == [0.5, 1.0] * 4
    drawn = [plan_search(read_spec(yaml.safe_dump({**doc, "random_init": True})), 4, SearchOptions(random_seed=seed))
             .settings.x0 for seed in (3, 3, 4)]
    assert drawn[0] == drawn[1] != drawn[2] and len(drawn[0]) == 8 and all(0 <= v < 1 for v in drawn[0])
    assert len(set(drawn[0])) == 8
    with pytest.raises(ConfigError, match="random_init"):
        read_spec(yaml.safe_dump({**doc, "random_init": "yes"}))

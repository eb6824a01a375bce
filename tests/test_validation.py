"""Bad input: one clear line naming the YAML path, exit code 2, no traceback, nothing written to OUT."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import ModelFactory
from support import write_config

from resumerge.cli.commands import main
from resumerge.config.yamltext import anchor_holders


def _run(tmp_path: Path, doc: dict[str, Any] | str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    cfg = tmp_path / "bad.yml"
    if isinstance(doc, str):
        cfg.write_text(doc)
    else:
        write_config(cfg, doc)
    code = main(["run", str(cfg), str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert not (tmp_path / "out").exists(), "nothing may be written for invalid input"
    return code, err


def _two(make: ModelFactory, **spec: Any) -> tuple[str, str]:
    return str(make("a", seed=1, **spec)), str(make("b", seed=2, **spec))


CASES: list[tuple[str, Any, str]] = [
    ("unknown top-level key", lambda a, b: {"merge_method": "linear", "modles": [a], "models": [a]}, "modles"),
    ("unknown method", lambda a, b: {"merge_method": "dare-ties", "models": [{"model": a}]}, "merge_method"),
    ("missing weight", lambda a, b: {"merge_method": "linear", "models": [{"model": a}, {"model": b}]},
     "models[0].parameters.weight"),
    ("unknown parameter", lambda a, b: {"merge_method": "linear", "models": [
        {"model": a, "parameters": {"wieght": 1}}]}, "models[0].parameters.wieght"),
    ("layer range past end", lambda a, b: {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": a, "layer_range": [0, 9]}]}]}, "slices[0].sources[0].layer_range"),
    ("layer range malformed", lambda a, b: {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": a, "layer_range": [3, 1]}]}]}, "slices[0].sources[0].layer_range"),
    ("slice length mismatch", lambda a, b: {"merge_method": "linear", "parameters": {"weight": 1}, "slices": [
        {"sources": [{"model": a, "layer_range": [0, 4]}, {"model": b, "layer_range": [0, 3]}]}]},
     "slices[0].sources"),
    ("missing model", lambda a, b: {"merge_method": "linear", "models": [
        {"model": a + "-nope", "parameters": {"weight": 1}}]}, "models[0].model"),
    ("bad dtype", lambda a, b: {"merge_method": "linear", "dtype": "float8", "models": [a]}, "dtype"),
    ("two @ in reference", lambda a, b: {"merge_method": "linear", "models": [a + "@x@y"]}, "models[0].model"),
    ("both model forms", lambda a, b: {"merge_method": "linear", "models": [a], "slices": []}, "slices"),
    ("passthrough with two sources", lambda a, b: {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": a, "layer_range": [0, 2]}, {"model": b, "layer_range": [0, 2]}]}]},
     "slices[0].sources"),
    ("weight not a number", lambda a, b: {"merge_method": "linear", "models": [
        {"model": a, "parameters": {"weight": "heavy"}}]}, "models[0].parameters.weight"),
    ("conditional without value", lambda a, b: {"merge_method": "linear", "models": [
        {"model": a, "parameters": {"weight": [{"filter": "mlp"}]}}]}, "models[0].parameters.weight"),
]


@pytest.mark.parametrize(("label", "build", "yaml_path"), CASES, ids=[c[0] for c in CASES])
def test_invalid_config_exit_2_one_line(tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str],
                                        label: str, build: Any, yaml_path: str) -> None:
    a, b = _two(make)
    code, err = _run(tmp_path, build(a, b), capsys)
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert yaml_path in lines[0], lines[0]


def test_yaml_object_tags_are_refused_not_executed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "pwned"
    doc = f"merge_method: !!python/object/apply:os.system ['touch {marker}']\nmodels: [x]\n"
    code, err = _run(tmp_path, doc, capsys)
    assert code == 2 and "not valid YAML" in err
    assert not marker.exists()


def test_syntax_error_names_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(tmp_path, "merge_method: linear\nmodels: [a\n", capsys)
    assert code == 2 and "line" in err


def test_run_and_plan_word_invalid_yaml_alike(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(tmp_path, "merge_method: linear\nmodels: [a\n", capsys)
    assert code == 2 and err.startswith("error: bad.yml is not valid YAML at line 3"), err
    assert main(["plan", str(tmp_path / "bad.yml")]) == 2
    assert capsys.readouterr().err == err


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path: Path, make: ModelFactory,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _two(make)
    doc = f"merge_method: linear\nmerge_method: slerp\nmodels:\n  - model: {a}\n  - model: {b}\n"
    code, err = _run(tmp_path, doc, capsys)
    assert code == 2 and "bad.yml: merge_method is given twice, at lines 1 and 2" in err, err
    # A key brought in by a YAML merge key may be overridden: that is what << is for.
    ok = (f"w: &w {{weight: 0.5}}\nmerge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{<<: *w, "
          f"weight: 0.25}}\n  - model: {b}\n    parameters: *w\n")
    (tmp_path / "ok.yml").write_text(ok)
    code = main(["run", str(tmp_path / "ok.yml"), str(tmp_path / "ok"), "--state-dir", str(tmp_path / "state")])
    err = capsys.readouterr().err
    assert code == 0 and "given twice" not in err and "w: ignored" in err, err  # w holds the anchor: ignored


def test_a_utf16_config_reads_like_its_utf8_copy(tmp_path: Path, make: ModelFactory,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _two(make)
    text = (f"merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: 0.5}}\n"
            f"  - model: {b}\n    parameters: {{weight: 0.5}}\n")
    (tmp_path / "utf8.yml").write_text(text, encoding="utf-8")
    (tmp_path / "utf16.yml").write_text(text, encoding="utf-16")  # with its byte-order mark, as editors write it
    assert main(["run", str(tmp_path / "utf8.yml"), str(tmp_path / "o8"), "--quiet"]) == 0
    assert main(["run", str(tmp_path / "utf16.yml"), str(tmp_path / "o16"), "--quiet"]) == 0
    shard = "model.safetensors"
    assert (tmp_path / "o8" / shard).read_bytes() == (tmp_path / "o16" / shard).read_bytes()
    (tmp_path / "latin1.yml").write_bytes(text.replace("merge_method", "# café\nmerge_method").encode("latin-1"))
    assert main(["run", str(tmp_path / "latin1.yml"), str(tmp_path / "o1"), "--quiet"]) == 2
    assert "is not UTF-8 text (byte 0xe9 at offset 5) — save it as UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize(("a_shape", "b_shape", "said"), [
    ({"layers": 4}, {"layers": 3}, ("different layer counts", "slices")),
    # Vocabularies: the command that transplants a tokenizer is named.
    ({"vocab": 64}, {"vocab": 66}, ("embed_tokens", "vocabularies differ", "resumerge tokensurgeon MODEL DONOR OUT")),
], ids=["layer counts", "vocabularies"])
def test_models_of_other_shapes_are_refused_in_models_form_before_work(
        tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str], a_shape: dict[str, int],
        b_shape: dict[str, int], said: tuple[str, ...]) -> None:
    a, b = make("a", **a_shape), make("b", **b_shape)
    doc = {"merge_method": "linear", "parameters": {"weight": 1}, "models": [str(a), str(b)]}
    code, err = _run(tmp_path, doc, capsys)
    assert code == 2 and all(fragment in err for fragment in said), err


@pytest.mark.parametrize(("name", "said"), [
    ("pytorch_model.bin", "not a readable zip-format PyTorch checkpoint"),  # a .bin that is not a zip checkpoint
    ("model.pt", "pickle weights resumerge does not recognise"),  # other pickles
])
def test_pickled_weights_that_are_not_a_zip_checkpoint_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   name: str, said: str) -> None:
    model = tmp_path / "pickled"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 1}')
    (model / name).write_bytes(b"\x80\x04not really")
    code, err = _run(tmp_path, {"merge_method": "passthrough", "models": [str(model)]}, capsys)
    assert code == 2 and said in err, err


def test_index_escaping_model_dir_is_refused(tmp_path: Path, make: ModelFactory,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    a = make("a")
    index = a / "model.safetensors.index.json"
    doc = index.read_text().replace("model-00001-of", "../../etc/model-00001-of")
    index.write_text(doc)
    code, err = _run(tmp_path, {"merge_method": "passthrough", "models": [str(a)]}, capsys)
    assert code == 2 and "escapes the model directory" in err


def test_missing_config_file_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tmp_path / "nope.yml"), str(tmp_path / "out")]) == 2
    assert "not found" in capsys.readouterr().err


def test_bad_shard_size_is_exit_2(tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "models": [str(make("a"))]})
    assert main(["run", str(cfg), str(tmp_path / "out"), "--out-shard-size", "lots"]) == 2
    assert "--out-shard-size" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["dtype", "out_dtype"])
@pytest.mark.parametrize("dtype", ["int64", "torch.int64", "int32", "int8", "uint8", "bool"])
def test_integer_dtypes_are_refused_listing_the_float_ones(
        tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str], key: str, dtype: str) -> None:
    """mergekit takes int64, which cuts every weight to an integer (a model of noise): refused before anything is
    written, in one line that lists the float dtypes only."""
    a, b = _two(make)
    code, err = _run(tmp_path, {"merge_method": "linear", key: dtype, "models": [
        {"model": a, "parameters": {"weight": 1}}, {"model": b, "parameters": {"weight": 1}}]}, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {key}: '") and "is not a float type" in lines[0], lines[0]
    assert lines[0].endswith("use one of bfloat16, float16, float32, float64"), lines[0]


def test_a_models_config_json_as_config_is_said_for_what_it_is(
        tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(tmp_path, (make("a") / "config.json").read_text(), capsys)
    assert code == 2 and "looks like a model's config.json" in err and "'architectures'" in err, err
    assert "unknown key" not in err


@pytest.mark.parametrize(("build", "fragment"), [
    (lambda a: {"merge_method": "linear", "model_name": "mine", "models": [{"model": a, "parameters": {"weight": 1}}]},
     "model_name: unknown key 'model_name'"),
    (lambda a: {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": a, "layer_range": [0, 2], "density": 1}]}]}, "unknown key 'density'"),
    (lambda a: {"merge_method": "passthrough", "models": [{"model": a, "weight": 1}]}, "unknown key 'weight'"),
], ids=["top-level", "source", "model"])
def test_unknown_keys_are_refused_saying_mergekit_would_ignore_them(
        tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str], build: Any, fragment: str) -> None:
    """A public template with model_name: runs in mergekit, which ignores unknown keys: say so, and keep refusing."""
    code, err = _run(tmp_path, build(str(make("a"))), capsys)
    assert code == 2 and fragment in err, err
    assert "mergekit would ignore it, so removing it changes nothing" in err


@pytest.mark.parametrize(("build", "fragment"), [
    (lambda a: {"merge_methd": "linear", "models": [{"model": a, "parameters": {"weight": 1}}]},
     "merge_methd: unknown key 'merge_methd': mergekit would ignore it — did you mean 'merge_method'?"),
    (lambda a: {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": a, "layer_rnage": [0, 2]}]}]}, "did you mean 'layer_range'?"),
    (lambda a: {"merge_method": "linear", "models": [{"model": a, "paramters": {"weight": 1}}]},
     "did you mean 'parameters'?"),
    (lambda a: {"base_model": a, "gate_mod": "random", "experts": [{"source_model": a}, {"source_model": a}]},
     "gate_mod: unknown key 'gate_mod' — did you mean 'gate_mode'?"),
    (lambda a: {"base_model": a, "gate_mode": "random", "experts": [{"source_model": a},
                                                                 {"source_model": a, "noise_scal": 0.1}]},
     "experts[1].noise_scal: unknown key 'noise_scal' — did you mean 'noise_scale'?"),
    (lambda a: {"base_model": a, "gate_mode": "random", "expert": [{"source_model": a}]},
     "expert: unknown key 'expert': mergekit would ignore it — did you mean 'experts'?"),
], ids=["merge_method", "layer_range", "parameters", "moe gate_mode", "moe expert key", "moe experts"])
def test_a_misspelt_key_the_config_lacks_is_named(
        tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str], build: Any, fragment: str) -> None:
    """merge_methd: was "unknown key: mergekit would ignore it, so removing it changes nothing" with the list of
    every top-level key: the config then has no merge_method, so removing it does not give what was meant."""
    code, err = _run(tmp_path, build(str(make("a"))), capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and fragment in lines[0], err
    assert "removing it changes nothing" not in err


ANCHORED = """\
x-common: &common
  weight: 0.5
  density: 0.5
merge_method: ties
base_model: {base}
dtype: float32
models:
  - model: {base}
  - model: {a}
    parameters: *common
  - model: {b}
    parameters:
      <<: *common
      weight: 0.3
"""


def test_a_top_level_key_holding_anchors_is_ignored_as_mergekit_ignores_it(
        tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str]) -> None:
    """mergekit-yaml runs a config keeping its anchors under x-common: (pydantic ignores unknown keys); so does
    resumerge, with a note, and merges what the config says once its aliases are read."""
    base, a, b = (str(make(n, seed=i)) for i, n in enumerate(("base", "a", "b")))
    config = tmp_path / "anchored.yml"
    config.write_text(ANCHORED.format(base=base, a=a, b=b))
    assert main(["run", str(config), str(tmp_path / "out"), "--state-dir", str(tmp_path / "state")]) == 0
    assert "x-common: ignored, as mergekit ignores it (it holds YAML anchors the config uses)" in \
        capsys.readouterr().err
    expanded = {"merge_method": "ties", "base_model": base, "dtype": "float32", "models": [
        {"model": base}, {"model": a, "parameters": {"weight": 0.5, "density": 0.5}},
        {"model": b, "parameters": {"weight": 0.3, "density": 0.5}}]}
    write_config(tmp_path / "expanded.yml", expanded)
    assert main(["run", str(tmp_path / "expanded.yml"), str(tmp_path / "plain"), "--state-dir",
                 str(tmp_path / "state-plain"), "--quiet"]) == 0
    merged = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert merged == (tmp_path / "plain" / "model.safetensors").read_bytes()


@pytest.mark.parametrize(("text", "fragment", "claim"), [
    # An anchor no alias uses, or a key that only uses one: removing it changes nothing, as the refusal says.
    ("x-unused: &u {{weight: 1}}\nmerge_method: linear\nmodels: [{{model: {a}, parameters: {{weight: 1}}}}]\n",
     "x-unused: unknown key 'x-unused'", True),
    ("merge_method: linear\nmodels: [{{model: {a}, parameters: &p {{weight: 1}}}}]\nx-uses: *p\n",
     "x-uses: unknown key 'x-uses'", True),
    # A nested unknown key holding an anchor another entry uses: mergekit ignores it, but removing it would break
    # the config, so the refusal says so instead.
    ("merge_method: linear\nmodels:\n  - {{model: {a}, x-w: &w {{weight: 1}}, parameters: {{weight: 1}}}}\n"
     "  - {{model: {a}, parameters: *w}}\n", "models[0].x-w: unknown key 'x-w'", False),
], ids=["unused anchor", "alias only", "nested holder"])
def test_removing_it_changes_nothing_is_said_only_when_true(
        tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str], text: str, fragment: str,
        claim: bool) -> None:
    code, err = _run(tmp_path, text.format(a=str(make("a"))), capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and fragment in lines[0], err
    assert ("removing it changes nothing" in lines[0]) == claim, lines[0]
    assert claim or "it holds a YAML anchor the config uses elsewhere" in lines[0], lines[0]


def test_anchor_holders_are_the_keys_whose_anchor_an_alias_outside_them_uses() -> None:
    text = """\
x-common: &common
  weight: 0.5
  density: &d 0.3
x-unused: &u {a: 1}
x-self: {a: &s 1, b: *s}
x-uses: *common
merge_method: ties
models:
  - {model: a, parameters: *common}
  - {model: b, x-p: &p {weight: 1}, parameters: {density: *d}}
  - {model: c, parameters: *p}
  - model: d
    parameters:
      <<: *common
"""
    assert anchor_holders(text) == {"x-common", "x-common.density", "x-self.a", "models[1].x-p"}
    assert anchor_holders("merge_method: linear\n") == frozenset()
    assert anchor_holders("a: [unclosed\n") == frozenset()


def test_a_missing_local_model_is_no_such_directory(
        tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "models" / "nope")
    code, err = _run(tmp_path, {"merge_method": "linear", "models": [{"model": missing, "parameters": {"weight": 1}}]},
                     capsys)
    assert code == 2 and f"models[0].model: no such directory: {missing!r}" in err, err
    assert "Repo id must" not in err


def test_a_typo_of_a_local_folder_is_said_before_the_hub(
        tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``models/smol-noisey`` beside ``models/smol-noisy`` is a typo, not a hub repo (it was "not in the hub cache …
    offline mode is on", online "cannot reach huggingface.co"): said with the near miss, before the hub is asked;
    a reference whose parent is a local folder but no name there is close says that no such folder exists first."""
    models = tmp_path / "models"
    models.mkdir()
    make("a", seed=1).rename(models / "smol-noisy")
    monkeypatch.chdir(tmp_path)  # the models named relative to where the command runs, as the issue's were
    for given, said in [("models/smol-noisey", "no local folder 'models/smol-noisey' exists"),
                        ("./models/smol-noisey", "no such directory: './models/smol-noisey'")]:
        doc = {"merge_method": "linear", "models": [{"model": given, "parameters": {"weight": 1}}]}
        code, err = _run(tmp_path, doc, capsys)
        assert code == 2 and said in err and "hub" not in err, err
        assert err.strip().endswith(f"did you mean {given.replace('noisey', 'noisy')!r}?") and err.count("\n") == 1
    code, err = _run(tmp_path, {"merge_method": "linear", "models": [{"model": "models/elsewhere",
                                                                      "parameters": {"weight": 1}}]}, capsys)
    assert code == 2 and err.startswith("error: models[0].model: no local folder 'models/elsewhere' exists, "), err


def test_an_unknown_merge_method_gets_a_did_you_mean(tmp_path: Path, make: ModelFactory,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _two(make)
    code, err = _run(tmp_path, {"merge_method": "slurp", "models": [{"model": a}, {"model": b}]}, capsys)
    assert code == 2 and "Unimplemented merge method 'slurp' — did you mean 'slerp'?" in err, err


def test_an_unknown_merge_method_is_refused_before_any_model_is_opened(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: the models were opened first, so a missing one (or a hub id, asked of the hub) was said instead.
    for model in (str(tmp_path / "models" / "nope"), "no-such-org/no-such-model"):
        code, err = _run(tmp_path, {"merge_method": "nonsense", "models": [{"model": model}]}, capsys)
        assert code == 2 and "merge_method: Unimplemented merge method 'nonsense'" in err, err
        assert "no such directory" not in err and "hub" not in err and err.count("\n") == 1, err


@pytest.mark.parametrize("unit", ["moe_expert", "moe_router_random", "lora_extract_a", "lora_extract_delta"])
def test_a_config_cannot_name_an_internal_unit_as_its_method(
    tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str], unit: str
) -> None:
    """MoE upcycling and LoRA extraction declare their tensor functions in their own packages and hand them to the
    engine through their plans; a merge config naming one is an unknown method, as in mergekit, even in a process
    that ran those kinds, and they are not listed."""
    import resumerge.runs.extract.factors
    import resumerge.runs.moe.experts
    import resumerge.runs.moe.routers  # noqa: F401  (as a run of those kinds would have imported them)

    a, b = _two(make)
    code, err = _run(tmp_path, {"merge_method": unit, "models": [{"model": a}, {"model": b}]}, capsys)
    assert code == 2 and "merge_method" in err and f"Unimplemented merge method '{unit}'" in err, err
    known = err.split("known methods:")[1]
    assert "linear" in known and "moe_" not in known and "lora_extract" not in known, err


def test_a_folder_given_as_config_is_said_to_be_one(tmp_path: Path, make: ModelFactory,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A model's folder given as CONFIG said "cannot read config file …: [Errno 21] Is a directory: '…'"."""
    model = make("a")
    code = main(["run", str(model), str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert f"config file {model} is a directory, not a YAML file" in lines[0] and "Errno" not in err, err
    assert not (tmp_path / "out").exists()

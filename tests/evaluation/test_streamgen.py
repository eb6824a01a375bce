"""Generation one decoder layer at a time (:mod:`resumerge.analyses.evaluation.streamgen`): on a tiny generated Llama
judged not to fit whole (``streamedeval``: its whole would fit any budget its layers do), greedy answers equal lm-eval's
``hf`` model's, stop sequences and ``max_gen_toks`` included; the same answers held whole, streamed with the KV cache in
RAM and spilled to the pass's folder, and on a merge config never written as on the written merge; sampled answers the
same on every run; a generation killed (SIGKILL) after a token step, or inside one with its cache spilled, resumes at
its step to the same answers. A sliding-window family (a tiny Gemma 3, a Mistral, windows shorter than their contexts)
streams to lm-eval's ``hf`` model's greedy answers, held or spilled. In this process, or a CLI process each: a few
seconds to a minute on a quiet machine (lm-eval's and torch's imports)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lm_eval")

from support import write_config

from resumerge import api
from resumerge.analyses.evaluation.kvcache import SPILL_NAME
from resumerge.analyses.evaluation.streamgen import GENERATED, STEP_PREFIX
from resumerge.cli.modelgen import write_tokenizer
from resumerge.forward.engine.stream import ModelStream
from tests.evaluation.evaltasks import CHAT, GEN, SPEC, hf_results, tiny_model, write_tasks
from tests.evaluation.streamedeval import streamed
from tests.support import cli, cli_here

STREAMED = Path(__file__).with_name("streamedeval.py")


def _task(tasks: Path, name: str, kwargs: str) -> str:
    """A generation task ``name`` over tiny_gen's data with the generation kwargs ``kwargs`` (YAML)."""
    text = (tasks / "tiny_gen.yaml").read_text()
    test = text.split("test: ", 1)[1].split("}")[0]
    body = GEN.format(test=test).replace("task: tiny_gen", f"task: {name}")
    (tasks / f"{name}.yaml").write_text(body.replace('{until: ["\\n"], max_gen_toks: 8}', kwargs))
    return name


def _answers(results: dict[str, Any], task: str) -> list[Any]:
    return [s["resps"] for s in results["samples"][task]]


def _resumed(args: list[Any], monkeypatch: pytest.MonkeyPatch) -> subprocess.CompletedProcess[str]:
    """The command ``STREAMED`` runs (``args``, ``--spilled`` first or not) through the CLI's ``main`` in this process
    (:func:`~tests.support.cli_here`), streamed as ``STREAMED`` streams it: the resume of a killed generation, which
    needs no process of its own (the kill does); a forked one cost ~4 CPU s, lm-eval's and transformers' imports."""
    from resumerge.analyses.evaluation import run, streamgen

    spilled = args[:1] == ["--spilled"]
    with monkeypatch.context() as patch:
        patch.setattr(run, "_fits", run._fits)  # restored as they were after the block
        patch.setattr(streamgen, "gen_plan", streamgen.gen_plan)
        streamed(spilled)
        return cli_here(*args[1 if spilled else 0:])


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path]:
    return tiny_model(tmp_path / "model"), write_tasks(tmp_path)


@contextlib.contextmanager
def _as_a_test(root: Path, installation_cache: Path) -> Iterator[pytest.MonkeyPatch]:
    """The environment conftest's ``hermetic`` sets for a test, for a module's fixture (made before it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(installation_cache))
        patch.setenv("HF_HOME", str(root / "hf"))
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("RESUMERGE_STATE_DIR", str(root / "home-state"))
        patch.setenv("XDG_STATE_HOME", str(root / "xdg-state"))
        yield patch


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, installation_cache: Path) -> tuple[Any, Any]:
    """The kill tests' reference, made once for both: tiny_gen's streamed generation never killed, its results and
    the answers it kept (spilled or held, the same answers: the test of held, streamed and spilled below). Made in
    this process, streamed as ``STREAMED`` streams a CLI process's (whose results are this process's: the sampled
    kill test below); a CLI process cost ~5 CPU s more, lm-eval's and transformers' imports."""
    from resumerge.analyses.evaluation import run

    root = tmp_path_factory.mktemp("uninterrupted")
    model, tasks = tiny_model(root / "model"), write_tasks(root)
    with _as_a_test(root, installation_cache) as patch:
        patch.setattr(run, "_fits", lambda stream, settings: False)
        said: list[str] = []
        once = _evaluate(model, tasks, ["tiny_gen"], root / "state", said)
    assert said, "generated one layer at a time"
    kept = json.loads(next((root / "state" / "evals").glob(f"*/{GENERATED}")).read_text())
    return once.results["results"], kept


def _evaluate(model: Path, tasks: Path, names: list[str], state: Path, said: list[str] | None = None,
              seed: str | None = None) -> Any:
    def progress(step: Any) -> None:
        if said is not None and step.plan is not None:
            said.append(step.plan)

    return api.evaluate(model, names, api.Settings(state_dir=state),
                        harness=api.Harness(include_path=tasks, log_samples=True, seed=seed), progress=progress)


def test_streamed_greedy_generation_equals_lm_evals_hf_model_stops_and_lengths_too(
        setup: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, tasks = setup
    cut = _task(tasks, "tiny_cut", '{until: ["o", "J"], max_gen_toks: 5}')
    names = ["tiny_gen", cut]
    monkeypatch.setattr("resumerge.analyses.evaluation.run._fits", lambda stream, settings: False)
    rows: list[int] = []
    run = ModelStream.run

    def counted(self: ModelStream, layer: Any, hidden: Any, call: Any, **kwargs: Any) -> Any:
        rows.append(int(hidden.shape[0]))
        return run(self, layer, hidden, call, **kwargs)

    monkeypatch.setattr(ModelStream, "run", counted)
    said: list[str] = []
    ours = _evaluate(model, tasks, names, tmp_path / "state", said)
    monkeypatch.undo()
    # streamed: every generation request of both tasks in one pass, each with its own stops and length
    assert len(said) == 1 and "12 request(s)" in said[0] and "held in RAM" in said[0]
    # the prefill one context at a time (3 layers, 12 contexts), then each step's newest tokens as one batch a
    # layer (the first such step checked against its rows run alone too)
    assert rows[:3 * 12] == [1] * 3 * 12 and rows[3 * 12] == 12 and sum(n > 1 for n in rows) >= 2 * 3
    theirs = hf_results(model, tasks, names)
    for task in names:
        assert ours.results["results"][task] == theirs["results"][task]
        assert _answers(ours.results, task) == _answers(theirs, task)
    whole, short = _answers(ours.results, "tiny_gen"), _answers(ours.results, cut)
    assert any(w[0][0].startswith(s[0][0]) and len(s[0][0]) < len(w[0][0]) for w, s in zip(whole, short))
    assert all(len(s[0][0].split()) <= 5 and "o" not in s[0][0] and "J" not in s[0][0] for s in short)


def test_the_same_answers_held_whole_streamed_and_spilled(setup: tuple[Path, Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from resumerge.analyses.evaluation import run, streamgen

    model, tasks = setup
    long = _task(tasks, "tiny_long", '{until: ["never"], max_gen_toks: 12}')
    found = {}
    for how in ("whole", "streamed", "spilled"):
        said: list[str] = []
        with monkeypatch.context() as patch:
            if how != "whole":
                patch.setattr(run, "_fits", lambda stream, settings: False)
                patch.setattr(streamgen, "gen_plan", streamgen.gen_plan)
                streamed(spilled=how == "spilled")
            found[how] = _evaluate(model, tasks, [long], tmp_path / how, said)
        assert (not said) if how == "whole" else ("spilled" in said[0]) == (how == "spilled")
        if how != "whole":  # the journal gone once the answers are kept
            folder = next((tmp_path / how / "evals").glob(f"*/{GENERATED}")).parent
            assert not list(folder.glob(f"{STEP_PREFIX}*")) and not (folder / SPILL_NAME).exists()
    assert _answers(found["whole"].results, long) == _answers(found["streamed"].results, long) == \
        _answers(found["spilled"].results, long)
    assert all(len(a[0][0].split()) == 12 for a in _answers(found["whole"].results, long))


SAMPLED = '{until: ["never"], max_gen_toks: 6, do_sample: true, temperature: 1.5}'


def test_sampled_answers_are_the_seeds_held_whole_or_streamed(setup: tuple[Path, Path], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from resumerge.analyses.evaluation import run

    model, tasks = setup
    drawn = _task(tasks, "tiny_drawn", SAMPLED)
    (tasks / "tiny_drawn.yaml").write_text((tasks / "tiny_drawn.yaml").read_text() + "repeats: 2\n")
    held_said: list[str] = []
    whole = _evaluate(model, tasks, [drawn, "tiny_gen"], tmp_path / "one", held_said)
    assert not held_said, "the whole model fits: held, sampling too"
    said: list[str] = []
    with monkeypatch.context() as patch:
        patch.setattr(run, "_fits", lambda stream, settings: False)
        streamed = _evaluate(model, tasks, [drawn], tmp_path / "two", said, seed="0,1234,1234,1234")
        other = _evaluate(model, tasks, [drawn], tmp_path / "two", seed="9")  # the same state dir: not its answers
    assert said, "generated one layer at a time"
    assert _answers(whole.results, drawn) == _answers(streamed.results, drawn), "another run, another path"
    assert _answers(other.results, drawn) != _answers(whole.results, drawn)
    assert any(a[0][0] != a[0][1] for a in _answers(whole.results, drawn)), "each repeat draws its own answer"
    assert [a[0][0] for a in _answers(whole.results, drawn)] != [a[0][0] for a in _answers(whole.results, "tiny_gen")]
    assert whole.results["config"]["torch_seed"] == 1234 and other.results["config"]["torch_seed"] == 9


def test_a_killed_sampled_generation_resumes_to_the_seeds_answers(setup: tuple[Path, Path], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    model, tasks = setup
    drawn = _task(tasks, "tiny_drawn", SAMPLED)
    state = tmp_path / "state"
    args = ["eval", model, "--tasks", drawn, "--include-path", tasks, "--state-dir", state, "--seed", "7", "--json"]
    killed = cli(*args, env={"RESUMERGE_KILL_AT": "after_generation_step:3"}, script=STREAMED, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = _resumed(args, monkeypatch)
    assert resumed.returncode == 0, resumed.stderr
    steps = [line for line in resumed.stderr.splitlines() if re.search(r"token step \d+/", line)]
    assert steps[0].endswith("token step 4/6: layer 1/3"), steps[:2]
    kept = json.loads(next((state / "evals").glob(f"*/{GENERATED}")).read_text())
    held = _evaluate(model, tasks, [drawn], tmp_path / "held", seed="7")  # the whole model, in this process
    assert sorted(kept) == sorted(a[0][0] for a in _answers(held.results, drawn))
    assert json.loads(resumed.stdout)["results"] == held.results["results"]


def test_an_unwritten_merge_generates_as_the_written_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tiny_model(tmp_path / "a", seed=0), tiny_model(tmp_path / "b", seed=1)
    tasks = write_tasks(tmp_path)
    config = write_config(tmp_path / "linear.yml", {"merge_method": "linear", "dtype": "bfloat16", "models": [
        {"model": str(a), "parameters": {"weight": 0.3}}, {"model": str(b), "parameters": {"weight": 0.7}}]})
    state = tmp_path / "state"
    api.run(config, tmp_path / "out", settings=api.Settings(state_dir=state), progress=False)
    written = _evaluate(tmp_path / "out", tasks, ["tiny_gen"], state)  # held whole
    monkeypatch.setattr("resumerge.analyses.evaluation.run._fits", lambda stream, settings: False)
    said: list[str] = []
    unwritten = _evaluate(config, tasks, ["tiny_gen"], state, said)
    assert said and _answers(unwritten.results, "tiny_gen") == _answers(written.results, "tiny_gen")


@pytest.mark.parametrize(("spilled", "point"), [(False, "after_generation_step:3"),
                                                (True, "after_generation_layer:7")])
def test_a_killed_generation_resumes_at_its_step_to_the_same_answers(setup: tuple[Path, Path], tmp_path: Path,
                                                                      uninterrupted: tuple[Any, Any],
                                                                      spilled: bool, point: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model, tasks = setup
    state = tmp_path / "state"
    args = [*(["--spilled"] if spilled else []), "eval", model, "--tasks", "tiny_gen", "--include-path", tasks,
            "--state-dir", state, "--json"]
    killed = cli(*args, env={"RESUMERGE_KILL_AT": point}, script=STREAMED, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "token step 3/8: layer 1/3" in killed.stderr and "token step 4/8" not in killed.stderr
    folder = next((state / "evals").glob("*/progress.json")).parent
    assert len(list(folder.glob(f"{STEP_PREFIX}*.safetensors"))) == (3 if not spilled else 2)
    assert (folder / SPILL_NAME).exists() == spilled
    resumed = _resumed(args, monkeypatch)
    assert resumed.returncode == 0, resumed.stderr
    steps = [line for line in resumed.stderr.splitlines() if re.search(r"token step \d+/", line)]
    assert steps[0].endswith(f"token step {4 if not spilled else 3}/8: layer 1/3"), steps[:2]
    results, kept = uninterrupted
    assert json.loads(resumed.stdout)["results"] == results
    assert json.loads((folder / GENERATED).read_text()) == kept


def _windowed(directory: Path, model_type: str) -> Path:
    """A tiny generated model of ``model_type`` whose layers (all, or every other) attend within a window of 4
    positions: shorter than tiny_gen's contexts, so the window changes what a step sees."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {"vocab_size": SPEC.vocab, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
             "sliding_window": 4, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if model_type == "gemma3_text":
        sizes["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes)).to(torch.float32)
    with torch.no_grad():  # weights large enough that the window changes the greedy tokens
        for name, tensor in model.named_parameters():
            tensor.normal_(0.0, 0.05 if "embed" in name else 0.5 if tensor.dim() > 1 else 0.1)
    model.save_pretrained(directory)
    write_tokenizer(directory, SPEC.vocab, chat_template=CHAT)
    return directory


LONG = '{until: ["never"], max_gen_toks: 10}'


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory, installation_cache: Path) -> tuple[Path, Path, str, list[Any]]:
    """The tiny windowed Gemma 3 (``_windowed``), tasks with tiny_long and transformers' greedy answers on it (its
    ``generate``, the whole model held), made once for the sliding-window tests below (which read them only): each
    made them, ~2 CPU s."""
    root = tmp_path_factory.mktemp("gemma")
    model, tasks = _windowed(root / "model", "gemma3_text"), write_tasks(root)
    long = _task(tasks, "tiny_long", LONG)
    with _as_a_test(root, installation_cache):
        theirs = _answers(hf_results(model, tasks, [long]), long)
    return model, tasks, long, theirs


def _kept_pasts(patch: pytest.MonkeyPatch) -> dict[int, int]:
    """The most positions of a request's past handed to each layer (its index) by the streamed generation, from
    here on (``patch``'s block)."""
    from resumerge.analyses.evaluation import streamgen

    most: dict[int, int] = {}
    own = streamgen.one_layer_cache

    def recorded(layer: int, past: Any, device: Any) -> Any:
        most[layer] = max(most.get(layer, 0), 0 if past is None else int(past[0].shape[2]))
        return own(layer, past, device)

    patch.setattr(streamgen, "one_layer_cache", recorded)
    return most


@pytest.mark.parametrize("model_type", ["gemma3_text", "mistral"])
def test_a_sliding_window_family_streams_to_the_whole_models_answers(tmp_path: Path, model_type: str,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      request: pytest.FixtureRequest) -> None:
    from resumerge.analyses.evaluation import run, streamgen

    theirs: list[Any] | None = None
    if model_type == "gemma3_text":  # the module's Gemma, copied: its config is changed last
        shared, tasks, long, theirs = request.getfixturevalue("gemma")
        model = Path(shutil.copytree(shared, tmp_path / "model"))
    else:
        model, tasks = _windowed(tmp_path / "model", model_type), write_tasks(tmp_path)
        long = _task(tasks, "tiny_long", LONG)
    found, plans = {}, []
    windowed = [0, 2] if model_type == "gemma3_text" else [0, 1, 2]
    for how in ("streamed", "spilled"):
        said: list[str] = []
        with monkeypatch.context() as patch:
            patch.setattr(run, "_fits", lambda stream, settings: False)
            patch.setattr(streamgen, "gen_plan", streamgen.gen_plan)  # restored as it was after the block
            streamed(spilled=how == "spilled")
            planned = streamgen.gen_plan

            def recorded(*args: Any, planned: Any = planned) -> Any:
                plans.append((planned(*args), args[1]))
                return plans[-1][0]

            patch.setattr(streamgen, "gen_plan", recorded)
            most = _kept_pasts(patch)
            found[how] = _answers(_evaluate(model, tasks, [long], tmp_path / how, said).results, long)
        assert ("spilled" in said[0]) == (how == "spilled")
        # a windowed layer is handed its window's last 3 positions at most (the query the 4th), as generate's
        # windowed cache holds them; a full layer its whole past
        assert all(most[layer] == 3 for layer in windowed), most
        assert all(most[layer] > 10 for layer in range(3) if layer not in windowed), most
    # the plan counts the windowed cache: 2 heads x 8 values, keys and values in float32 a position
    plan, asked = plans[0]
    rooms = [len(w.tokens) + w.most for w in asked]
    assert plan.kv == sum(128 * sum(min(r, 3) if layer in windowed else r for layer in range(3)) for r in rooms)
    if theirs is None:
        theirs = _answers(hf_results(model, tasks, [long]), long)  # transformers' generate, the whole model held
    assert found["streamed"] == found["spilled"] == theirs
    assert len({a[0][0] for a in theirs}) > 1
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "sliding_window": 64}))
    assert _answers(hf_results(model, tasks, [long]), long) != theirs, "the window changes the answers"


@pytest.mark.parametrize(("spilled", "point", "journaled"), [(True, "after_generation_layer:19", 6),
                                                              (False, "after_generation_step:5", 5)])
def test_a_killed_sliding_window_generation_resumes_to_the_same_answers(
        tmp_path: Path, gemma: tuple[Path, Path, str, list[Any]], spilled: bool, point: str, journaled: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Gemma 3 (windows of 4 on its first and last layers) killed (SIGKILL) inside a token step, after its
    first, windowed, layer wrote its position into the spilled ring (or after a step, the held cache rebuilt
    from the step files cut to its window), resumes to transformers' greedy answers."""
    model, tasks, long, theirs = gemma
    state = tmp_path / "state"
    args = [*(["--spilled"] if spilled else []), "eval", model, "--tasks", long, "--include-path", tasks,
            "--state-dir", state, "--log-samples", "--output-path", tmp_path / "out", "--json"]
    killed = cli(*args, env={"RESUMERGE_KILL_AT": point}, script=STREAMED, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    folder = next((state / "evals").glob("*/progress.json")).parent
    assert len(list(folder.glob(f"{STEP_PREFIX}*.safetensors"))) == journaled
    if spilled:  # a ring of 4 positions at each windowed layer (its window), every position at the full one
        from safetensors.torch import load_file

        first = load_file(str(folder / f"{STEP_PREFIX}00000.safetensors"))  # each context's positions, added
        rooms = [int(v) + 10 for name, v in first.items() if name.startswith("added.")]
        row = 2 * 8 * 4  # a position's keys (or values) at a layer: 2 heads of 8 float32
        assert (folder / SPILL_NAME).stat().st_size == 2 * row * sum(r + 2 * min(r, 4) for r in rooms)
    else:  # the held cache's step files: the prefill's keys at a windowed layer its window's 3, at the full one all
        from safetensors.torch import load_file

        first = load_file(str(folder / f"{STEP_PREFIX}00000.safetensors"))
        requests = [name.split(".")[1] for name in first if name.startswith("added.")]
        assert requests and all(first[f"k.0.{r}"].shape[2] == first[f"v.2.{r}"].shape[2] == 3 and
                                first[f"k.1.{r}"].shape[2] == int(first[f"added.{r}"]) > 3 for r in requests)
    resumed = _resumed(args, monkeypatch)
    assert resumed.returncode == 0, resumed.stderr
    steps = [line for line in resumed.stderr.splitlines() if re.search(r"token step \d+/", line)]
    assert steps[0].endswith(f"token step {journaled + 1}/10: layer 1/3"), steps[:2]
    kept = json.loads((folder / GENERATED).read_text())
    assert sorted(kept) == sorted(a[0][0] for a in theirs)


def test_generation_runs_on_the_evaluations_device_held_whole_and_streamed(setup: tuple[Path, Path], tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device``: the generation's modules run there (they ran on the CPU whatever the device, before), the
    whole model held and one layer at a time, to the CPU's answers. ``cpu:0`` is moved to as a GPU is (every
    weight, buffer, hidden state and call copied there: :func:`~resumerge.forward.engine.device.moved`), which exercises
    the device's paths here; ``tests/test_gpu_passes.py`` runs them on a GPU."""
    from resumerge.analyses.evaluation import run
    from resumerge.analyses.evaluation.settings import EvalSettings
    from resumerge.forward.engine.device import PassDevice

    model, tasks = setup
    cpu = _answers(_evaluate(model, tasks, ["tiny_gen"], tmp_path / "cpu").results, "tiny_gen")
    found = {}
    for how in ("whole", "streamed"):
        devices: set[str] = set()
        with monkeypatch.context() as patch:
            patch.setattr(EvalSettings, "pass_device", lambda self: PassDevice("cpu:0"))
            load = ModelStream.load

            def recorded(self: ModelStream, *args: Any, devices: set[str] = devices, load: Any = load,
                         **kwargs: Any) -> Any:
                devices.add(str(self.device))
                return load(self, *args, **kwargs)

            patch.setattr(ModelStream, "load", recorded)
            if how == "streamed":
                patch.setattr(run, "_fits", lambda stream, settings: False)
            found[how] = _answers(_evaluate(model, tasks, ["tiny_gen"], tmp_path / how).results, "tiny_gen")
        assert devices == {"cpu:0"}, (how, devices)
    assert found["whole"] == found["streamed"] == cpu


def test_generation_on_a_ray_executor_is_refused_in_one_line_naming_why(setup: tuple[Path, Path],
                                                                         tmp_path: Path) -> None:
    """``--executor ray`` places the log-likelihood passes' layers on actors; a generation runs its layers here,
    against the KV cache it keeps here between token steps: refused before any weight is read (exit 2), one line
    saying so (before: that it held the whole model, which a layer-streamed generation does not)."""
    pytest.importorskip("ray")  # without Ray the executor itself is refused first (seen on a GPU machine)
    model, tasks = setup
    done = cli("eval", model, "--tasks", "tiny_gen", "--include-path", tasks, "--state-dir", tmp_path / "state",
               "--executor", "ray", timeout=300)
    assert done.returncode == 2, (done.stdout, done.stderr)
    line = done.stderr.strip().splitlines()
    assert len([e for e in line if e.startswith("error: ")]) == 1 and "Traceback" not in done.stderr
    error = next(e for e in line if e.startswith("error: "))
    assert "--executor ray" in error and "tiny_gen" in error and "KV cache" in error
    assert not (tmp_path / "state" / "evals").exists()

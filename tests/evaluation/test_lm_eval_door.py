"""``resumerge lm-eval``: lm-eval's own command line with ``--model resumerge``. Its results and samples files are
lm-eval's, and equal those of ``lm-eval --model hf`` (lm-eval's own CLI, transformers, float32) on the same folder:
multiple choice, rolling perplexity, generation and a group, every metric that counts answers identical, every
log-likelihood to 1e-4; a merge config scores as its written merge; ``--use_cache DIR`` is resumerge's journal, a
rerun answers from it without reading a weight and writes the same results file; ``--seed`` and sampling
``--gen_kwargs`` honoured (the torch seed's answers, eval's for the same requests, journaled under the seed); what
resumerge cannot honour is one line, exit 2. Runs lm-eval in this process: 10-40 s each on a loaded machine."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lm_eval")

from support import loopback_only, write_config

from resumerge import api
from resumerge.cli.commands import main
from tests.evaluation.evaltasks import tiny_model, write_tasks
from tests.wandbfiles import wandb_rows_once

TOLERANCE = 1e-4
RELATIVE = 1e-5
COUNTED = ("acc,", "acc_norm,", "acc_stderr,", "acc_norm_stderr,", "exact_match,", "exact_match_stderr,")
# Keys of a results file that describe the run rather than the evaluation: the time, the machine, the model's name.
RUN_KEYS = ("date", "total_evaluation_time_seconds", "start_time", "end_time", "pretty_env_info", "git_hash",
            "upper_git_hash", "transformers_version", "lm_eval_version", "model_name", "model_name_sanitized",
            "model_source", "config")
MODEL_ARGS = ("pretrained", "dtype", "state_dir")
GROUP = "group: tiny_group\ntask: [tiny_mc, tiny_ppl]\n"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # lm-eval's setup_logging (each run, as its console script calls it) adds a handler bound to the sys.stderr of
    # the moment: a test's captured stream, closed once the test ends; taken off again, as a process's end would
    logger = logging.getLogger("lm_eval")
    handlers = list(logger.handlers)
    yield
    for handler in logger.handlers:
        if handler not in handlers:
            logger.removeHandler(handler)



def _door(*words: str) -> int:
    return main(["lm-eval", *words])


def _theirs(monkeypatch: pytest.MonkeyPatch, *words: str) -> None:
    """lm-eval's own command line (its ``lm-eval`` console script's function), nothing of resumerge registered."""
    from lm_eval.__main__ import cli_evaluate

    monkeypatch.setattr(sys, "argv", ["lm-eval", *words])
    cli_evaluate()


def _files(out: Path) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """The results file and each task's samples lm-eval wrote under ``out``."""
    (results,) = out.rglob("results_*.json")
    samples = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return json.loads(results.read_text()), samples


def _same_evaluation(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Everything but the run's description equal; metrics that count answers identical, the others to 1e-5."""
    for key in set(ours) | set(theirs):
        if key in RUN_KEYS:
            continue
        if key in ("results", "groups"):
            assert sorted(ours[key]) == sorted(theirs[key])
            for task, metrics in theirs[key].items():
                assert sorted(ours[key][task]) == sorted(metrics)
                for name, value in metrics.items():
                    if name.startswith(COUNTED) or not isinstance(value, float):
                        assert ours[key][task][name] == value, (task, name)
                    else:
                        assert ours[key][task][name] == pytest.approx(value, rel=RELATIVE, abs=0), (task, name)
        elif key == "configs":  # each task's metadata holds the model_args (hf's dtype=float32, a config's path)
            assert _configs(ours[key]) == _configs(theirs[key])
        else:
            assert ours.get(key) == theirs.get(key), key


def _configs(configs: dict[str, Any]) -> dict[str, Any]:
    return {task: {**config, "metadata": {k: v for k, v in config.get("metadata", {}).items() if k not in MODEL_ARGS}}
            for task, config in configs.items()}


def _same_samples(ours: dict[str, list[dict[str, Any]]], theirs: dict[str, list[dict[str, Any]]]) -> float:
    """Every sample's prompt and target the same, every log-likelihood to 1e-4, every greedy flag and generated
    text identical; returns the largest difference of a log-likelihood."""
    assert sorted(ours) == sorted(theirs)
    largest = 0.0
    for task, rows in theirs.items():
        assert len(ours[task]) == len(rows)
        for mine, oracle in zip(ours[task], rows):
            for key in ("doc_id", "doc", "target", "arguments", "doc_hash", "prompt_hash", "target_hash"):
                assert mine[key] == oracle[key], (task, key)
            for (a,), (b,) in zip(mine["resps"], oracle["resps"]):
                if isinstance(b, list):  # a log-likelihood and its greedy flag, as strings
                    assert a[1] == b[1]
                    a, b = a[0], b[0]
                try:
                    largest = max(largest, abs(float(a) - float(b)))
                    assert abs(float(a) - float(b)) <= TOLERANCE, (task, a, b)
                except ValueError:  # a generated text
                    assert a == b, task
    return largest


def _setup(tmp_path: Path) -> tuple[Path, Path]:
    model = tiny_model(tmp_path / "model")
    tasks = write_tasks(tmp_path)
    (tasks / "tiny_group.yaml").write_text(GROUP)
    return model, tasks


def test_the_door_writes_lm_evals_files_equal_to_its_hf_models(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    model, tasks = _setup(tmp_path)
    common = ["--tasks", "tiny_group", "tiny_gen", "--include_path", str(tasks), "--log_samples", "--seed", "3",
              "--device", "cpu"]
    assert _door("run", "--model", "resumerge", "--model_args", f"pretrained={model}", *common, "--output_path",
                 str(tmp_path / "ours"), "--use_cache", str(tmp_path / "journal")) == 0
    _theirs(monkeypatch, "run", "--model", "hf", "--model_args", f"pretrained={model},dtype=float32", *common,
            "--output_path", str(tmp_path / "theirs"))
    ours, theirs = _files(tmp_path / "ours"), _files(tmp_path / "theirs")
    _same_evaluation(ours[0], theirs[0])
    assert _same_samples(ours[1], theirs[1]) <= TOLERANCE
    assert set(ours[1]) == {"tiny_mc", "tiny_ppl", "tiny_gen"}
    assert "tiny_group" in ours[0]["group_subtasks"]
    config = ours[0]["config"]
    assert (config["model"], config["use_cache"], config["random_seed"]) == ("resumerge", str(tmp_path / "journal"),
                                                                           3)
    assert ours[0]["model_name"] == str(model)
    assert list((tmp_path / "journal" / "evals").iterdir()), "the passes are journaled where --use_cache says"


def test_a_rerun_with_use_cache_reads_no_weight_and_writes_the_same_results(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from resumerge.forward.engine.stream import ModelStream

    model, tasks = _setup(tmp_path)

    def run(out: str, *more: str) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
        assert _door("--model", "resumerge", "--model_args", f"pretrained={model}", "--tasks", "tiny_mc,tiny_ppl",
                     "tiny_gen", "--include_path", str(tasks), "--log_samples", "--output_path",
                     str(tmp_path / out), "--use_cache", str(tmp_path / "cache"), "--device", "cpu", *more) == 0
        return _files(tmp_path / out)

    first = run("first")

    def no_weight(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a weight was read")

    monkeypatch.setattr(ModelStream, "load", no_weight)
    # lm-eval's own W&B logging through the door (offline: its run files)
    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(name, value)
    second = run("second", "--wandb_args", "project=door")
    def logged(rows: list[dict[str, str]], artifacts: list[str]) -> bool:
        return any("tiny_mc/acc" in row for row in rows) and "results" in artifacts

    assert logged(*wandb_rows_once(tmp_path / "wandb", logged)[::2])
    assert {k: v for k, v in first[0].items() if k not in RUN_KEYS} == \
        {k: v for k, v in second[0].items() if k not in RUN_KEYS}
    assert first[0]["config"] == second[0]["config"]
    assert first[1] == second[1]
    # the journal, not lm-eval's SQLite cache
    assert not list(tmp_path.glob("cache*.db")) and (tmp_path / "cache" / "evals").is_dir()


def test_a_merge_config_scores_as_its_written_merge(tmp_path: Path) -> None:
    a, b = tiny_model(tmp_path / "a", seed=0), tiny_model(tmp_path / "b", seed=1)
    tasks = write_tasks(tmp_path)
    config = write_config(tmp_path / "linear.yml", {"merge_method": "linear", "dtype": "bfloat16", "models": [
        {"model": str(a), "parameters": {"weight": 0.3}}, {"model": str(b), "parameters": {"weight": 0.7}}]})
    written = tmp_path / "merged"
    api.run(config, written, settings=api.Settings(state_dir=tmp_path / "state"), progress=False)
    for target, out in ((config, "unwritten"), (written, "written")):
        assert _door("run", "--model", "resumerge", "--model_args",
                     f"pretrained={target},state_dir={tmp_path / 'state'}", "--tasks", "tiny_mc", "tiny_ppl",
                     "--include_path", str(tasks), "--log_samples", "--output_path", str(tmp_path / out)) == 0
    unwritten, merged = _files(tmp_path / "unwritten"), _files(tmp_path / "written")
    _same_evaluation(unwritten[0], merged[0])
    assert _same_samples(unwritten[1], merged[1]) <= 1e-6
    assert not list((tmp_path / "state" / "unwritten").rglob("*.safetensors")), "no weight is written"


def test_the_door_samples_from_its_seed_as_eval_does(tmp_path: Path) -> None:
    model, tasks = _setup(tmp_path)

    def run(out: str, seed: str, journal: str = "journal") -> list[Any]:
        assert _door("run", "--model", "resumerge", "--model_args", f"pretrained={model}", "--tasks", "tiny_gen",
                     "--include_path", str(tasks), "--log_samples", "--seed", seed, "--gen_kwargs",
                     "do_sample=True,temperature=1.5", "--output_path", str(tmp_path / out), "--use_cache",
                     str(tmp_path / journal)) == 0
        results, samples = _files(tmp_path / out)
        assert results["config"]["torch_seed"] == int(seed.split(",")[2])
        return [s["resps"] for s in samples["tiny_gen"]]

    first = run("first", "0,1234,5,1234")
    assert first == run("again", "0,1234,5,1234", journal="other"), "another journal, the same draws"
    assert run("other", "0,1234,6,1234") != first, "the first journal holds another seed's answers"
    gen = (tasks / "tiny_gen.yaml").read_text().replace("task: tiny_gen", "task: tiny_drawn")
    (tasks / "tiny_drawn.yaml").write_text(gen.replace("max_gen_toks: 8}", "max_gen_toks: 8, do_sample: true, "
                                                                         "temperature: 1.5}"))
    report = api.evaluate(model, "tiny_drawn", api.Settings(state_dir=tmp_path / "state"),
                          harness=api.Harness(include_path=tasks, log_samples=True, seed="0,1234,5,1234"))
    assert [s["resps"] for s in report.results["samples"]["tiny_drawn"]] == first, "eval's answers to the same"


@pytest.mark.parametrize(("words", "said"), [
    (["--model_args", "pretrained=MODEL,parallelize=True"], "--model_args parallelize: not an argument"),
    (["--model_args", "pretrained=MODEL", "--gen_kwargs", "do_sample=True,temperature=0.7,num_beams=4"],
     "gen_kwargs num_beams=4: resumerge does not honour it"),
    (["--model_args", "pretrained=MODEL,state_dir=ELSEWHERE", "--use_cache", "CACHE"], "name two journals"),
    (["--model_args", "pretrained=MODEL,dtype=bfloat16"], "resumerge scores in float32"),
])
def test_what_resumerge_cannot_honour_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              words: list[str], said: str) -> None:
    model, tasks = _setup(tmp_path)
    words = [w.replace("MODEL", str(model)).replace("ELSEWHERE", str(tmp_path / "e"))
             .replace("CACHE", str(tmp_path / "c")) for w in words]
    assert _door("run", "--model", "resumerge", "--tasks", "tiny_mc", "--include_path", str(tasks), *words,
                 "--output_path", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "e").exists()


@pytest.mark.parametrize(("words", "said"), [
    (["--device", "mps"], "unknown device 'mps'"),
    (["--model_args", "pretrained=MODEL,device=mps"], "unknown device 'mps'"),
    (["--model_args", "pretrained=MODEL,max_memory=lots"], "--max-memory"),
])
def test_a_bad_device_or_model_argument_is_refused_in_one_line_before_a_task_is_loaded(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, words: list[str],
        said: str) -> None:
    """``--device mps`` was refused after lm-eval's 24 s of task loading, in 6 lines (issue 97, item 8): now as an
    unknown ``--model_args`` key is, before lm-eval reads a task (here one that does not exist)."""
    import lm_eval.tasks

    def loaded(*args: object, **kwargs: object) -> None:
        raise AssertionError("lm-eval loaded its tasks before the refusal")

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", loaded)
    model = tiny_model(tmp_path / "model")
    words = [w.replace("MODEL", str(model)) for w in words]
    if words[0] == "--device":
        words = ["--model_args", f"pretrained={model}", *words]
    assert _door("run", "--model", "resumerge", "--tasks", "no_such_task", *words, "--output_path",
                 str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "WARNING" not in line and "INFO" not in line]
    assert len(lines) == 1 and said in lines[0], err
    assert not (tmp_path / "out").exists()


def test_lm_evals_help_says_what_the_resumerge_model_takes() -> None:
    """``resumerge lm-eval --help`` was lm-eval's alone: no word of the ``resumerge`` model, its ``--model_args``,
    or of ``--use_cache`` as its journal (issue 97, item 8)."""
    import subprocess

    for words in (["--help"], ["run", "--help"]):
        done = subprocess.run([sys.executable, "-m", "resumerge", "lm-eval", *words], capture_output=True, text=True,
                              check=False, timeout=120)
        assert done.returncode == 0, done.stderr
        ours = " ".join(done.stdout.split("resumerge:")[-1].split())
        assert "--model resumerge takes --model_args pretrained=PATH" in ours, done.stdout
        assert all(f"{key}=" in ours for key in ("max_memory", "state_dir", "device")), ours
        assert "--use_cache DIR keeps resumerge's journal" in ours, ours


def test_python_m_resumerge_lm_eval_is_lm_evals_command_line(tmp_path: Path) -> None:
    import subprocess

    done = subprocess.run([sys.executable, "-m", "resumerge.lm_eval", "run", "--help"], capture_output=True,
                          text=True, check=False, timeout=120)
    assert done.returncode == 0
    assert "--use_cache" in done.stdout and "--hf_hub_log_args" in done.stdout


def test_eval_takes_lm_evals_spellings_of_the_flags_it_shares() -> None:
    from resumerge.cli.parsers import build_parser

    parser = build_parser("eval")
    ours = parser.parse_args(["eval", "M", "--tasks", "a,b", "--include-path", "D", "--num-fewshot", "2",
                              "--log-samples", "--output-path", "O", "--apply-chat-template", "--limit", "3"])
    theirs = parser.parse_args(["eval", "M", "-t", "a,b", "--include_path", "D", "--num_fewshot", "2",
                                "--log_samples", "--output_path", "O", "--apply_chat_template", "-L", "3"])
    assert ours == theirs
    assert parser.parse_args(["eval", "M", "-t", "a", "-f", "1", "-s", "-o", "P"]) == \
        parser.parse_args(["eval", "M", "--tasks", "a", "--num-fewshot", "1", "--log-samples", "--output-path", "P"])


HUB_TOKEN = "hf_door_write_token_0123456789"


@pytest.fixture
def stand_in_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The suite's stand-in hub on 127.0.0.1 with a write token for org, an HF home in ``tmp_path`` (never the
    user's cache), and every other host refused."""

    import datasets.config
    from hub.fakehub import FakeHub
    from hub.fakehub_write import HubWriter
    from huggingface_hub import close_session, constants, hf_api

    home = tmp_path / "hf_home"
    hub = FakeHub()
    writer = HubWriter.attach(hub)
    writer.add_token(HUB_TOKEN, "alice", orgs=("org",))
    loopback_only(monkeypatch)
    with hub:
        settings = {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_TOKEN_PATH": str(home / "token"),
                    "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1", "HF_ENDPOINT": hub.url,
                    "HF_TOKEN": HUB_TOKEN}
        for name, value in settings.items():
            monkeypatch.setenv(name, value)
        for name, setting in {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
                              "HF_TOKEN_PATH": str(home / "token"), "HF_HUB_DISABLE_XET": True,
                              "ENDPOINT": hub.url,
                              "HUGGINGFACE_CO_URL_TEMPLATE": hub.url + "/{repo_id}/resolve/{revision}/{filename}"
                              }.items():
            monkeypatch.setattr(constants, name, setting)
        # huggingface_hub's module-level functions (a dataset card's push) are a client made when it was imported
        monkeypatch.setattr(hf_api.api, "endpoint", hub.url)
        # datasets fixed its caches when it was imported (the card reads the pushed results back through it)
        for name, path in {"HF_DATASETS_CACHE": "datasets", "DOWNLOADED_DATASETS_PATH": "datasets/downloads",
                           "EXTRACTED_DATASETS_PATH": "datasets/downloads/extracted"}.items():
            monkeypatch.setattr(datasets.config, name, home / path)
        yield writer
    close_session()


def test_hf_hub_log_args_push_lm_evals_files_to_the_hub_as_its_own_logger_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        stand_in_hub: Any) -> None:
    """``--hf_hub_log_args`` through the door: lm-eval's EvaluationTracker pushes the results and samples files it
    wrote, and its dataset card, to the dataset repo its arguments name, at the paths it gives them for ``--model hf``
    on the same folder; a token given in the arguments is in no output, no journal and no pushed file."""
    model, tasks = _setup(tmp_path)
    common = ["--tasks", "tiny_mc", "tiny_gen", "--include_path", str(tasks), "--log_samples", "--device", "cpu"]

    def hub_args(repo: str) -> str:
        return f"hub_results_org=org,details_repo_name={repo},push_results_to_hub=True,push_samples_to_hub=True"

    assert _door("run", "--model", "resumerge", "--model_args", f"pretrained={model}", *common, "--hf_hub_log_args",
                 f"{hub_args('ours')},token={HUB_TOKEN}", "--output_path", str(tmp_path / "ours"),
                 "--use_cache", str(tmp_path / "journal")) == 0
    _theirs(monkeypatch, "run", "--model", "hf", "--model_args", f"pretrained={model},dtype=float32",
            *common, "--hf_hub_log_args", hub_args("theirs"), "--output_path", str(tmp_path / "theirs"))
    said = capsys.readouterr()
    assert HUB_TOKEN not in said.out + said.err

    def layout(repo: str) -> dict[str, bytes]:
        """The repo's files, each name's run date (results_DATE.json, samples_TASK_DATE.jsonl) taken out."""
        import re

        return {re.sub(r"_\d{4}-\d\d-\d\dT[\d.-]+\.json", "_DATE.json", path): data
                for path, data in stand_in_hub.head_files(repo).items()}

    ours, theirs = layout("org/ours-private"), layout("org/theirs-private")
    assert sorted(ours) == sorted(theirs)
    assert {p.rsplit("/", 1)[-1] for p in ours} >= {"README.md", "results_DATE.json", "samples_tiny_mc_DATE.jsonl",
                                                    "samples_tiny_gen_DATE.jsonl"}
    written = {path.name: path.read_bytes() for path in (tmp_path / "ours").rglob("*.json*")}
    pushed = {path.rsplit("/", 1)[-1]: data for path, data in stand_in_hub.head_files("org/ours-private").items()}
    assert {name: pushed[name] for name in written} == written, "the files lm-eval wrote, pushed as they are"
    assert any(r.path.startswith("/api/datasets/org/ours-private/commit/") for r in stand_in_hub.hub.requests)
    assert all(HUB_TOKEN.encode() not in data for data in pushed.values())
    for path in (tmp_path / "journal").rglob("*"):
        assert not path.is_file() or HUB_TOKEN.encode() not in path.read_bytes(), path


def test_the_command_kept_to_continue_names_no_token() -> None:
    from resumerge.cli.lmevalcmd import _tokenless

    assert _tokenless(["run", "--hf_hub_log_args", "hub_results_org=org,token=hf_a,public_repo=True",
                       "--hf_hub_log_args=token=hf_b,gated=True", "--metadata", "token=kept"]) == \
        ["run", "--hf_hub_log_args", "hub_results_org=org,public_repo=True", "--hf_hub_log_args=gated=True",
         "--metadata", "token=kept"]

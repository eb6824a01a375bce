"""``eval`` and ``evolve`` with ``--device cuda`` give the CPU's figures: each layer of a model, and of a merge never
written, runs on the GPU and every request's score, metric and generation is the CPU's (within float32 rounding:
a GPU's matrix products sum in another order); a generation one decoder layer at a time on the GPU (a tiny Llama, a
tiny Gemma 3 with windowed layers; its KV cache in RAM or spilled) gives the CPU's greedy answers; a search on the GPU
proposes the same candidates and keeps the same ``best.yml`` config; an importance pass on the GPU steers a GGUF to
the CPU's bytes. Skipped without a CUDA GPU (run on a lent GPU machine: ``pytest tests/test_gpu_passes.py``); tiny
generated models, a few seconds each there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support import write_config

from resumerge import api

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_eval_on_the_gpu_gives_the_cpus_results_for_a_model_and_for_an_unwritten_merge(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    from tests.evaluation.evaltasks import tiny_model, write_tasks
    from tests.evaluation.test_unwritten import _losses

    a, b = tiny_model(tmp_path / "a", seed=0), tiny_model(tmp_path / "b", seed=1)
    tasks = write_tasks(tmp_path)
    merge = write_config(tmp_path / "linear.yml", {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(a), "parameters": {"weight": 0.3}}, {"model": str(b), "parameters": {"weight": 0.7}}]})
    names = ["tiny_mc", "tiny_ppl", "tiny_gen"]
    for number, target in enumerate((a, merge)):
        cpu = api.evaluate(target, names, api.Settings(state_dir=tmp_path / f"s-cpu-{number}"),
                           harness=api.Harness(include_path=tasks, log_samples=True))
        gpu = api.evaluate(target, names, api.Settings(resources=api.Resources(device="cuda"),
                                                       state_dir=tmp_path / f"s-gpu-{number}"),
                           harness=api.Harness(include_path=tasks, log_samples=True))
        for task in names:
            want, got = cpu.results["results"][task], gpu.results["results"][task]
            assert want.keys() == got.keys(), task
            for key, value in want.items():
                if isinstance(value, float):
                    assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (task, key)
                else:
                    assert got[key] == value, (task, key)
            ours, theirs = _losses(gpu.results, task), _losses(cpu.results, task)
            if task == "tiny_gen":
                assert ours == theirs  # greedy generations: the same tokens
            else:
                assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-5), task


def test_a_search_on_the_gpu_proposes_the_cpus_candidates_and_keeps_the_same_best(tmp_path: Path) -> None:
    pytest.importorskip("cma")
    from tests.evolve.test_search import make_search

    config = make_search(tmp_path)  # a ties genome of two layer groups, two kl tasks and an nll task
    search = api.Search(max_fevals=6, popsize=3, random_seed=7)
    api.evolve(config, tmp_path / "cpu", search=search)
    api.evolve(config, tmp_path / "gpu", api.Settings(resources=api.Resources(device="cuda")), search=search)
    rows = {where: [json.loads(line) for line in (tmp_path / where / "evaluations.jsonl").read_text().splitlines()]
            for where in ("cpu", "gpu")}
    assert len(rows["cpu"]) == 6
    for want, got in zip(rows["cpu"], rows["gpu"], strict=True):
        assert (got["genotype"], got["config"]) == (want["genotype"], want["config"])
        assert got["objective"] == pytest.approx(want["objective"], rel=1e-5)
        for name, value in want["tasks"].items():
            assert got["tasks"][name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    # the same candidate is best and its config the same bytes; only the objective in the head line may differ
    want, got = ((tmp_path / where / "best.yml").read_text().split("\n", 1) for where in ("cpu", "gpu"))
    assert got[0].split("objective")[0] == want[0].split("objective")[0] and got[1] == want[1]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_layer_streamed_generation_on_the_gpu_gives_the_cpus_answers(tmp_path: Path, family: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Generation with ``--device cuda`` where the whole model does not fit: each decoder layer on the GPU, the KV
    cache in RAM or spilled (a Gemma 3's windowed layers keeping their window), the same greedy answers as the CPU;
    and the whole model held on the GPU, the same answers too."""
    pytest.importorskip("lm_eval")
    from resumerge.analyses.evaluation import run, streamgen
    from tests.evaluation.evaltasks import tiny_model, write_tasks
    from tests.evaluation.streamedeval import streamed
    from tests.evaluation.test_streamgen import _answers, _task, _windowed

    model = tiny_model(tmp_path / "model") if family == "llama" else _windowed(tmp_path / "model", family)
    tasks = write_tasks(tmp_path)
    long = _task(tasks, "tiny_long", '{until: ["never"], max_gen_toks: 10}')
    found = {}
    for device in ("cpu", "cuda"):
        for how in ("whole", "streamed", "spilled"):
            with monkeypatch.context() as patch:
                if how != "whole":
                    patch.setattr(run, "_fits", lambda stream, settings: False)
                    patch.setattr(streamgen, "gen_plan", streamgen.gen_plan)
                    streamed(spilled=how == "spilled")
                done = api.evaluate(model, [long], api.Settings(state_dir=tmp_path / f"{device}-{how}",
                                                                resources=api.Resources(device=device)),
                                    harness=api.Harness(include_path=tasks, log_samples=True))
            found[device, how] = _answers(done.results, long)
    assert len({json.dumps(answers) for answers in found.values()}) == 1, found


@pytest.mark.parametrize("mix", ["q4_k_m", "iq4_xs"])
def test_a_gguf_whose_importance_pass_ran_on_the_gpu_is_the_cpus_file(mix: str, tmp_path: Path) -> None:
    """``run --out-type gguf --imatrix-texts --device cuda``: the importance pass (a recorded phase of the run) runs
    each layer on the GPU, and its matrix and the K-quant / i-quant file it steers are the CPU's, byte for byte (the
    matrix sums squares of activations in float32 on either device, then the encoders run on the CPU)."""
    import hashlib

    from ggufmodels import linear_llama_pair
    from support import cli

    config, texts = linear_llama_pair(tmp_path, "the cat sat on the mat.\nthree plus four is seven.\n" * 6)
    digests: dict[str, tuple[str, list[str]]] = {}
    for device in ("cpu", "cuda"):
        out, state = tmp_path / device / "out", tmp_path / device / "state"
        done = cli("run", config, out, "--state-dir", state, "--out-type", "gguf", "--gguf-type", mix,
                   "--imatrix-texts", texts, "--device", device)
        assert done.returncode == 0, done.stderr
        digests[device] = (hashlib.sha256((out / "model.gguf").read_bytes()).hexdigest(),
                           sorted(hashlib.sha256(p.read_bytes()).hexdigest() for p in (state / "imatrix").glob("*")))
    assert digests["cuda"] == digests["cpu"]

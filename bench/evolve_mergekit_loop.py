"""The loop mergekit-evolve runs on a CPU, for ``bench_evolve.py --mergekit``: per candidate, the merge written by
mergekit 0.1.5 (``mergekit.merge.run_merge``, in this process as mergekit-evolve's actor runs it), loaded by
transformers (``AutoModelForCausalLM.from_pretrained``, float32, as lm-eval's ``hf`` model loads it) and scored on
each task's texts (KL from the task's parent, NLL per predicted token), the written merge removed after.

Usage: ``python bench/evolve_mergekit_loop.py CONFIGS.json EVOLVE.yml WORK [--lmeval]`` (CONFIGS.json: the
candidates' merge configs, in order); prints one JSON object per candidate (its figure per task, named as resumerge
names them) and the process's peak RSS.

``--lmeval``: each candidate evaluated as mergekit-evolve's actor evaluates it (``mergekit/evo/helpers.py``:
``evaluate_model`` → ``lm_eval.simple_evaluate(model="huggingface", model_args={"pretrained": MERGE, ...},
tasks=..., task_manager=...)`` once per candidate: lm-eval's ``hf`` model loads the written merge and its tokenizer,
and every task is set up again, its data read), each task here an lm-eval ``loglikelihood_rolling`` task over that
task's texts (written to WORK as lm-eval YAML: the same tokens through the same forward work as an ``nll`` figure;
lm-eval has no KL from a parent, so a ``kl`` task is scored as the candidate's perplexity of the parent's texts).
Its figures are lm-eval's ``word_perplexity``, not resumerge's; what it measures is the time mergekit-evolve's own
loop takes per candidate (float32, as the streamed pass runs, where mergekit-evolve asks for bfloat16)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def main() -> None:
    import torch
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from resumerge.machine.memory import os_peak_rss
    from resumerge.runs.evolve.spec import read_spec

    configs = json.loads(Path(sys.argv[1]).read_text())
    spec = read_spec(Path(sys.argv[2]).read_text(), allow_benchmarks=False)
    work = Path(sys.argv[3])
    if "--lmeval" in sys.argv[4:]:
        _lmeval_loop(configs, spec, work)
        print("peak", os_peak_rss(), flush=True)
        return
    tokenizer = AutoTokenizer.from_pretrained(spec.genome.models[0])
    texts = {t.name: [tokenizer(line)["input_ids"] for line in Path(str(t.texts)).read_text().splitlines() if line]
             for t in spec.tasks}

    def logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)

    parents = {}
    for task in spec.tasks:
        if task.kind == "kl" and task.parent not in parents:
            model = AutoModelForCausalLM.from_pretrained(task.parent, torch_dtype=torch.float32)
            parents[task.parent] = {t.name: [logprobs(model, ids) for ids in texts[t.name]] for t in spec.tasks
                                    if t.parent == task.parent}
            del model
    for index, config in enumerate(configs):
        out = work / f"candidate-{index}"
        shutil.rmtree(out, ignore_errors=True)
        run_merge(MergeConfiguration.model_validate(yaml.safe_load(yaml.safe_dump(config))), str(out),
                  options=MergeOptions(copy_tokenizer=True, lazy_unpickle=True, low_cpu_memory=True))
        model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
        figures = {}
        for task in spec.tasks:
            found = [logprobs(model, ids) for ids in texts[task.name]]
            if task.kind == "kl":
                theirs = parents[task.parent][task.name]
                per = torch.cat([(p.exp() * (p - q)).sum(-1) for p, q in zip(theirs, found)])
                figures[task.name] = float(per.double().mean())
            else:
                total = sum(float(-lp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).double().sum())
                            for lp, ids in zip(found, texts[task.name]))
                figures[task.name] = total / sum(len(ids) - 1 for ids in texts[task.name])
        del model
        shutil.rmtree(out, ignore_errors=True)
        print(json.dumps({"index": index, "tasks": figures}), flush=True)
    print("peak", os_peak_rss(), flush=True)


def _lmeval_loop(configs: list[dict[str, object]], spec: object, work: Path) -> None:
    """Each candidate merged by mergekit and evaluated by lm-eval as mergekit-evolve's ``evaluate_model`` does."""
    import os

    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks_dir = work / "lmeval-tasks"
    tasks_dir.mkdir(parents=True, exist_ok=True)
    names = {}
    for number, task in enumerate(spec.tasks):  # type: ignore[attr-defined]
        name = f"evolve_bench_{number}"
        data = tasks_dir / f"{name}.jsonl"
        data.write_text("".join(json.dumps({"text": line}) + "\n"
                                for line in Path(str(task.texts)).read_text().splitlines() if line))
        (tasks_dir / f"{name}.yaml").write_text(yaml.safe_dump({
            "task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "loglikelihood_rolling", "doc_to_text": "",
            "doc_to_target": "{{text}}", "metric_list": [{"metric": "word_perplexity"}]}))
        names[name] = task.name
    manager = TaskManager(include_path=str(tasks_dir))  # one for the search, as mergekit-evolve's strategy keeps
    for index, config in enumerate(configs):
        out = work / f"candidate-{index}"
        shutil.rmtree(out, ignore_errors=True)
        run_merge(MergeConfiguration.model_validate(yaml.safe_load(yaml.safe_dump(config))), str(out),
                  options=MergeOptions(copy_tokenizer=True, lazy_unpickle=True, low_cpu_memory=True))
        results = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(out), "dtype": "float32",
                                                                  "use_cache": True},
                                          tasks=list(names), log_samples=False, verbosity="WARNING",
                                          task_manager=manager, device="cpu")
        shutil.rmtree(out, ignore_errors=True)
        figures = {names[n]: float(results["results"][n]["word_perplexity,none"]) for n in names}
        print(json.dumps({"index": index, "tasks": figures}), flush=True)


if __name__ == "__main__":
    main()

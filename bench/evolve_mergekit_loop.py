"""The loop mergekit-evolve runs on a CPU, for ``bench_evolve.py --mergekit``: per candidate, the merge written by
mergekit 0.1.5 (``mergekit.merge.run_merge``, in this process as mergekit-evolve's actor runs it), loaded by
transformers (``AutoModelForCausalLM.from_pretrained``, float32, as lm-eval's ``hf`` model loads it) and scored on
each task's texts (KL from the task's parent, NLL per predicted token), the written merge removed after.

Usage: ``python bench/evolve_mergekit_loop.py CONFIGS.json EVOLVE.yml WORK`` (CONFIGS.json: the candidates' merge
configs, in order); prints one JSON object per candidate (its figure per task, named as resumerge names them) and
the process's peak RSS."""

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

    from resumerge.evolve.spec import read_spec
    from resumerge.memory import os_peak_rss

    configs = json.loads(Path(sys.argv[1]).read_text())
    spec = read_spec(Path(sys.argv[2]).read_text(), allow_benchmarks=False)
    work = Path(sys.argv[3])
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


if __name__ == "__main__":
    main()

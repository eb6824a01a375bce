"""Task YAMLs with local data files for eval's tests (offline: lm-eval reads them with the ``json`` dataset builder),
tiny generated models with a chat template, and lm-eval's own ``hf`` model run on the same tasks as the oracle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from resumerge.cli.modelgen import ModelSpec, make_model, write_tokenizer

SPEC = ModelSpec(layers=3, hidden=32, intermediate=48, vocab=64)
# A template that marks each turn with its role (letters only: the tiny tokenizer knows no other characters).
CHAT = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}")
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma", "omega", "rho",
         "tau", "phi", "chi", "psi", "iota", "mu", "nu", "xi", "omicron", "pi", "upsilon", "eta")

MC = """task: tiny_mc
dataset_path: json
dataset_kwargs: {{data_files: {{train: {train}, test: {test}}}}}
training_split: train
test_split: test
output_type: multiple_choice
doc_to_text: "Question {{{{question}}}} Answer"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
"""
PPL = """task: tiny_ppl
dataset_path: json
dataset_kwargs: {{data_files: {{test: {test}}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list: [{{metric: word_perplexity}}, {{metric: byte_perplexity}}, {{metric: bits_per_byte}}]
"""


def generate_task(name: str, *, text: str, target: str, until: str, tokens: int, greedy: bool = False) -> str:
    """An lm-eval ``generate_until`` task's YAML, a template whose one slot is ``{test}`` (its JSON lines): the row's
    ``text`` and ``target`` (Jinja), up to ``tokens`` new tokens or ``until``, scored by exact match."""
    lines = [f"task: {name}", "dataset_path: json", "dataset_kwargs: {data_files: {test: \0}}", "test_split: test",
             "output_type: generate_until", f'doc_to_text: "{text}"', f'doc_to_target: "{target}"',
             f"generation_kwargs: {{until: [{json.dumps(until)}], max_gen_toks: {tokens}"
             + (", do_sample: false}" if greedy else "}"), "metric_list: [{metric: exact_match}]"]
    # a str.format template: every brace of the YAML doubled, then the data file's place (NUL above) its one slot
    return "".join(f"{line}\n" for line in lines).replace("{", "{{").replace("}", "}}").replace("\0", "{test}")


GEN = generate_task("tiny_gen", text="Question {{question}} Answer", target="{{choices[0]}}", until="\n", tokens=8)


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _mc_rows(start: int, count: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(start, start + count):
        words = [WORDS[(i * 7 + k) % len(WORDS)] for k in range(6)]
        rows.append({"question": f"{words[0]} {words[1]}",
                     "choices": [f"{words[2]}", f"{words[3]} {words[4]}", f"{words[5]} x", "a b c d"],
                     "label": i % 4})
    return rows


def write_tasks(root: Path) -> Path:
    """A folder of task YAMLs (``tiny_mc``: multiple choice with acc and acc_norm, few-shot examples from its train
    split; ``tiny_ppl``: rolling log-likelihood with word and byte perplexity; ``tiny_gen``: generation) and their
    data files under ``root``."""
    data = root / "data"
    data.mkdir(parents=True)
    train = _jsonl(data / "train.jsonl", _mc_rows(100, 8))
    test = _jsonl(data / "test.jsonl", _mc_rows(0, 6))
    texts = [" ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(4 + 3 * i)) for i in range(4)]
    ppl = _jsonl(data / "ppl.jsonl", [{"text": t} for t in texts])
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(MC.format(train=train, test=test))
    (tasks / "tiny_ppl.yaml").write_text(PPL.format(test=ppl))
    (tasks / "tiny_gen.yaml").write_text(GEN.format(test=test))
    return tasks


def tiny_model(directory: Path, *, context: int = 24, seed: int = 0) -> Path:
    """A generated Llama model (3 layers, width 32) with a chat template, whose context is ``context`` tokens:
    short, so that long requests are cut on the left and documents scored in several rolling windows."""
    model = make_model(directory, SPEC, seed=seed)
    write_tokenizer(model, SPEC.vocab, chat_template=CHAT)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = context
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


def hf_results(model: Path, tasks: Path, names: list[str], **options: Any) -> dict[str, Any]:
    """lm-eval's results object for its own ``hf`` model (transformers, float32, CPU) on ``names``, samples
    logged: the oracle."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model},dtype=float32", tasks=names,
                                      device="cpu", task_manager=TaskManager(include_path=str(tasks),
                                                                             include_defaults=False),
                                      log_samples=True, **options)
    assert results is not None
    return dict(results)

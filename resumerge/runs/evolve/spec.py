"""An evolve config read and checked: mergekit-evolve's schema (``genome``, ``tasks``, ``limit``, ``num_fewshot``,
``apply_chat_template`` and its other keys) plus resumerge's own task entries ``{kl: {parent, texts}}`` and
``{nll: {texts}}``. Everything here is decided from the YAML text and the files it names (their existence), before
any model is opened: each problem is one :class:`~resumerge.errors.ConfigError` naming its YAML path."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from resumerge.config.merge_config import parse_documents
from resumerge.errors import ConfigError

# mergekit 0.1.5's own methods (evo/genome.py: METHOD_PARAM_MAPS): the parameters each searches, in order.
MERGEKIT_METHODS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "linear": ("weight",),
    "task_arithmetic": ("weight",),
    "ties": ("weight", "density"),
    "dare_ties": ("weight", "density"),
    "slerp": ("t",),
})
# Tasks named after common benchmarks (mergekit 0.1.5's evo/config.py list): optimising on their test sets is
# refused unless the user opts in, as mergekit-evolve refuses it.
BENCHMARK_PREFIXES = ("mmlu", "hendrycks", "agieval", "gsm8k", "hellaswag", "winogrande", "arc_", "ai2_arc",
                      "truthfulqa", "bigbench", "piqa", "openbookqa", "leaderboard")
OPT_IN = "--i-understand-the-depths-of-the-evils-i-am-unleashing"
_GENOME_KEYS = ("models", "merge_method", "base_model", "tokenizer_source", "layer_granularity", "normalize",
                "allow_negative_weights", "filters", "smooth")
_TOP_KEYS = ("genome", "tasks", "limit", "num_fewshot", "shuffle", "random_init", "apply_chat_template",
             "fewshot_as_multiturn")


@dataclass(frozen=True)
class Genome:
    """What is searched: the ``models`` merged (paths as written), the ``method``, the ``base`` (None: none),
    ``granularity`` (layers per group; 0: one group), the ``filters`` (each its own parameter set, then the rest),
    ``smooth`` (parameters interpolated across groups), ``normalize`` (None: the method's default as mergekit
    picks it), ``allow_negative`` weights and the ``tokenizer_source``."""

    models: tuple[str, ...]
    method: str
    base: str | None = None
    granularity: int = 0
    filters: tuple[str, ...] = ()
    smooth: bool = False
    normalize: bool | None = None
    allow_negative: bool = False
    tokenizer_source: str | None = None


@dataclass(frozen=True)
class Task:
    """One task of the objective: ``kind`` ``kl`` (the candidate's KL from ``parent`` on ``texts``), ``nll`` (its
    NLL on ``texts``) or ``lm-eval`` (the lm-eval task ``name``'s ``metric``), weighted by ``weight``."""

    kind: str
    name: str
    weight: float = 1.0
    metric: str = "acc,none"
    parent: str | None = None
    texts: str | None = None

    @property
    def lowers(self) -> bool:
        """Whether a smaller figure is better (KL and NLL; an lm-eval metric such as ``acc`` counts up)."""
        return self.kind in ("kl", "nll")


@dataclass(frozen=True)
class EvolveSpec:
    """A checked evolve config: the genome, the tasks and lm-eval's settings as given; ``text`` is the YAML."""

    genome: Genome
    tasks: tuple[Task, ...]
    text: str
    limit: int | None = None
    num_fewshot: int | None = None
    apply_chat_template: bool = True
    random_init: bool = False  # mergekit's: the search starts from a random genotype, not the default merge

    @property
    def fingerprint(self) -> str:
        """What a STORAGE's search is of: the config's text, hashed."""
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


def read_spec(text: str, *, source: str = "CONFIG", base_dir: Path | None = None,
              allow_benchmarks: bool = False) -> EvolveSpec:
    """The evolve config in YAML ``text``; paths in it are relative to ``base_dir`` (None: the current directory).
    Raises :class:`ConfigError` for the first problem, naming its YAML path: an unknown key, a method that has no
    parameter to search, a missing base, a benchmark task without ``allow_benchmarks`` (``--i-understand-the-depths-
    of-the-evils-i-am-unleashing``), a texts file that is not there."""
    docs = parse_documents(text, source=source)
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise ConfigError(f"{source} must be one YAML mapping with genome and tasks")
    doc: dict[str, Any] = docs[0]
    _known(doc, _TOP_KEYS, "")
    for key in ("genome", "tasks"):
        if key not in doc:
            raise ConfigError(f"{source} has no {key}", yaml_path=key, hint="a mergekit-evolve config names both")
    genome = _genome(doc["genome"], base_dir)
    tasks = _tasks(doc["tasks"], base_dir, allow_benchmarks)
    return EvolveSpec(genome, tasks, text, limit=_count(doc.get("limit"), "limit"),
                      num_fewshot=_count(doc.get("num_fewshot"), "num_fewshot"),
                      apply_chat_template=_flag(doc.get("apply_chat_template", True), "apply_chat_template"),
                      random_init=_flag(doc.get("random_init", False), "random_init"))


def _known(doc: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in doc:
        if key not in allowed:
            raise ConfigError(f"unknown key {key!r}", yaml_path=f"{where}{key}",
                              hint=f"the keys here are {', '.join(allowed)}")


def _path(value: Any, yaml_path: str, base_dir: Path | None) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError("must be a path or hub repo", yaml_path=yaml_path)
    if value.startswith("hf://") or base_dir is None or Path(value).is_absolute():
        return value
    return str(base_dir / value)


def _genome(value: Any, base_dir: Path | None) -> Genome:
    if not isinstance(value, dict):
        raise ConfigError("must be a mapping", yaml_path="genome")
    _known(value, _GENOME_KEYS, "genome.")
    models = value.get("models")
    if not isinstance(models, list) or len(models) < 2:
        raise ConfigError("needs two models or more", yaml_path="genome.models")
    paths = tuple(_path(m, f"genome.models[{i}]", base_dir) for i, m in enumerate(models))
    if len(set(paths)) != len(paths):
        raise ConfigError("names a model twice", yaml_path="genome.models")
    method = value.get("merge_method")
    if not isinstance(method, str):
        raise ConfigError("must name a merge method", yaml_path="genome.merge_method")
    base = _path(value["base_model"], "genome.base_model", base_dir) if value.get("base_model") else None
    granularity = value.get("layer_granularity", 0)
    if not isinstance(granularity, int) or isinstance(granularity, bool) or granularity < 0:
        raise ConfigError("must be a whole number of layers, 0 for one group", yaml_path="genome.layer_granularity")
    filters = value.get("filters") or []
    if not isinstance(filters, list) or not all(isinstance(f, str) and f for f in filters):
        raise ConfigError("must be a list of tensor-name substrings", yaml_path="genome.filters")
    normalize = value.get("normalize")
    if normalize is not None:
        normalize = _flag(normalize, "genome.normalize")
    smooth = _flag(value.get("smooth", False), "genome.smooth")
    if method == "slerp" and smooth:
        raise ConfigError("smooth is not supported for slerp (as in mergekit-evolve)", yaml_path="genome.smooth")
    if method == "slerp" and filters:
        raise ConfigError("filters are not supported for slerp (as in mergekit-evolve)", yaml_path="genome.filters")
    tokenizer = value.get("tokenizer_source")
    if tokenizer is not None and not isinstance(tokenizer, str):
        raise ConfigError("must be base, union or a model's path", yaml_path="genome.tokenizer_source")
    return Genome(paths, method, base, granularity, tuple(filters), smooth, normalize,
                  _flag(value.get("allow_negative_weights", False), "genome.allow_negative_weights"), tokenizer)


def _tasks(value: Any, base_dir: Path | None, allow_benchmarks: bool) -> tuple[Task, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError("needs one task or more", yaml_path="tasks")
    tasks = tuple(_task(item, f"tasks[{i}]", base_dir) for i, item in enumerate(value))
    for i, task in enumerate(tasks):
        # mergekit's rule: a benchmark's name is refused unless opted in; its *_train tasks are fine.
        if task.kind == "lm-eval" and task.name.startswith(BENCHMARK_PREFIXES) and not task.name.endswith("_train") \
                and not allow_benchmarks:
            raise ConfigError(f"task {task.name} is a common benchmark: optimising on its test set games it",
                              yaml_path=f"tasks[{i}]", hint=f"score on your own texts (kl, nll), or pass {OPT_IN}")
    return tasks


def _task(item: Any, where: str, base_dir: Path | None) -> Task:
    if isinstance(item, str):
        return Task("lm-eval", item)
    if not isinstance(item, dict):
        raise ConfigError("must be a task name or a mapping", yaml_path=where)
    weight = item.get("weight", 1.0)
    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight != weight:
        raise ConfigError("must be a number", yaml_path=f"{where}.weight")
    own = [key for key in ("kl", "nll") if key in item]
    if not own:
        _known(item, ("name", "weight", "metric"), f"{where}.")
        name, metric = item.get("name"), item.get("metric", "acc,none")
        if not isinstance(name, str) or not isinstance(metric, str):
            raise ConfigError("needs a name (an lm-eval task), or kl or nll", yaml_path=where)
        return Task("lm-eval", name, float(weight), metric)
    _known(item, (own[0], "weight"), f"{where}.")
    kind, body = own[0], item[own[0]]
    if not isinstance(body, dict):
        raise ConfigError("must be a mapping", yaml_path=f"{where}.{kind}")
    _known(body, ("parent", "texts") if kind == "kl" else ("texts",), f"{where}.{kind}.")
    texts = _path(body.get("texts"), f"{where}.{kind}.texts", base_dir)
    if not Path(texts).is_file():
        raise ConfigError(f"no such file {texts}", yaml_path=f"{where}.{kind}.texts", hint="one text per line")
    parent = _path(body.get("parent"), f"{where}.kl.parent", base_dir) if kind == "kl" else None
    name = f"kl:{Path(parent).name}:{Path(texts).name}" if parent is not None else f"nll:{Path(texts).name}"
    return Task(kind, name, float(weight), kind, parent, texts)


def _flag(value: Any, yaml_path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError("must be true or false", yaml_path=yaml_path)
    return value


def _count(value: Any, yaml_path: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError("must be a whole number of 1 or more", yaml_path=yaml_path)
    return value

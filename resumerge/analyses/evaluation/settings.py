"""An evaluation's settings as one frozen object (the command's options), checked before anything is read."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from resumerge.analyses.evaluation.texttasks import TextTask, text_task
from resumerge.errors import UsageError
from resumerge.forward.engine.device import PassDevice

DEFAULT_SEEDS = "0,1234,1234,1234"  # lm-eval's --seed default: python's random, numpy, torch, the few-shot sampler
_SEED_NAMES = ("random", "numpy", "torch", "fewshot")


@dataclass(frozen=True)
class Seeds:
    """An evaluation's seeds, lm-eval's four (its ``--seed``): python's ``random``, ``numpy``'s, ``torch``'s (a
    sampled generation's draws: :mod:`.genrequests`), the ``fewshot`` sampler's; None leaves that one unset, as
    lm-eval leaves it."""

    random: int | None = 0
    numpy: int | None = 1234
    torch: int | None = 1234
    fewshot: int | None = 1234

    @classmethod
    def parse(cls, given: str | int | Seeds | None) -> Seeds:
        """``given`` as lm-eval's ``--seed`` reads it: one figure for all four, or three or four comma-separated
        (the missing fourth lm-eval's default), each an integer or ``None``; :class:`UsageError` (exit 2) else."""
        if given is None or isinstance(given, Seeds):
            return given if given is not None else cls()
        items = str(given).split(",")
        try:
            found = [None if item.strip().lower() == "none" else int(item.strip()) for item in items]
        except ValueError:
            found = []
        if not found or len(found) not in (1, 3, 4):
            raise UsageError(f"--seed {given} is not lm-eval's seeds", hint="give one integer for all four, or "
                             "four comma-separated (python's random, numpy, torch, few-shot), None to leave one unset")
        if len(found) == 1:
            found *= 4
        defaults = [None if item == "None" else int(item) for item in DEFAULT_SEEDS.split(",")]
        return cls(*(found + defaults[len(found):]))

    def words(self) -> str:
        """The seeds as ``--seed`` writes them."""
        return ",".join(str(getattr(self, name)) for name in _SEED_NAMES)


@dataclass(frozen=True)
class EvalSettings:
    """``tasks``: lm-eval task, group or tag names (or YAML paths), and ``check``'s figures as text tasks
    (``nll:FILE``, ``kl:PARENT:FILE``: :mod:`.texttasks`); ``include_path``: a folder of task YAMLs;
    ``limit``: at most this many documents per task (a fraction below 1: that share); ``num_fewshot``: examples
    in each prompt; ``apply_chat_template``: the model's chat template (a name picks one of several);
    ``log_samples``: keep each task's samples; ``output_path``: where lm-eval's results file (and the samples) go;
    ``max_memory``: the process's memory budget in bytes (None: the default); ``device``: where the layers run
    (``cpu``, ``cuda[:N]``: :mod:`resumerge.forward.engine.device`), with the GPU budget ``max_gpu_memory`` in bytes;
    ``seeds``: lm-eval's four seeds (a sampled generation draws from the torch one)."""

    tasks: tuple[str, ...]
    include_path: str | None = None
    limit: float | None = None
    num_fewshot: int | None = None
    apply_chat_template: bool | str = False
    log_samples: bool = False
    output_path: str | None = None
    max_memory: int | None = None
    device: str = "cpu"
    max_gpu_memory: int | None = None
    seeds: Seeds = Seeds()
    yaml_texts: tuple[TextTask, ...] = ()  # the text tasks that lm-eval task YAMLs describe (:mod:`.yamltasks`)

    def checked(self) -> EvalSettings:
        """These settings, or :class:`UsageError` (exit 2) naming the first wrong one."""
        if not self.tasks or any(not t.strip() for t in self.tasks):
            raise UsageError("--tasks names no task", hint="name lm-eval tasks, e.g. --tasks hellaswag,arc_easy")
        if self.limit is not None and not (self.limit > 0 and (self.limit < 1 or float(self.limit).is_integer())):
            raise UsageError(f"--limit {self.limit:g} is not a number of documents",
                             hint="give a whole number above 0, or a fraction between 0 and 1")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise UsageError(f"--num-fewshot {self.num_fewshot} is below 0", hint="give 0 or more examples")
        if self.include_path is not None and not Path(self.include_path).is_dir():
            raise UsageError(f"--include-path {self.include_path}: no such folder",
                             hint="name a folder of lm-eval task YAML files")
        self.pass_device()  # a device run refuses too, in its words (no GPU here: exit 2)
        if self.output_path is not None and Path(self.output_path).is_file():
            raise UsageError(f"--output-path {self.output_path} is a file", hint="name a folder (created if absent)")
        for task in self.text_tasks:
            task.checked()
        return self

    def pass_device(self) -> PassDevice:
        """Where the evaluation's passes run, read as every pass reads ``--device``."""
        return PassDevice.of(self.device, self.max_gpu_memory)

    @property
    def lm_tasks(self) -> tuple[str, ...]:
        """The names lm-eval runs (every task but the text tasks)."""
        own = {t.name for t in self.yaml_texts}
        return tuple(name for name in self.tasks if text_task(name) is None and name not in own)

    @property
    def text_tasks(self) -> tuple[TextTask, ...]:
        """The text tasks (``check``'s NLL and KL on a file of texts), in the order named, those written as task
        YAMLs (``yaml_texts``) included."""
        own = {t.name: t for t in self.yaml_texts}
        return tuple(t for t in (text_task(name) or own.get(name) for name in self.tasks) if t is not None)

    @property
    def whole_limit(self) -> int | float | None:
        """``limit`` as lm-eval takes it: a count as an int, a fraction as a float."""
        if self.limit is None:
            return None
        return int(self.limit) if self.limit >= 1 else float(self.limit)

    def command_words(self) -> list[str]:
        """The options as the command line writes them (what continues an interrupted evaluation)."""
        words = ["--tasks", ",".join(self.tasks)]
        if self.include_path is not None:
            words += ["--include-path", os.fspath(self.include_path)]
        if self.limit is not None:
            words += ["--limit", f"{self.limit:g}"]
        if self.num_fewshot is not None:
            words += ["--num-fewshot", str(self.num_fewshot)]
        if self.apply_chat_template is True:
            words.append("--apply-chat-template")
        elif self.apply_chat_template:
            words += ["--apply-chat-template", str(self.apply_chat_template)]
        if self.log_samples:
            words.append("--log-samples")
        if self.output_path is not None:
            words += ["--output-path", os.fspath(self.output_path)]
        if self.device != "cpu":
            words += ["--device", self.device]
        if self.max_gpu_memory is not None:
            words += ["--max-gpu-memory", str(self.max_gpu_memory)]
        if self.seeds != Seeds():
            words += ["--seed", self.seeds.words()]
        return words

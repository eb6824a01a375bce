"""Text tasks (:mod:`.texttasks`: ``check``'s NLL and KL on a file of texts) written as lm-eval task YAMLs, so that a
folder of task YAMLs (``--include-path``) names them beside lm-eval's own. lm-eval's YAML names a Python task class
with ``class: !function MODULE.CLASS`` (its ``PY_TASK`` route, built with the YAML's config); this is that class::

    task: wiki_nll
    class: !function resumerge.analyses.evaluation.yamltasks.TextsTask
    metric: nll          # or kl, with a parent
    texts: texts.txt     # one text a line, a path as the command line would give it
    parent: ./base       # kl only: a folder, GGUF file or hf://NAMESPACE/NAME[@REVISION]

lm-eval builds it while the tasks load (a bad config is refused then: one line, exit 2) and never runs it: the
evaluation takes it out of lm-eval's list and scores it on its own pass as ``nll:FILE`` or ``kl:PARENT:FILE``
would be, its results entry named by ``task``. Named on its own only (not from a group or a tag, whose other tasks
lm-eval runs)."""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from resumerge.analyses.evaluation.texttasks import KINDS, KL, OUTPUT_TYPE, TextTask
from resumerge.errors import UsageError

if TYPE_CHECKING:
    from resumerge.analyses.evaluation.tasks import LoadedTasks


class TextsTask:
    """The task class a text task's YAML names (see the module): its ``config.task`` and ``task_name`` as lm-eval's
    loader reads them, ``OUTPUT_TYPE`` :data:`~.texttasks.OUTPUT_TYPE`, and :attr:`text` the text task it
    describes (checked when built)."""

    OUTPUT_TYPE = OUTPUT_TYPE

    def __init__(self, config: Mapping[str, Any]) -> None:
        name = str(config.get("task") or "")
        self.config = SimpleNamespace(task=name)
        metric, texts, parent = config.get("metric"), config.get("texts"), config.get("parent")
        if metric not in KINDS:
            raise UsageError(f"task {name}: metric: must be one of {', '.join(KINDS)}, not {metric!r}",
                             hint="write metric: nll, or metric: kl with parent:")
        if not isinstance(texts, str) or not texts:
            raise UsageError(f"task {name}: texts: names no file", hint="write texts: FILE (one text a line)")
        if (metric == KL) != (parent is not None):
            raise UsageError(f"task {name}: {'kl needs a parent:' if metric == KL else 'nll takes no parent:'}",
                             hint="write parent: MODEL with metric: kl only")
        self.text = TextTask(metric, texts, None if parent is None else str(parent), name).checked()

    @property
    def task_name(self) -> str:
        return str(self.config.task)


def yaml_text_tasks(loaded: LoadedTasks, named: tuple[str, ...]) -> tuple[TextTask, ...]:
    """The text tasks among the tasks lm-eval loaded, each named on its own in ``named``; :class:`UsageError` (exit
    2) for one reached through a group or a tag."""
    found = []
    for name, kind in loaded.kinds.items():
        if kind != OUTPUT_TYPE:
            continue
        if name not in named:
            raise UsageError(f"task {name} is a text task (nll or kl) in a group or tag: lm-eval would run it",
                             hint=f"name it on its own: --tasks {name}")
        task = loaded.task(name)
        assert isinstance(task, TextsTask)
        found.append(task.text)
    return tuple(found)

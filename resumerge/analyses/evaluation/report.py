"""What an evaluation returns: lm-eval's own results object, with where it was written."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EvalReport:
    """``results``: lm-eval's results object as ``simple_evaluate`` returns it (``results`` → task → ``metric,filter``,
    ``configs``, ``versions``, ``n-shot``, ...; ``samples`` per task where samples were logged), the description of
    the machine (``pretty_env_info``, the versions: :mod:`.harness`) only where it was written; ``target``: the
    model as given; ``written``: the files ``--output-path`` wrote (lm-eval's results file and each task's
    samples); ``proof``: what proving the models' bytes against each pass's journal found, in one line (a file
    touched, an edit in ranges a pass had not read yet, a finished pass run again: :mod:`resumerge.forward.job.proof`),
    None where nothing is to be said."""

    target: str
    results: dict[str, Any] = field(repr=False)
    written: tuple[str, ...] = ()
    proof: str | None = None

    def metric(self, task: str, name: str, filter_name: str = "none") -> float:
        """One metric of one task (``acc``, ``acc_norm``, ``word_perplexity``, ...)."""
        return float(self.results["results"][task][f"{name},{filter_name}"])

    def to_json(self) -> dict[str, Any]:
        """lm-eval's results object without the samples (``--log-samples`` writes them to files), as plain JSON:
        what ``--json`` prints, as lm-eval's CLI prints it."""
        doc = {k: v for k, v in self.results.items() if k != "samples"}
        return dict(json.loads(json.dumps(doc, default=_plain, ensure_ascii=False)))

    def table(self) -> str:
        """lm-eval's results table (and its groups' table where tasks form groups)."""
        from lm_eval.utils import make_table

        text = make_table(self.results)
        if "groups" in self.results:
            text += "\n" + make_table(self.results, "groups")
        return str(text)


def _plain(value: Any) -> Any:
    """lm-eval's own conversion of what JSON does not hold (numpy numbers, sets, callables)."""
    from lm_eval.utils import handle_non_serializable

    return handle_non_serializable(value)

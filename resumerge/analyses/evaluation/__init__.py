"""``resumerge eval``: lm-evaluation-harness tasks on any model resumerge reads, one decoder layer at a time within the
memory budget, journaled so that a killed evaluation resumes with the same results.

lm-eval is the task library (tasks by name or from ``--include-path`` YAMLs, its requests, few-shot sampling, chat
templates, metrics, aggregation and results object); resumerge is the model: :mod:`.lm`'s ``lm_eval.api.model.LM``,
whose log-likelihood requests are tokenised as lm-eval's ``hf`` model tokenises them (:mod:`.requests`) and scored, all
requests of a pass together, by :mod:`.scorer` on the forward engine (:mod:`resumerge.forward`): each decoder layer is
read once per pass. :mod:`.run` drives an evaluation from the command's options to lm-eval's results, and
:mod:`.outputs` writes them as lm-eval's CLI does. ``check``'s NLL and KL are tasks too (``nll:FILE``,
``kl:PARENT:FILE``): :mod:`.texttasks` is the one owner of NLL and KL scoring on texts (``evolve``'s objectives call
it), :mod:`.textpass` its journaled pass, :mod:`.textwork` what ``eval`` prepares of one and how its figure joins
lm-eval's results. Generation (:mod:`.generate`) runs with transformers' KV cache where the whole model fits.

May import: config, errors, forward, inputs, machine, merge.store, merge.engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from resumerge.machine.torch_import import on_first_use

if TYPE_CHECKING:
    from resumerge.analyses.evaluation.report import EvalReport

__all__ = ["EvalReport"]

# ``EvalReport`` imported on first use: ``status`` reads this package's progress module without the report's
# dataclasses.
__getattr__ = on_first_use(__name__, {"EvalReport": ".report"})

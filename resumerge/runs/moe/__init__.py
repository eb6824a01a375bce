"""MoE upcycling: mergekit-moe configs (``base_model`` + ``experts``) planned as ordinary journaled merges.

The job of this package is to turn a mergekit-moe config and the opened inputs' headers into the same frozen
:class:`~resumerge.merge.plan.merge_plan.Plan` every merge runs as: base tensors and expert MLPs are copies (renamed
into ``experts.N`` or stacked into transformers' fused expert tensors), routers are computed by registered pure
tensor functions, and the engine executes and journals them like any other output tensor.

Files, by job: :mod:`.config` (schema and validation, from the YAML alone), :mod:`.outkinds` (the output
architectures, one record each: a new one is one more record), :mod:`.architectures` (which output kind, from the
inputs' config.json files), :mod:`.prepare` (open the inputs, run the forward pass, plan), :mod:`.planner` (the
tensors), :mod:`.experts` (expert tensors: copies, fused stacks, noise and scale, as registered methods),
:mod:`.routers` (router maths, as registered methods), :mod:`.prompts` (tokenising the prompts), :mod:`.forward`
(the prompt forward pass, one decoder layer at a time), :mod:`.hiddenpass` (a run's pass, beside the merge or
before it), :mod:`.passmain` (the process the prompt work runs in), :mod:`.passproc` (starting it and taking its
answer), :mod:`.passcost` (``plan``'s estimate of the pass), :mod:`.outconfig` (the output config.json) and
:mod:`.tokenizer` (the tokenizer with its pad token).

Chosen by :mod:`resumerge.api` (which tells a mergekit-moe config from a merge config) and run through the one
session path, :func:`resumerge.merge.engine.session.run_plan`; the engine never imports this package (the model card,
in :mod:`resumerge.merge.plan.modelcard`, reads a MoE plan's config through :func:`load_moe_text`). transformers is
imported only for the prompt gate modes, only in the prompt work's own process (:mod:`.passmain`, :mod:`.prompts`,
:mod:`.forward`): the run's process never holds it.

May import: errors, config, forward, inputs, machine, merge.methods, outputs, merge.plan (types, sharding...),
merge.store (the ledger read).
"""

from __future__ import annotations

from resumerge.runs.moe.config import MoeConfig, is_moe_text, load_moe_text

__all__ = ["MoeConfig", "is_moe_text", "load_moe_text"]

"""Tokenizer transplant (``resumerge tokensurgeon MODEL DONOR OUT``): MODEL's weights with DONOR's vocabulary, as
mergekit-tokensurgeon 0.1.5 makes them (same options, defaults and meanings), journaled and resumable.

Its job: match DONOR's tokens to MODEL's (exactly on normalized tokens, by bytes, by prefix: :mod:`.tokens`), plan the
output as a :class:`~resumerge.merge.plan.merge_plan.Plan` whose token embedding and head are computed by this package's
registered unit (:mod:`.units`) and whose other tensors are MODEL's copied as a passthrough merge copies them
(:mod:`.planner`), and approximate the rows of DONOR's tokens that MODEL lacks by pure functions (:mod:`.approximate`,
:mod:`.omp`) one batch of tokens at a time, each batch kept durably in the run's folder (:mod:`.batches`) so that a
killed run recomputes only the batch it was in. The output's tokenizer is DONOR's, adding around a text what MODEL's
adds (its BOS as DONOR's token of that row: :mod:`.adds`). The engine's one session path runs the plan unchanged.

May import: errors, config, machine, inputs, outputs, merge.plan, merge.methods, merge.vocab, forward (vocabs: what
a ``<0xNN>`` token stands for, read once for ``check`` and the byte match).
"""

__all__ = ["adds", "approximate", "batches", "omp", "planner", "prepare", "spec", "tokens", "units"]

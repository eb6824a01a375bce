"""The structure genome of ``resumerge evolve``: a search over a model's layer path (which of its decoder layers run, in
which order: repeated blocks, skipped ones, blocks of another model of its family, scaled ones), beside the parameter
genome CMA-ES searches.

:mod:`.genome` reads the genome (``genome: {kind: structure, model, grow, shrink, repeat, pattern, beam_width,
beam_depth, beam_edits, surrogate, sources, scales, swap, scale_search}``) and turns a candidate (a set of edits of the
base's layers: a block repeated, skipped or swapped, from a source, at a scale) into its layer path and the ``slices:``
passthrough config ``run`` merges; :mod:`.scoring` scores a candidate from the base's hidden states kept on disk
(:class:`~resumerge.runs.evolve.layercache.LayerCache`: only the layers after its departure from the base run);
:mod:`.search` decides the candidates (every single block within the constraints, then a beam over compositions of the
best), keeps each candidate's figures durably as it is scored, then CMA-ES over the front's scales where asked, and
writes the table, the size/score Pareto front and ``best.yml`` from them, the same bytes after any kill; :mod:`.lmtasks`
scores lm-eval's tasks from the same cache; :mod:`.surrogate` (optional, scikit-learn's gradient-boosted trees) ranks a
beam round's children so that only the best it predicts are scored.
"""

__all__ = ["genome", "lmtasks", "scoring", "search", "surrogate"]

"""``resumerge measure``: the Gram matrices of every linear's input, for every model of a merge config, over
calibration texts, for the data-aware merges (``regmean``, ``regmean_plus``).

:mod:`.run` makes every check first, then :mod:`.passes` runs each model (or, for RegMean++, the merged pass) on the
forward engine's journaled layer pass (:mod:`resumerge.forward`) one decoder layer at a time; :mod:`.grams` records
the Grams of a layer with hooks before its linears and journals the hidden states, so a killed measurement resumes
at the layer it reached with the same bytes, each model a placement of the forward engine's own
(:class:`~resumerge.forward.job.placement.Placement`) whose layers :class:`~.grams.GramWatch` records where they run;
the executor's seats run each model's pass (:meth:`resumerge.forward.placing.sites.Seats.each`: here one after another,
on Ray side by side on the forward engine's actor, ``--executor ray``, what it declares in :mod:`.onray`), the Grams
written and journaled here alike; :mod:`.status` reads a measurement folder for
``resumerge status`` without importing torch. The files' format (names, ``measure.json``) is
:mod:`resumerge.inputs.grams`, which the planner reads too. :func:`resumerge.api.measure` calls
:func:`~resumerge.analyses.measure.run.measure_grams`.

May import: errors, config, forward, inputs, machine, merge.methods, merge.store, outputs.

"""

from __future__ import annotations

from resumerge.analyses.measure.status import measure_status

__all__ = ["measure_status"]

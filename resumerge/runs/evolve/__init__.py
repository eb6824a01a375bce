"""``resumerge evolve``: search a merge's parameters with CMA-ES, resumable at any instant.

A mergekit-evolve config (:mod:`.spec`) names a genome — the models, the method, how finely the layers are split,
the filters — and the tasks that score a candidate. :mod:`.genome` turns the flat genotype the optimiser proposes
into the merge config mergekit-evolve would build from it (and the same for resumerge's own methods whose
parameters are numbers). :mod:`.strategy` drives ``cma``'s CMA-ES and keeps its state as plain arrays;
:mod:`.storage` owns STORAGE's files (the table, its CSV, ``best.yml``, the chart, the journal of every
candidate); :mod:`.objective` is the protocol that scores a generation of candidates and the weighting of their
tasks; :mod:`.streamed` scores a whole generation in one streamed pass for all its kl/nll tasks (:mod:`.generation`:
every candidate a merge never written, its layers merged in memory from one read of the parents' layer, each step
admitted by the RAM governor), and :mod:`.written` is the reference it is held to (each candidate merged by
``run``'s code into a journaled folder, then scored by :mod:`.scoring`);
:mod:`.budget` refuses up front a generation past ``--max-memory``, :mod:`.vocabs` a ``kl`` parent whose vocabulary
cannot meet the candidates' (one that can is measured over the tokens both hold, as ``eval`` measures it);
:mod:`.spread` spreads a generation's candidates over a Ray cluster's nodes (``--executor ray``); :mod:`.search`
drives a search from start to end; :mod:`.combined` is a parameter search then a structure search (:mod:`.shapes`)
over its best merge, each stage a search of its own in STORAGE.

May import: errors, config, analyses.evaluation, forward, inputs, machine, merge.methods, merge.engine, outputs.
"""

__all__ = [
           "analysis",
           "chart",
           "combined",
           "generation",
           "genome",
           "objective",
           "scoring",
           "search",
           "spec",
           "spread",
           "status",
           "storage",
           "strategy",
           "streamed",
           "vocabs",
           "written",
]

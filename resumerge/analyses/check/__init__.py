"""Does a merge work: ``resumerge check``'s static pass, its layer-streamed forward pass over the merge, its base and
its parents, and the verdict with the figures it compared.

:mod:`.models` finds the models (a resumerge output names its base and parents in its manifest), :mod:`.static`
compares the tensors (how far the merge moved from the base against its parents; non-finite values; shapes and
parameter counts), :mod:`.folded` takes those figures of the decoder layers' tensors from the forward pass's own
reads (each model read once), :mod:`resumerge.forward.text.texts` makes the token sequences, :mod:`.passes` runs every
model one decoder layer at a time on the forward engine's journaled pass (:mod:`resumerge.forward`), journaled per
layer in the state dir so a killed check resumes where it was (:mod:`.onray` runs each model's pass on a Ray node of
its own: ``--executor ray``; :mod:`.needs` finds what each step holds, for the local budget and each Ray actor's
declared memory), and :mod:`.heads` the heads at its end, streamed, :mod:`resumerge.forward.opening.hubreads` holds a
hub model's weights to the hub's checksums (each range journaled, each file read whole verified before the report, no
byte fetched twice), :mod:`.verdict` holds the thresholds and rules and :mod:`.report` the report's shape and JSON
(strict: :mod:`.strict`), :mod:`.vocabs` how models whose vocabularies differ are compared (over the tokens they
share), and :mod:`.card` writes a finished check's section into a resumerge output's model card.
:func:`~resumerge.analyses.check.run.run_check` does it all; :func:`resumerge.api.check` calls it.

May import: errors, config, forward, inputs, machine, merge.store (the ledger, the manifest, the status), merge.engine,
merge.vocab, outputs.

"""

from __future__ import annotations

from typing import TYPE_CHECKING

from resumerge.machine.torch_import import on_first_use

if TYPE_CHECKING:
    from resumerge.analyses.check.report import CheckReport

__all__ = ["CheckReport"]

# ``CheckReport`` imported on first use: ``status`` reads this package's progress module without the report's
# dataclasses.
__getattr__ = on_first_use(__name__, {"CheckReport": ".report"})

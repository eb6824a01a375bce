"""The importance matrix llama.cpp's quantizer weights its choices by (llama-imatrix's sums of each linear's
squared inputs), made by resumerge: from ``measure``'s Grams (``resumerge measure --imatrix OUT.gguf``: their
diagonals), or computed on a merge never written, from ``--imatrix-texts``, and used by the same run's K-quant
encoding.

:mod:`.entries` names each linear as llama.cpp names its weight in the GGUF the merge would be and writes llama.cpp's
GGUF imatrix (:func:`~resumerge.outputs.gguf.imatrix.imatrix_bytes`); :mod:`.sums` is the pass's layer step (a hook
before each linear adds the squares of its input; a mixture of experts' fused stacks per expert over the tokens routed
to it, :mod:`resumerge.forward.sums.routed`, which measure's Grams use too); :mod:`.onmerge` is the pass over the
unwritten merge as the forward driver runs it (:func:`resumerge.forward.job.driver.drive`), journaled under the state
dir so a killed pass resumes at the layer it reached with the same bytes.

May import: errors, config, forward, inputs, machine, merge.engine, outputs.
"""

from __future__ import annotations

__all__ = ["entries", "onmerge", "sums"]

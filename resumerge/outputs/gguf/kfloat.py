"""The float32 constants of llama.cpp's K-quant searches, written once for :mod:`.ksearch`'s numpy path and its
compiled twins (:mod:`.qkxloop`, :mod:`.qxloop`, :mod:`.klayout`), so that the compiled modules never import
:mod:`.ksearch` (which imports them).

A compiled kernel freezes the constants it reads when it is compiled, and numba's disk cache is keyed on the
kernel's own file: a change here must come with a change to the files that read them, or cached kernels keep
the old values.

May import: numpy only.
"""

from __future__ import annotations

import numpy as np

__all__ = ["EPS", "EXACT", "MAGIC", "TAME", "F"]

F = np.float32
EPS = F(1e-15)  # GROUP_MAX_EPS
MAGIC = F(12582912)  # 1.5 * 2**23: nearest_int's shift of the value into the mantissa
# |argument| up to which nearest_int is round half to even (np.rint); the bound is checked with float32 products
# of rounded factors, so it stays well under 4194303
TAME = F(4e6)
# |argument| up to which nearest_int is exactly round half to even (its mantissa trick's range)
EXACT = 4194303.0

"""The analyses: what resumerge learns from models by running them (check, measure, eval, the importance matrix) or
from a run before it runs (estimate), beside the kinds of run that write them.

A group: each package here is a layer of its own, with its own ``May import:`` line (tests/test_layout.py holds them
to it; no analysis imports another); this file imports nothing.

- :mod:`.check`: Does a merge work.
- :mod:`.estimate`: What a run will cost before it starts.
- :mod:`.evaluation`: ``resumerge eval``.
- :mod:`.importance`: The importance matrix llama.cpp's quantizer weights its choices by (llama-imatrix's sums of
  each linear's squared inputs), made by resumerge.
- :mod:`.measure`: ``resumerge measure``.
"""

__all__ = ["check", "estimate", "evaluation", "importance", "measure"]

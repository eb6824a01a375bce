"""Tests of the merge methods (resumerge.merge.methods), one module per method family."""

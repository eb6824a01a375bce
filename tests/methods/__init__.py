"""Tests of the merge methods (resumerge.methods), one module per method family."""

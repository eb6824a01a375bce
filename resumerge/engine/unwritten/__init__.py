"""A merge never written: a planned merge read as a model, each output tensor merged in memory by the plan's own
method code when a reader asks for its bytes, and dropped after.

Public API:

- :class:`UnwrittenMerge` ``(plan, config_text, root, *, inputs=None, resources=NO_RESOURCES, governor=None,
  name="merge", on_close=None)``: the merge as a stored model is opened: ``opened`` (a
  :class:`~resumerge.inputs.model.ModelInput`: ``directory`` with config.json and the tokenizer, ``config``,
  ``tensors`` where the plan puts them), ``source`` (the bytes of its weight files); a context manager. The
  forward engine reads it as a stored model with ``Weights.of(m.directory, m.tensors, source=m.source)``.
- :class:`MergedFiles` ``(plan, sources, resources=NO_RESOURCES, *, governor=None)``: the
  :class:`~resumerge.inputs.source.InputSource` of the files ``plan`` would write; a read of a stored tensor's
  bytes returns what ``run`` writes there.
- :func:`merged_tensor` ``(plan, tp, sources, resources, *, governor=None) -> Stored``: one output tensor's stored
  parts, computed as the run computes it for its shard.
- :func:`merge_folder` ``(plan, config_text, root) -> Path``: the folder of a merge's small files.

How a config becomes one: :func:`resumerge.api.open_unwritten`.

May import: errors, config, memory, methods, vocab, inputs, store, plan, outputs (the engine's own).
"""

from resumerge.engine.unwritten.compute import merged_tensor
from resumerge.engine.unwritten.merged import MergedFiles, stored_places
from resumerge.engine.unwritten.model import UnwrittenMerge, merge_folder

__all__ = ["MergedFiles", "UnwrittenMerge", "merge_folder", "merged_tensor", "stored_places"]

"""A merge never written: a planned merge read as a model, each output tensor merged in memory by the plan's own
method code when a reader asks for its bytes, and dropped after.

Public API:

- :class:`UnwrittenMerge` ``(plan, root, *, inputs=None, resources=NO_RESOURCES, governor=None,
  name="merge", on_close=None)``: the merge as a stored model is opened: ``opened`` (a
  :class:`~resumerge.inputs.model.ModelInput`: ``directory`` with config.json and the tokenizer, ``config``,
  ``tensors`` where the plan puts them), ``source`` (the bytes of its weight files); a context manager. The
  forward engine reads it as a stored model with ``Weights.of(m.directory, m.tensors, source=m.source)``.
- :class:`MergedFiles` ``(plan, sources, resources=NO_RESOURCES, *, governor=None)``: the
  :class:`~resumerge.inputs.source.InputSource` of the files ``plan`` would write; a read of a stored tensor's
  bytes returns what ``run`` writes there.
- :func:`merged_tensor` ``(plan, tp, sources, resources, *, governor=None) -> Stored``: one output tensor's stored
  parts, computed as the run computes it for its shard. :func:`merged_rows` ``(plan, tp, sources, resources, rows,
  *, governor=None, shared=None) -> Tensor | None``: some rows of a plain 2-D output tensor, merged for those rows
  alone where its method makes that exact (elementwise, or :attr:`~resumerge.merge.methods.spec.MethodSpec.rows`), the
  same bytes as those rows of the whole; :class:`MergedFiles` answers ``read_rows`` with it (a pass's input
  embeddings: only the rows its texts use).
- :func:`merge_folder` ``(plan, root) -> Path``: the folder of a merge's small files.
- :class:`Population` ``(plans, root, *, inputs=None, resources=NO_RESOURCES, governor=None)``: a generation of
  candidate merges over the same inputs, read in one streamed pass: ``candidates`` (an :class:`UnwrittenMerge`
  each), ``layer()`` (the block in which one layer of every candidate is read: each input byte range read once),
  ``shared`` (a :class:`SharedReads`: ``reads`` and ``bytes_read`` from the inputs, ``peak_kept``), ``loaded`` (a
  :class:`LayerInputs`: each chunk's loaded inputs and its method's declared values of them, computed once for every
  candidate; ``enabled``, ``computed``, ``reused``, ``peak_kept``), ``holds(popsize=None, hidden_bytes=0,
  value_bytes=4, *, shared=None) -> int`` and ``largest_popsize(budget, hidden_bytes, value_bytes=4, *,
  shared=None) -> int`` (judged as the pass holds it: with what ``loaded`` keeps where it is enabled); a context
  manager.
- :func:`generation_bytes` ``(plans, popsize, hidden_bytes=0, value_bytes=4, *, shared=False) -> int``: what a
  generation's pass holds at most (``shared``: with what ``loaded`` keeps); :func:`largest_popsize` ``(plans,
  budget, hidden_bytes, value_bytes=4, *, shared=False) -> int``: the largest popsize that fits ``budget``.

How configs become one: :func:`resumerge.api.open_unwritten` and :func:`resumerge.api.open_population`.

May import: errors, config, machine, merge.methods, merge.vocab, inputs, merge.plan, outputs (the engine's own).
"""

from resumerge.merge.engine.unwritten.compute import merged_rows, merged_tensor
from resumerge.merge.engine.unwritten.merged import MergedFiles, stored_places
from resumerge.merge.engine.unwritten.model import UnwrittenMerge, merge_folder
from resumerge.merge.engine.unwritten.population import (
    LayerInputs,
    Population,
    SharedReads,
    generation_bytes,
    largest_popsize,
    layer_of,
    same_inputs,
)

__all__ = ["LayerInputs", "MergedFiles", "Population", "SharedReads", "UnwrittenMerge", "generation_bytes",
           "largest_popsize", "layer_of", "merge_folder", "merged_rows", "merged_tensor", "same_inputs",
           "stored_places"]

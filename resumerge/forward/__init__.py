"""The layer-streamed forward engine and the one journaled layer pass every analysis runs on.

The engine: a model's modules built without weights, each decoder layer given its weights (read through the codecs)
only while it runs. The modules are transformers' own for the model's architecture, or, for the common dense
families (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma, Gemma 2, Gemma 3's text model), :mod:`.native`'s, which
compute the same numbers to the bit without importing transformers (a fresh process's start, paid again by every
resumed pass, 2.5 s shorter). :mod:`.reader` reads a model's logical tensors (plain or quantized) in the compute
dtype, :mod:`.stream` builds the modules and runs the embeddings, one decoder layer, and the final norm with the
head (logits). A pass's "layers" are the forward's decoder-layer calls in its order (:mod:`.calls`: a forward that
loops some layers, Dory's, HRM's, calls them several times, each call a step of the pass), from one list of layers or
several (:mod:`.layerlists`). transformers is imported only inside the functions that need it, in the process that
runs the pass, and only where :mod:`.native` does not build the modules.

The pass (one home for ``check``, ``measure``, the MoE hidden-state gates, and any new client such as ``eval``):

- **Batches** (:mod:`.batches`): :func:`~.batches.enter` pads the token sequences into batches (longest first, up to
  :data:`~.batches.BATCH_TOKENS` padded tokens each, right-padded with the attention mask) and gets each model's
  hidden states entering its first layer from the placement, falling back to one sequence a batch where the
  family's first layer cannot run a padded batch; :func:`~.batches.one_by_one` for a client whose sums run over
  padding too. Hidden states travel as ``Hidden``: per model, per batch.
- **Placement** (:mod:`.placement`): a :class:`~.placement.Placement` says where the models run (``enter``,
  ``runs_batched``, ``layer``): :class:`~.placement.Streams` in this process, one layer of one model at a time,
  each admitted by the pass's ``reserve`` and observed by an optional :class:`~.placement.Watch`; a Ray cluster
  places an actor per model behind the same protocol (:mod:`resumerge.forward.rayactor`), which runs a
  :class:`~.placement.NodeWatch` on the node and hands what it found back (``measure``'s Grams; ``measure`` runs
  each model as a placement of its own, each resuming at its own layer). Where the run's executor places a pass is
  its site (:mod:`.sites`: one class per executor, found by the executor's name), which a pass asks what differs.
- **The step** (:mod:`.layerpass`): a client subclasses :class:`~.layerpass.Step`: ``layer(index, hidden)`` runs
  (through its placement, or its stream) and observes decoder layer ``index`` and returns the hidden states leaving
  it; ``kept(index)`` is what to journal beside them (tensors, metadata); ``restore(restart)`` puts that back on a
  resume; ``stopped()`` ends the pass early; ``finish(hidden)`` is what to do after the last layer (a client's
  heads: :func:`resumerge.forward.heads.logprobs` streams each batch's log-probabilities from the final
  hidden states).
- **The journal and its loop** (:mod:`.journal`, :class:`~.layerpass.LayerPass`): ``LayerPass(Journal(folder,
  prefix), layers, point, carries).run(step, entering, batches)`` restarts from the journal's last file, loops over
  the layers, saves each layer's file durably (temp file, fsync, rename, directory fsync) with what its layers hand
  later ones (``carries``: whoever holds the layers' calls, a placement or :class:`~.handed.Held`; :mod:`.handed`),
  deletes the older one (or keeps it: ``Journal.keeps_older``), reaches the kill point ``point``
  (:mod:`resumerge.machine.killpoints`), and returns ``step.finish``. The one reader and the one writer of every
  pass's journal.
- **Admission** (:mod:`.admission`): :class:`~.admission.Admission` is a ``reserve(what, step)`` holding each
  step's bytes from the RAM governor for as long as the step runs.
- **The proof** (:mod:`.proof`): :class:`~.proof.PassProof` records, beside a pass's journal, an xxh3-128 per decoder
  layer of the bytes the pass reads of each local weight file and how the file looked; asked again, a file that
  looks the same is trusted without a read (a repeated check answers from its report), one that does not is hashed
  again, and a change in a layer the journal holds refuses the pass (exit 4, the file named).
- **The lock** (:func:`~.folder.pass_lock`): one process per pass folder (an exclusive flock, which vanishes with
  the process); a second is refused naming the first.
- **The threads** (:mod:`.threads`): the torch thread count a pass computes with, decided as it first starts and kept
  in its folder, applied again by the process that resumes it (a float's bits depend on it).
- **The driver** (:mod:`.driver`): a pass is a job (:class:`~.driver.PassJob`: its folder, answer cache, proof,
  fit, run, end and Ctrl-C's words), and :func:`~.driver.drive` runs every one in the same order: the lock, the
  answer cache, the threads, the proof, the fit, admission, the loop, the end; Ctrl-C raises ``InterruptedMerge``
  naming where it stopped and the command that continues it. A new pass writes its job, not its orchestration.
- **The models and the texts**, each with one owner: :func:`~.opened.open_for_pass` opens a model for a pass (a
  local folder, ``hf://`` repo, GGUF file or split set, a GGUF file of a hub repo; headers only),
  :class:`~.hubreads.PassReads` holds a hub model's ranges to the hub's checksums, :mod:`.texts` makes the token
  sequences (built-in texts, a prompts file, the context rule) and loads the tokenizer
  (:func:`~.texts.tokenizer_at`), and :func:`~.requires.require_transformers` is the one "is transformers here"
  check, in each client's words.

May import: errors, config, inputs, machine, merge.plan (input references only), merge.store (the ledger, as the
journal of a pass's hub reads), merge.engine (the unwritten merge), merge.vocab, outputs.
"""

from __future__ import annotations

from resumerge.forward.journal import durable_save
from resumerge.forward.reader import CastReader, Location, Weights, base_formats, pass_bytes, step_sizes

__all__ = ["CastReader", "Location", "Weights", "base_formats", "durable_save", "pass_bytes", "step_sizes"]

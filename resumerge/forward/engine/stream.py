"""One model streamed through its modules — transformers' own, or :mod:`.native`'s for the families they build —
built on the meta device, its embeddings, each decoder layer and its head given their weights only while they run.

What each decoder layer is called with (the causal or sliding-window mask, the rotary embeddings of its attention
type, the positions, the cache argument under this transformers' name) is taken from the model's own forward, run
once per token sequence with the decoder layers replaced by stubs that record their arguments: the family's mask
and position code is transformers', never rewritten here. The head is the causal-LM class's own forward (its
final-logit soft-capping included) over the final norm's output. Hidden states a forward holds positions first
(XLNet's) are held batch first, each layer given them as its forward does; a cache a forward makes unasked (XLM's)
is given to no layer (each would write its keys into it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from resumerge.errors import ModelInputError
from resumerge.forward.engine.built import build_modules, native_reads_all, quiet_loading
from resumerge.forward.engine.calls import call_order, in_order, looped, steps_of
from resumerge.forward.engine.device import moved
from resumerge.forward.engine.handed import (
    HIDDEN,
    entered,
    given,
    handed_on,
    handing,
    hidden_of,
    plain,
    read_by_name,
)
from resumerge.forward.engine.layerlists import Parts, first_list, innermost, layer_lists
from resumerge.forward.engine.multimodal import head_site, renamed, stored_prefixes, text_model
from resumerge.forward.engine.native import NativeConfig
from resumerge.forward.engine.reader import CastReader, Weights, base_formats
from resumerge.forward.engine.standins import (
    AS_BUILT,
    BY_ATTRIBUTE,
    LayerCall,
    fed_to,
    ids_back,
    recorded,
    stand_ins,
    unasked_cache_dropped,
)
from resumerge.forward.engine.tail import (
    Tail,
    final_names,
    positions_first,
    shaped,
    tail_names,
    weighted_parts,
)
from resumerge.inputs.stacks import not_causal, not_layer_by_layer
from resumerge.machine.torch_import import torch

# check and measure read models (their tokenizers, the families the native modules do not build) with transformers:
# the clone's ``check`` extra, not the ``moe`` one that MoE gates name.
# The shapes of a decoder layer's output the capture tries: the hidden states alone, then a tuple of them and
# ``n - 1`` more values (GLM-5's top-k indices, handed to the next layer: .handed), as the family's forward unpacks it,
# then an object whose attributes it reads (Reformer's two streams),
# then the layer's own output's shape, each extra output a slot or None where the layer returns None (XLNet's query
# stream, which its forward tests for None after the last layer)
_OUTPUT_ARITIES = (0, 1, 2, 3, BY_ATTRIBUTE, AS_BUILT)

Placed = TypeVar("Placed")
# More of the base model's forward arguments for each batch :meth:`ModelStream.inputs` runs (None: none).
Given = Sequence[Mapping[str, Any]] | None


def _more(given: Given, batch: int) -> Mapping[str, Any] | None:
    return None if given is None else given[batch]


def _doc(text: Any) -> Mapping[str, Any]:
    """A text config as a mapping (transformers' as its ``to_dict``; a native one's as its fields)."""
    found: Mapping[str, Any] = (text.to_dict() if callable(getattr(text, "to_dict", None))
                                else dict(getattr(text, "__dict__", {})))
    return found


class ModelStream:
    """A model's modules without weights, read from ``weights`` in ``dtype`` as each part runs.

    ``key`` names the model in the codecs' errors; ``built`` is what :func:`build_modules` returned for it, when
    the caller built them already (the MoE pass's checks do, before it reads a weight). ``device``: where each
    decoder layer and the head run (``cuda:N``: moved there while they run, the hidden states kept there; see
    :mod:`.device`); the embeddings and each layer's call are made on the host and moved there once.
    Close it (or use it as a context manager) to close its files.
    """

    def __init__(self, weights: Weights, config_doc: Mapping[str, Any], dtype: torch.dtype, *, what: str,
                 key: str = "model", built: tuple[Any, Any] | None = None, device: str = "cpu") -> None:
        self.dtype = dtype
        self.device = torch.device(device)
        self.config, self.model = built if built is not None else build_modules(weights.directory, dtype, what=what)
        self.formats = base_formats(weights.tensors, config_doc, weights.directory)
        self.reader = CastReader(weights, self.formats, dtype, key=key)
        if isinstance(self.config, NativeConfig) and not native_reads_all(self.model, self.reader,
                                                                           self.config.tie_word_embeddings):
            # tensors the native modules do not find (a checkpoint laid out otherwise): transformers' conversion
            self.config, self.model = build_modules(weights.directory, dtype, what=what, native=False)
        self.model.eval()  # from_config leaves it training: dropout would draw at random
        self.inner = text_model(self.model.base_model)  # a multimodal model's language model
        text = self.config.get_text_config()
        why = not_causal(getattr(text, "model_type", None), _doc(text))
        if why:  # (its forward may well be followed: what it gives is no next-token prediction)
            raise ModelInputError(f"cannot follow {type(self.inner).__name__}'s forward one layer at a time: "
                                  f"{text.model_type} {why}")
        # whether the layers' hidden states hold the positions first, the batch second (XLNet's): the pass holds
        # them batch first, as the tokens, each layer given them as its forward does (set by each capture)
        self.positions_first = False
        self._names = {id(m): n for n, m in self.model.named_modules()}
        self.holder, self.stack = layer_lists(self.inner, self.config.get_text_config(), self.model,
                                              self._not_a_stack())  # (the pass's steps: their calls, .calls)
        # what the base model applies to the last layer's output, in order (the final norm), each by the module
        # whose forward applies it: the one holding the layers first, then each above it (RoBERTa-PreLayerNorm's
        # LayerNorm is the base model's, its layers its encoder's)
        path = self._path_to_layers()
        self._finals_at: list[tuple[torch.nn.Module, str]] = []
        # those it applies before the layers too (NanoChat's norm, before and after them): run with the embeddings
        self._late: list[tuple[torch.nn.Module, str]] = []
        used: list[tuple[torch.nn.Module, str]] = []  # every module it uses after the layers, however
        opaque = False  # whether the layers' holder does more there than apply the finals (Gemma 3n's streams)
        for owner, inside in reversed(list(zip(path, [*path[1:], innermost(self.stack)]))):
            early = tail_names(owner, inside, before=True)
            finals = final_names(owner, inside, rebinds=owner is not self.holder)
            for name in finals:
                self._finals_at.append((owner, name))
                if name not in early:
                    self._late.append((owner, name))
            used += [(owner, n) for n in tail_names(owner, inside)]
            opaque = opaque or (owner is self.holder and bool(set(tail_names(owner, inside)) - set(finals)))
        self.finals: tuple[torch.nn.Module, ...] = tuple(getattr(o, n) for o, n in self._finals_at)
        # where it does more than that, or where the layers' hidden states are not the tokens' (CPM-Ant's hold its
        # prompt's positions first), the forward itself is run after the layers (.tail), with what it uses there
        self._tail_parts = tuple(getattr(o, n) for o, n in used)
        lists = tuple(getattr(self.stack, "lists", (self.stack,)))
        self.tail = Tail(self.inner, self.stack, weighted_parts(self.inner, lists, (*lists, *self._tail_parts)),
                          self._tail_parts)
        self.order = call_order(self.tail, len(self.stack))
        self.layers_list: list[torch.nn.Module] = steps_of(self.stack, self.order)
        self.layers = len(self.layers_list)
        # the finals a capture stands in for by their input, unread: none where the forward loops its layers (it
        # may apply them between calls: Dory's norm as each loop starts, computed again from the pass's outputs)
        self._unread = [] if looped(self.order) else self._late
        self._opaque = opaque
        self._stored = stored_prefixes(self.model, self.inner, self.formats.logical())

    def prefix(self, module: torch.nn.Module) -> str:
        """The checkpoint prefix of ``module``'s tensors (``model.layers.3.``)."""
        name = self._names[id(module)]
        return renamed(f"{name}.", self._stored) if name else ""

    # -- weights in and out --------------------------------------------------------------------------------

    def load(self, module: torch.nn.Module, *, tied_head: bool = False,
             read: Callable[[str], torch.Tensor] | None = None, host: bool = False) -> torch.nn.Module:
        """``module`` with its weights read (its buffers are kept: built for real, see :func:`weights_on_meta`),
        on the stream's device (``host``: on the host whatever the device: the parts that run before the layers);
        ``tied_head``: the head, read from the embeddings where the checkpoint holds no head; ``read``: where each
        weight comes from by checkpoint name, instead of this model's files (a merge of several models' weights).
        A module some of whose weights the checkpoint lacks, or stores in another shape (Qwen3-VL-MoE's expert
        stacks, transposed on the hub), is loaded through transformers' conversion (:meth:`_converted`)."""
        loaded = self._read_into(module, tied_head, read)
        return loaded if host else self._on_device(loaded)

    def _on_device(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module``'s weights and buffers moved to the stream's device (nothing done on the host: the same
        tensors). Each weight's host copy is let go as its device copy replaces it."""
        if self.device == torch.device("cpu"):  # as :func:`~.device.moved` decides
            return module
        for child in module.modules():
            for name, param in child.named_parameters(recurse=False):
                if not param.is_meta and param.device != self.device:
                    child._parameters[name] = torch.nn.Parameter(param.to(self.device), requires_grad=False)
            for name, buffer in child.named_buffers(recurse=False):
                if buffer.device != self.device:
                    child._buffers[name] = buffer.to(self.device)
        return module

    def placed(self, value: Placed) -> Placed:
        """``value`` (the hidden states entering the layers, their calls) on the stream's device
        (:func:`~.device.moved`)."""
        found: Placed = moved(value, self.device)
        return found

    def _read_into(self, module: torch.nn.Module, tied_head: bool,
                   read: Callable[[str], torch.Tensor] | None) -> torch.nn.Module:
        """:meth:`load`'s reading, on the host."""
        prefix = self.prefix(module)
        keys = self._keys(module, tied_head)
        for key, shape in keys.values():  # all checked before any is read: none is read twice
            if not self.reader.holds(key, shape):
                if read is not None:
                    raise ModelInputError(f"{key} is stored under another name or shape: a merged forward "
                                          "cannot read it", path=str(self.reader.directory), tensor=key)
                return self._converted(module, prefix)
        state = {name: self.reader.read(key) if read is None else read(key) for name, (key, _) in keys.items()}
        module.load_state_dict(state, strict=False, assign=True)
        return module

    def reads(self, module: torch.nn.Module) -> list[str] | None:
        """The checkpoint's tensors :meth:`load` reads ``module``'s weights from, each once, in its order; None where
        it loads them through transformers' conversion (some are stored under another name or shape)."""
        keys = self._keys(module, False).values()
        return [key for key, _ in keys] if all(self.reader.holds(key, shape) for key, shape in keys) else None

    def _keys(self, module: torch.nn.Module, tied_head: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Each of ``module``'s weights' checkpoint name and shape, by parameter name; a tied head's weight is the
        input embedding's, its bias its own (CTRL's, ModernBERT's decoder); a weight the checkpoint does not hold
        that transformers ties to another is that one (BERT's decoder bias, Zamba's shared block in each layer)."""
        own, embedding = self.prefix(module), self.prefix(self.model.get_input_embeddings())
        ties = getattr(self.model, "all_tied_weights_keys", None) or {}
        built = self._names[id(module)]
        keys = {}
        for name, param in module.named_parameters():
            key, shape = (embedding if tied_head and name == "weight" else own) + name, tuple(param.shape)
            source = ties.get(f"{built}.{name}" if built else name)
            if source is not None and not self.reader.holds(key, shape):
                key = renamed(source, self._stored)
            keys[name] = (key, shape)
        return keys

    def _converted(self, module: torch.nn.Module, prefix: str) -> torch.nn.Module:
        """``module`` loaded through transformers' own checkpoint conversion, for a checkpoint that names or
        shapes its tensors otherwise (experts stored one by one that the modules hold fused, a renamed head): the
        checkpoint's tensors under ``prefix`` (none there: every tensor outside the decoder layers) converted as
        ``from_pretrained`` converts them. Whatever else the conversion loaded is dropped again."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        names = [n for n in self.formats.logical() if n.startswith(prefix)]
        if not names:
            layers = self.prefix(first_list(self.stack))
            names = [n for n in self.formats.logical() if not n.startswith(layers)]
        mine = {id(m) for m in module.modules()}  # the conversion sets new parameters: known by their module
        others = [m for m in self.model.modules() if id(m) not in mine]
        before = {(id(m), n) for m in others for n, p in m.named_parameters(recurse=False) if not p.is_meta}
        config = LoadStateDictConfig(dtype=self.dtype, weight_mapping=get_model_conversion_mapping(self.model))
        with quiet_loading():  # its "Loading weights" bar, once a layer of every model, is not the user's news
            convert_and_load_state_dict_in_model(self.model, {n: self.reader.read(n) for n in names}, config)
        for child in others:
            for name, param in child.named_parameters(recurse=False):
                if (id(child), name) not in before and not param.is_meta:
                    child._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=False)
        missing = [n for n, p in module.named_parameters() if p.is_meta]
        if missing:
            raise ModelInputError(f"{type(self.model).__name__} has {prefix}{missing[0]}, which neither the "
                                  "checkpoint nor transformers' conversion of it gives; a layer-by-layer pass "
                                  "cannot read this family yet", path=str(self.reader.directory),
                                  tensor=prefix + missing[0])
        return module

    @staticmethod
    def unload(module: torch.nn.Module) -> None:
        """Drop ``module``'s weights (its buffers stay)."""
        for child in module.modules():
            for name, param in child.named_parameters(recurse=False):
                child._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=False)

    @contextmanager
    def loaded(self, module: torch.nn.Module, *, tied_head: bool = False,
               read: Callable[[str], torch.Tensor] | None = None) -> Iterator[torch.nn.Module]:
        """``module`` with its weights (from ``read`` when given, see :meth:`load`) on the stream's device for the
        block, without them after."""
        try:
            yield self.load(module, tied_head=tied_head, read=read)
        finally:
            self.unload(module)

    def _before_layers(self) -> list[torch.nn.Module]:
        """The base model's parts that run before the decoder layers and hold weights (embeddings, positions)."""
        lists = tuple(getattr(self.stack, "lists", (self.stack,)))
        return weighted_parts(self.inner, lists, (*lists, *(getattr(o, n) for o, n in self._unread)))

    def _around_head(self) -> list[torch.nn.Module]:
        """The final norm, and whatever else of the causal-LM class's runs around its head and holds weights
        (ModernBERT's lm_head, BERT's prediction transform beside its decoder), the head itself not."""
        site, attribute = head_site(self.model, self.inner)
        head = self.model.get_output_embeddings()
        return [*(self._tail_parts if self._tailed() else self.finals),
                *weighted_parts(site, head, (getattr(site, attribute), head))]

    def _tailed(self) -> bool:
        """Whether the base model's forward is run after the layers (:class:`~.tail.Tail`), not its finals."""
        return self._opaque or self.tail.reshapes(self.device)

    def _path_to_layers(self) -> list[torch.nn.Module]:
        """The base model and each of its modules down to the one holding the decoder layers."""
        name = self._names[id(self.holder)][len(self._names[id(self.inner)]):].strip(".")
        parts = name.split(".") if name else []
        return [self.inner.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1)]

    # -- running ------------------------------------------------------------------------------------------

    def inputs(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
               read: Callable[[str], torch.Tensor] | None = None, given: Given = None
               ) -> list[tuple[torch.Tensor, list[LayerCall]]]:
        """For each batch of token sequences (ids and attention mask, both (batch, length)), the hidden states
        entering the first decoder layer and every layer's call, as the model's own forward makes them (the
        embeddings read for this, from ``read`` when given (see :meth:`load`), dropped after), made on the host and
        moved to the stream's device (:meth:`placed`). ``given``: more of the forward's arguments, per batch (a
        generation's KV cache: :mod:`resumerge.analyses.evaluation.streamgen`)."""
        parts = self._before_layers()
        for part in parts:
            self.load(part, read=read, host=True)
        own = self._own_weights(read)  # the base model's own (Zaya's input scale and bias)
        try:
            return self.placed([self.capture(ids, mask, more=_more(given, b))
                                for b, (ids, mask) in enumerate(batches)])
        finally:
            for part in parts:
                self.unload(part)
            for name in own:
                self.inner._parameters[name] = torch.nn.Parameter(own[name].to("meta"), requires_grad=False)

    def _own_weights(self, read: Callable[[str], torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The base model's weights of its own (of no child module), read in place (from ``read`` when given)."""
        prefix = self.prefix(self.inner)
        found = {name: (self.reader.read if read is None else read)(prefix + name)
                 for name, _ in self.inner.named_parameters(recurse=False)}
        for name, value in found.items():
            self.inner._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
        return found

    def inputs_of_rows(self, batches: list[tuple[torch.Tensor, torch.Tensor]], block_bytes: int = 4 << 20,
                       given: Given = None) -> list[tuple[torch.Tensor, list[LayerCall]]]:
        """:meth:`inputs`, holding of the input embeddings only the rows of the tokens the batches use: the
        table read ``block_bytes`` at a time, the rows kept, the ids renumbered to them (the same hidden states:
        each is a copy of its token's row; the table's pad index, which need not be among them, set aside). Only
        where the embeddings are all that runs before the layers and a plain table a block of which can be read
        alone, or whose source gives those rows alone
        (:meth:`~resumerge.forward.engine.reader.CastReader.read_rows`: a merge never written merges only them); else as
        :meth:`inputs`."""
        embed = self.model.get_input_embeddings()
        key = self.prefix(embed) + "weight" if isinstance(embed, torch.nn.Embedding) else ""
        stored = self.formats.stored.get(key)
        if (self._before_layers() != [embed] or [n for n, _ in embed.named_parameters()] != ["weight"]
                or any(True for _ in self.inner.parameters(recurse=False))
                or stored is None or len(stored.entry.shape) != 2):
            return self.inputs(batches, given=given)
        vocab, width = stored.entry.shape
        used = torch.unique(torch.cat([ids.reshape(-1) for ids, _ in batches]))
        if int(used[0]) < 0 or int(used[-1]) >= vocab:  # the embedding's own error, as without this
            return self.inputs(batches, given=given)
        if self.reader.spannable(key):
            rows = torch.empty(len(used), width, dtype=self.dtype)
            step = max(1, block_bytes // (width * 4))
            for start in range(0, vocab, step):
                stop = min(start + step, vocab)
                inside = (used >= start) & (used < stop)
                if bool(inside.any()):
                    block = self.reader.read_span(key, start * width, stop * width).view(stop - start, width)
                    rows[inside] = block[used[inside] - start]
                    del block
        else:  # rows its source computes alone (a merge never written merges only them), or the whole table
            found = self.reader.read_rows(key, used)
            if found is None:
                return self.inputs(batches, given=given)
            rows = found
        before, pad = dict(embed._parameters), embed.padding_idx
        embed._parameters["weight"] = torch.nn.Parameter(rows, requires_grad=False)
        # the pad row's index is the whole table's, which the rows kept need not reach (a pad id above every token
        # the texts use: torch refuses it); it only keeps that row's gradient at zero, and a pass takes none (the
        # forward value of every id is its row), so the renumbered table runs without one
        embed.padding_idx = None
        try:
            entering = []
            for b, (ids, mask) in enumerate(batches):
                renumbered = torch.searchsorted(used, ids)
                hidden, calls = self.capture(renumbered, mask, more=_more(given, b))
                entering.append((hidden, [ids_back(call, renumbered, ids) for call in calls]))
            return self.placed(entering)
        finally:
            embed._parameters.update(before)
            embed.padding_idx = pad

    def capture(self, ids: torch.Tensor, mask: torch.Tensor, embeds: torch.Tensor | None = None,
                 more: Mapping[str, Any] | None = None) -> tuple[torch.Tensor, list[LayerCall]]:
        """The hidden states entering the first layer and every layer's call for ``ids`` (or, given, the input
        embeddings ``embeds`` of those ids, with no embedding run: none needs its weights)."""
        given = {"input_ids": ids} if embeds is None else {"inputs_embeds": embeds}
        real_layers = list(self.stack)
        failed = ""
        # (what the forward after the layers may read; the ids it embeds: XLNet's, positions first)
        with recorded(self.model.get_input_embeddings()) as embedded, fed_to(self.model.get_input_embeddings()) as fed:
            for arity in (AS_BUILT,) if isinstance(self.stack, Parts) else _OUTPUT_ARITIES:
                calls: list[list[LayerCall]] = [[] for _ in real_layers]
                captured, order = stand_ins()[0], list[int]()
                stubs = [captured(c, arity, layer, order, i, shaped) for i, (c, layer) in enumerate(zip(calls,
                                                                                                     real_layers))]
                embedded.clear()
                fed.clear()
                try:
                    for i, stub in enumerate(stubs):
                        self.stack[i] = stub
                    for owner, name in self._unread:
                        setattr(owner, name, stand_ins()[2](getattr(owner, name)))
                    with torch.no_grad():
                        # every hidden state asked for: Gemma 4 otherwise cuts its key-sharing layers' inputs to the
                        # last position (its logits_to_keep shortcut), which transformers 5.24 fails at without
                        # per-layer inputs, and which would leave those layers one position to run
                        out = self.inner(**given, attention_mask=mask, output_hidden_states=True,
                                         **{"use_cache": False, **(more or {})})
                except (ValueError, TypeError, IndexError, AttributeError) as exc:  # the forward unpacks it otherwise
                    # (the tuples' last failure says more than an object's read by attribute, or a layer's own shape's)
                    failed = (failed if arity in (BY_ATTRIBUTE, AS_BUILT) and failed
                              else f": {type(exc).__name__}: {exc}")
                    continue
                finally:
                    for i, layer in enumerate(real_layers):
                        self.stack[i] = layer
                    for (owner, name), final in zip(self._finals_at, self.finals):
                        setattr(owner, name, final)  # (the late ones' stand-ins undone)
                found = in_order(order, self.order, stubs)  # (each call of a looped layer a step of its own)
                if found is None:
                    continue
                step_calls, made, outs, seen = found
                step_calls = [unasked_cache_dropped(call, more) for call in step_calls]
                first = plain(seen[0])
                self.positions_first = positions_first(first, ids if embeds is None else embeds, fed)
                made, outs = read_by_name(made, outs, seen)  # (outputs read by attribute: Reformer's two streams)
                if embeds is None and self._tailed():  # what its forward after the layers reads, kept for its tail
                    self.tail.keep(out, embedded, outs)
                elif embeds is None:  # a last hidden state the forward computes from more than the last output
                    self.tail.derives(out, outs)
                # a layer's extra outputs go in its slots, for a later call (GLM-5's top-k indices); what the forward
                # computes from outputs is computed again from the pass's (Inkling 2's block states, a loop's start)
                return (first.transpose(0, 1).contiguous() if self.positions_first else seen[0],
                        handing(step_calls, made, outs, seen))
        why = self._not_a_stack()
        raise ModelInputError(f"cannot follow {type(self.inner).__name__}'s forward one layer at a time"
                              + (why or failed))

    def _not_a_stack(self) -> str:
        """Why a family's forward is no stack of layers a pass can follow one at a time, as a clause ('' where not
        known): its model type's (:mod:`resumerge.inputs.stacks`)."""
        text = self.config.get_text_config()
        why = not_layer_by_layer(getattr(text, "model_type", None), _doc(text))
        return f": {text.model_type} {why}" if why else ""

    def run(self, layer: torch.nn.Module, hidden: torch.Tensor, call: LayerCall, *, hand_on: bool = True
            ) -> torch.Tensor:
        """``layer``'s output for ``hidden`` (the previous call's output: what the forward gives a call from it, a
        loop's start, is computed again, :func:`~.handed.entered`) under ``call``: what earlier layers handed it
        given, its own extra outputs put in the call's slots for later layers unless ``hand_on`` is False (the layer
        run on another input than the pass's own). ``hidden`` is moved to the layer's device (a resumed pass's
        journal holds host tensors). Batch first in and out, whatever the layer takes (:attr:`positions_first`)."""
        if self.positions_first:
            found = self._run(layer, hidden.transpose(0, 1), call, hand_on)
            return found.transpose(0, 1).contiguous()
        return self._run(layer, hidden, call, hand_on)

    def entered(self, hidden: torch.Tensor, call: LayerCall, index: int | None = None) -> torch.Tensor:
        """The hidden states the forward gives ``call``'s layer where the previous call's output is ``hidden``
        (:func:`~.handed.entered`: a residual sum or a loop's start computed again from this model's outputs),
        batch first: what :meth:`run` gives the layer, for another model's layer run on this one's input."""
        if getattr(call, "entering", None) is None:
            return hidden
        found: torch.Tensor = entered(call, hidden, index)
        return found.transpose(0, 1).contiguous() if self.positions_first else found

    @staticmethod
    def _run(layer: torch.nn.Module, hidden: torch.Tensor, call: LayerCall, hand_on: bool) -> torch.Tensor:
        args, kwargs = given(call)
        weight = next(layer.parameters(), None)
        hidden = entered(call, hidden) if hand_on else hidden
        hidden = hidden if weight is None or hidden.device == weight.device else hidden.to(weight.device)
        named = [k for k, v in kwargs.items() if v is HIDDEN]  # (given by keyword: Reformer's)
        out = layer(*args, **{**kwargs, named[0]: hidden}) if named else layer(hidden, *args, **kwargs)
        result: torch.Tensor = handed_on(call, out) if hand_on else hidden_of(call, out)
        return result

    @contextmanager
    def head(self, weights: Mapping[str, torch.Tensor] | None = None) -> Iterator[Any]:
        """A function from the last decoder layer's output to the logits (final norm, head and any soft-capping,
        as the causal-LM class computes them), with the final norm's and head's weights for the block;
        ``weights``: the head's own parameters by name, used as given (a block of its rows gives the logits of
        those tokens only), instead of read from the checkpoint."""
        head = self.model.get_output_embeddings()
        tied = self.tied_head()
        site, attribute = head_site(self.model, self.inner)
        inner = getattr(site, attribute)
        parts = self._around_head()
        for part in parts:
            self.load(part)
        before = dict(head._parameters)
        if weights is None:
            self.load(head, tied_head=tied)
        else:
            for name, value in weights.items():
                head._parameters[name] = torch.nn.Parameter(value.to(self.device), requires_grad=False)

        def logits(hidden: torch.Tensor) -> torch.Tensor:
            hidden = hidden.to(self.device)  # a resumed pass's last hidden states come from the host
            normed = hidden if self._tailed() else self.tail.derived(hidden)
            for final in () if self._tailed() else self.finals:
                normed = final(normed)
            if self._tailed():
                normed = self.tail(hidden)
            setattr(site, attribute, stand_ins()[1](normed, inner, frozenset(map(id, self._path_to_layers()))))
            try:
                out = site(input_ids=torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device),
                           use_cache=False)
            finally:
                setattr(site, attribute, inner)
            # on the host: what the clients compare them with (targets, other models' log-probabilities) is there
            result: torch.Tensor = out.logits.to("cpu")
            return result

        try:
            yield logits
        finally:
            for part in (*parts, head):
                self.unload(part)
            head._parameters.update(before)  # the shapes the modules were built with (a block's were not)

    def tied_head(self) -> bool:
        """Whether the head is read from the input embeddings (tied): as transformers ties them, by the top-level
        config (a multimodal model's, not its text config's: Mistral 3 ties where its text config says not); not
        where transformers' modules tie no head and the checkpoint holds one (CPM-Ant's config says tie, its
        embeddings hold its prompt tokens' rows too, its head ships apart)."""
        if not getattr(self.config, "tie_word_embeddings", False):
            return False
        ties = getattr(self.model, "all_tied_weights_keys", None)
        head = self.model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        return (ties is None or f"{self._names[id(head)]}.weight" in ties or weight is None
                or not self.reader.holds(self.prefix(head) + "weight", tuple(weight.shape)))

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> ModelStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

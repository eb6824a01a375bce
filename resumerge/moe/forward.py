"""The prompt forward pass of the hidden-state gate modes, one decoder layer at a time.

mergekit-moe loads the whole base model in bfloat16 and runs every prompt set through it; here transformers' own
modules for the base's architecture are built without weights (on the meta device), and each one gets its
weights read from the base's files only while it runs, then drops them. Between layers only the prompt sets'
hidden states are carried; they are saved after every layer (temp file, fsync, rename), so a killed pass resumes
at the layer it reached, and the finished routers are kept, so a later resume never reruns the pass.

Routers follow mergekit-moe 0.1.5: the input of layer ``i`` of each prompt (the embeddings for layer 0) at the
last position (``hidden``, ``hidden_last``) or averaged over all positions, padding included (``hidden_avg``),
averaged over the set's prompts; a negative set's vector subtracted; each layer's vector divided by its L2 norm;
all in bfloat16.

A quantized base (block FP8, compressed-tensors, MXFP4) is read through the run's codecs, as the merge reads it:
each tensor decoded to float32, then cast to bfloat16 (a plain tensor is cast straight from its stored bytes), so
the pass sees the values ``--dequantize`` would write.

Runs in the prompt work's own process (:mod:`resumerge.moe.passmain`): transformers is imported here, never in
the merge's process.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import mmap
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from resumerge.config.moe_state import LAYER_PREFIX, ROUTERS_NAME
from resumerge.errors import InputError
from resumerge.inputs.codecs import CODECS, StoredFormats
from resumerge.inputs.files import TensorSource
from resumerge.inputs.safetensors_format import DTYPE_SIZES, TensorEntry, numel
from resumerge.inputs.source import InputSources
from resumerge.inputs.tensorio import TORCH_DTYPES
from resumerge.inputs.torch_bin import is_pickle_checkpoint
from resumerge.memory import SystemProbe
from resumerge.moe.passshare import share_problem
from resumerge.moe.prompts import require_transformers
from resumerge.moe.routers import Encoded
from resumerge.plan.inputrefs import format_ref, read_value
from resumerge.store.killpoints import reach
from resumerge.torch_import import torch

_BASE = "base"

# (positive, negative or None) encoded prompt sets of each gated expert
ExpertSets = Sequence[tuple[Encoded, Encoded | None]]
# where a tensor lies: (file, start, end, safetensors dtype, shape)
Location = tuple[str, int, int, str, tuple[int, ...]]


@dataclass(frozen=True)
class Weights:
    """The base model's folder (config.json and weight files, local or in the hub cache) and its stored tensors
    (quantized ones as their codes and companions)."""

    directory: Path
    tensors: Mapping[str, Location]


def base_formats(tensors: Mapping[str, Location], config: Mapping[str, Any], where: Path) -> StoredFormats:
    """The base's stored ``tensors`` sorted into logical tensors by the formats every run reads (its ``config``
    is its config.json; headers only)."""
    stored = {name: TensorSource(f, TensorEntry(name, d, tuple(shape), s, e))
              for name, (f, s, e, d, shape) in tensors.items()}
    return CODECS.recognise(config, stored, where=str(where))


@dataclass(frozen=True)
class Ready:
    """What the pass's checks built: transformers, the base's config as it reads it, the base's modules without
    weights, and every gated expert's encoded prompt sets."""

    transformers: Any
    config: Any
    model: Any
    sets: ExpertSets


def pass_checks(directory: Path, tokenizer_dir: Path, mode: str,
                prompts: Sequence[tuple[Sequence[str], Sequence[str] | None]]) -> Ready:
    """Every check of the pass before its first weight, which ``plan`` makes too: transformers imports, reads the
    base's config.json and builds its modules (without weights), loads its tokenizer and encodes the prompts.
    ``plan``'s probe of the pass and the run's pass both call this one function (:mod:`.passmain`), and the run
    waits for it before the merge writes anything, so what ``plan`` refuses here ``run`` refuses before its first
    weight (raises InputError subclasses)."""
    from resumerge.moe.prompts import encode, load_tokenizer

    transformers = require_transformers(mode)
    try:
        config = transformers.AutoConfig.from_pretrained(str(directory))
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    except (OSError, ValueError, KeyError) as exc:  # an architecture this transformers does not know
        raise InputError(f"transformers {transformers.__version__} cannot build the base model from {directory}: "
                         f"{exc}", yaml_path="base_model",
                         hint=f"the {mode} gate mode runs the base in transformers: pip install -U transformers, or "
                              "use gate_mode cheap_embed or random") from None
    tokenizer = load_tokenizer(tokenizer_dir, mode)
    sets = [(encode(tokenizer, positive), encode(tokenizer, negative) if negative else None)
            for positive, negative in prompts]
    return Ready(transformers, config, model, sets)


def hidden_routers(weights: Weights, mode: str, sets: ExpertSets, workdir: Path, *, share: int | None = None,
                   counted_elsewhere: int = 0, run_pid: int | None = None, ready: Ready | None = None,
                   on_checked: Callable[[], None] | None = None) -> Path:
    """Compute (or find, when an earlier run finished it) the routers of every layer into ``workdir`` and return
    the file: tensor ``layers.<i>`` of shape (gated experts, hidden), bfloat16.

    ``share`` is the memory budget this process may hold (counted as the governor counts it): a pass whose
    largest layer cannot fit is refused before any weight is read (UsageError naming the smallest budget; the
    run's process holds ``counted_elsewhere`` more). ``run_pid`` is the run's process, the one a kill test kills.
    ``ready`` is what :func:`pass_checks` built (None: built here); ``on_checked`` is called once every check is
    made, before the first weight is read (the run's merge waits for it).
    """
    done = workdir / ROUTERS_NAME
    if done.is_file():
        return done
    workdir.mkdir(parents=True, exist_ok=True)
    if ready is None:
        transformers = require_transformers(mode)
        config = transformers.AutoConfig.from_pretrained(str(weights.directory))
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    else:
        transformers, config, model = ready.transformers, ready.config, ready.model
    inner = model.base_model
    rotary = type(inner.rotary_emb)(config=config)  # its buffers are computed, not read: build them for real
    formats = base_formats(weights.tensors, json.loads((weights.directory / "config.json").read_text()),
                           weights.directory)
    if share is not None:
        _check_share(formats, int(config.num_hidden_layers), share, counted_elsewhere)
    if on_checked is not None:
        on_checked()
    reader = _CastReader(weights, formats)
    try:
        flat = [s for pair in sets for s in pair if s is not None]
        layers = int(config.num_hidden_layers)
        start, states = _restart_point(workdir, len(flat))
        with torch.no_grad():
            if states is None:
                embed = _load(inner.embed_tokens, "model.embed_tokens.", reader)
                states = {"vectors": [], "hidden": [embed(torch.tensor(s[0])) for s in flat]}
                _unload(inner.embed_tokens)
            names = _Keywords.read(type(inner.layers[0]).forward)
            setup = [_attention_setup(transformers, config, names, h, torch.tensor(s[1]), rotary)
                     for h, s in zip(states["hidden"], flat)]
            for i in range(start, layers):
                vectors = [_vector(h, mode) for h in states["hidden"]]
                if i + 1 < layers:  # the last layer's output is no router's input
                    layer = _load(inner.layers[i], f"model.layers.{i}.", reader)
                    states["hidden"] = [_run(layer, h, kw) for h, kw in zip(states["hidden"], setup)]
                    _unload(inner.layers[i])
                _save_layer(workdir, i, vectors, states["hidden"] if i + 1 < layers else [])
                reach("after_router_layer", run_pid=run_pid)  # tests kill the run here: it resumes at this layer
        _finish(workdir, sets, layers)
    finally:
        reader.close()
    return done


def _run(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    result: torch.Tensor = out[0] if isinstance(out, tuple) else out
    return result


@dataclass(frozen=True)
class _Keywords:
    """The names this transformers takes the layers' inputs by, read from signatures once per pass (versions rename
    them; feature detection, not version strings): ``embeds`` and ``positions`` (whether it needs the cache
    positions) of ``create_causal_mask``, the cache's name there (``mask_cache``) and in the decoder layers
    (``layer_cache``): ``cache`` where it exists (transformers 5.x; ``past_key_values`` is deprecated there and goes
    in 5.40), ``past_key_values`` before."""

    embeds: str
    positions: bool
    mask_cache: str
    layer_cache: str

    @classmethod
    def read(cls, layer_forward: Any) -> _Keywords:
        """The names of the installed ``create_causal_mask`` and of ``layer_forward``, the decoder layers' forward."""
        from transformers.masking_utils import create_causal_mask

        takes = inspect.signature(create_causal_mask).parameters  # follows the deprecation wrapper to the function
        return cls(embeds="inputs_embeds" if "inputs_embeds" in takes else "input_embeds",
                   positions="cache_position" in takes, mask_cache=_cache_name(takes),
                   layer_cache=_cache_name(inspect.signature(layer_forward).parameters))


def _cache_name(takes: Mapping[str, inspect.Parameter]) -> str:
    return "cache" if "cache" in takes else "past_key_values"


def _attention_setup(transformers: Any, config: Any, names: _Keywords, embedded: torch.Tensor, mask: torch.Tensor,
                     rotary: torch.nn.Module) -> dict[str, Any]:
    """The keyword arguments every decoder layer gets for one prompt set, made as the model's forward makes
    them (causal mask with the padding, positions, rotary embeddings), under this transformers' ``names``."""
    from transformers.masking_utils import create_causal_mask

    cache = transformers.DynamicCache(config=config)
    positions = torch.arange(embedded.shape[1]).unsqueeze(0)
    v4 = {"cache_position": positions[0]} if names.positions else {}  # transformers 4.x needs them (5.x derives them)
    causal = create_causal_mask(config=config, **{names.embeds: embedded, names.mask_cache: cache},
                                attention_mask=mask, position_ids=positions, **v4)
    return {"attention_mask": causal, "position_embeddings": rotary(embedded, position_ids=positions),
            "position_ids": positions, names.layer_cache: cache, "use_cache": True, **v4}


def _vector(hidden: torch.Tensor, mode: str) -> torch.Tensor:
    """One prompt set's vector at one layer: (batch, seq, hidden) -> (hidden,), as mergekit reduces it."""
    per_prompt = hidden.sum(dim=1) / hidden.shape[1] if mode == "hidden_avg" else hidden[:, -1, :]
    return per_prompt.sum(dim=0) / per_prompt.shape[0]


def _load(module: torch.nn.Module, prefix: str, reader: _CastReader) -> torch.nn.Module:
    """``module`` with its weights read from the base (cast to bfloat16, as the model is loaded): the cast
    tensors become its parameters (no second copy of the layer); a module with buffers of its own, which the
    files do not hold, gets them allocated first."""
    if any(True for _ in module.buffers()):
        module.to_empty(device="cpu")
    state = {}
    for name in module.state_dict():
        state[name] = reader.bfloat16(prefix + name)
    module.load_state_dict(state, strict=True, assign=True)
    return module


class _CastReader:
    """The base's tensors, cast to bfloat16.

    A safetensors tensor is cast straight from a read-only map of its bytes, unmapped once cast: a ``pread`` into
    a fresh buffer first cost twice the CPU (the kernel zeroes and faults in the buffer, then copies the page
    cache into it; 0.85-1.0 s against 0.4 s for the 1.47 GB the bench's pass reads), on the pass's critical path.
    Its mapped pages count in this process's RSS only while that one tensor is cast, as the read buffer did (see
    :func:`layer_bytes`). Anything else (a pickle checkpoint, a misaligned tensor) is read as the merge reads it,
    and a quantized tensor is decoded as the merge decodes it.
    """

    def __init__(self, weights: Weights, formats: StoredFormats) -> None:
        self._directory = weights.directory
        self._formats = formats
        self._sources = InputSources.local({_BASE: str(weights.directory)})
        self._files: dict[str, BinaryIO] = {}

    def bfloat16(self, name: str) -> torch.Tensor:
        """Logical tensor ``name`` of the base, in bfloat16."""
        if name in self._formats.claims:
            return read_value(format_ref(_BASE, self._formats, name), self._sources).to(torch.bfloat16)
        found = self._formats.stored[name]
        file, (start, end, dtype, shape) = found.file, (found.entry.start, found.entry.end, found.entry.dtype,
                                                        found.entry.shape)
        if is_pickle_checkpoint(file) or end == start or start % DTYPE_SIZES[dtype] or dtype not in TORCH_DTYPES:
            return self._sources.read(_BASE, file, start, end, dtype, shape).to(torch.bfloat16, copy=True)
        handle = self._files.get(file)
        if handle is None:
            handle = self._files[file] = open(self._directory / file, "rb")  # noqa: SIM115 (closed in close())
        offset = start - start % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(handle.fileno(), end - offset, access=mmap.ACCESS_READ, offset=offset)
        try:
            with contextlib.suppress(AttributeError, OSError):  # a cold file: ask for it all at once
                mapped.madvise(mmap.MADV_WILLNEED, start - offset)
            with warnings.catch_warnings():  # "not writable": it is only read, by the cast
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(mapped, dtype=torch.uint8)[start - offset:]
            cast = raw.view(TORCH_DTYPES[dtype]).reshape(shape).to(torch.bfloat16, copy=True)
            del raw  # the map's last user: it can be closed now
        finally:
            with contextlib.suppress(BufferError):  # should a view outlive this, the collector closes the map
                mapped.close()
        return cast

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._sources.close()


def pass_bytes(formats: StoredFormats, layers: int) -> int:
    """The most the pass holds at once beyond its process's baseline (the base's stored tensors sorted by
    ``formats``): the embeddings or one decoder layer, each its weights in bfloat16 plus the largest one as read (a
    quantized one's parts and its float32 decode)."""
    prefixes = ["model.embed_tokens.", *(f"model.layers.{i}." for i in range(layers))]
    held, largest = dict.fromkeys(prefixes, 0), dict.fromkeys(prefixes, 0)
    for name, found in formats.logical().items():
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is None:
            continue
        codec = formats.codec(name)
        values = numel(codec.value_shape(tuple(found.entry.shape)))
        read = found.entry.nbytes + sum(c.entry.nbytes for _, c in formats.companions(name))
        held[prefix] += values * 2
        largest[prefix] = max(largest[prefix], read if codec.plain else read + values * 4)
    return max(held[p] + largest[p] for p in prefixes)


def _check_share(formats: StoredFormats, layers: int, share: int, counted_elsewhere: int) -> None:
    probe = SystemProbe()
    probe.reclaim()
    problem = share_problem(probe.rss(), pass_bytes(formats, layers), share, counted_elsewhere)
    if problem is not None:
        raise problem


def _unload(module: torch.nn.Module) -> None:
    module.to("meta")


def _restart_point(workdir: Path, sets: int) -> tuple[int, dict[str, Any] | None]:
    """The layer to continue at and the saved state (None: start from the embeddings)."""
    from safetensors.torch import load_file

    saved = sorted(workdir.glob(f"{LAYER_PREFIX}*.safetensors"))
    if not saved:
        return 0, None
    last = saved[-1]
    layer = int(last.stem.removeprefix(LAYER_PREFIX))
    data = load_file(str(last))
    hidden = [data[f"hidden.{s}"] for s in range(sets)] if "hidden.0" in data else []
    return layer + 1, {"hidden": hidden}


def _save_layer(workdir: Path, layer: int, vectors: list[torch.Tensor], hidden: list[torch.Tensor]) -> None:
    """Layer ``layer``'s prompt vectors and the hidden states after it, written durably; earlier layers' files
    then hold nothing needed but their vectors, which are kept."""
    tensors = {f"vector.{s}": v.contiguous() for s, v in enumerate(vectors)}
    tensors.update({f"hidden.{s}": h.contiguous() for s, h in enumerate(hidden)})
    _durable_save(tensors, workdir / f"{LAYER_PREFIX}{layer:05d}.safetensors")


def _finish(workdir: Path, sets: ExpertSets, layers: int) -> None:
    """Each layer's routers from its saved vectors into ``routers.safetensors``; the layer files deleted."""
    from safetensors.torch import load_file

    routers = {}
    for i in range(layers):
        data = load_file(str(workdir / f"{LAYER_PREFIX}{i:05d}.safetensors"))
        index, rows = 0, []
        for _, negative in sets:
            vector = data[f"vector.{index}"].clone()
            index += 1
            if negative is not None:
                vector -= data[f"vector.{index}"]
                index += 1
            rows.append(vector.unsqueeze(0))
        gates = torch.cat(rows, dim=0)
        gates /= gates.norm(p=2, dim=-1, keepdim=True).clamp(min=1e-8)
        routers[f"layers.{i}"] = gates.contiguous()
    _durable_save(routers, workdir / ROUTERS_NAME)
    for i in range(layers):
        (workdir / f"{LAYER_PREFIX}{i:05d}.safetensors").unlink(missing_ok=True)


def _durable_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    temp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(temp))
    with open(temp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(temp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

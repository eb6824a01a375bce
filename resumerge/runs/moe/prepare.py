"""Open a mergekit-moe config's models (config.json and headers only, local or hub, as any merge opens them),
run the prompt forward pass when the gate mode needs it, and plan it: the MoE counterpart of the session's
``prepare``."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.config.locations import StateDir
from resumerge.config.settings import RunSettings
from resumerge.errors import InputError, ModelInputError
from resumerge.inputs.catalog import Inputs, open_inputs
from resumerge.inputs.codecs import CODECS
from resumerge.inputs.model import ModelInput
from resumerge.machine.memory.sizes import format_size
from resumerge.machine.torch_import import torch
from resumerge.merge.methods.resources import Resources
from resumerge.merge.plan.inputrefs import read_value, tensor_ref
from resumerge.merge.plan.merge_plan import PlanOptions
from resumerge.merge.plan.outguard import refuse_out_over_inputs
from resumerge.merge.plan.prepared import Prepared
from resumerge.runs.moe.config import CARD_METHOD, CARD_WORDING, PROMPT_MODES, MoeConfig, prompt_texts
from resumerge.runs.moe.gatesites import GatesPass, Starting, frozen
from resumerge.runs.moe.hiddenpass import HiddenPass
from resumerge.runs.moe.passproc import HIDDEN_MODES, routers_key, run_child, transformers_usable
from resumerge.runs.moe.planner import build_moe_plan
from resumerge.runs.moe.routers import RouterSources

if TYPE_CHECKING:
    from resumerge.inputs.hub import ProgressCallback, RepoMetadata


def prepare_moe(config: MoeConfig, options: PlanOptions, settings: RunSettings, *,
                model_dirs: Mapping[str, str] | None = None, on_progress: ProgressCallback | None = None,
                forward: bool = True, out: Path | None = None, starting: Starting = Starting()) -> Prepared:
    """The plan of ``config`` with its opened inputs, the run's :class:`~resumerge.runs.moe.routers.RouterSources`
    (in its resources) and the prompt forward pass of the hidden-state gate modes when it runs beside the merge. No
    weight is read, except by that pass, which starts (or is found finished in the state dir) only when ``forward``
    and after every check, in a process of its own (:mod:`.hiddenpass`) under ``settings``' memory budget and thread
    count, started as ``starting`` says (:class:`~resumerge.runs.moe.gatesites.Starting`: where, beside the merge or
    finished first, in a process the caller started already). A hub base model's weights are downloaded into the
    cache for it, within ``settings.max_disk``. ``out`` (a local OUT) is refused before the pass when it is, or
    holds, an input (:func:`~resumerge.merge.plan.outguard.refuse_out_over_inputs`). Its site runs it in its own
    process here, or its layers on a Ray node, this process driving them before the merge (:mod:`.gatesites`).
    Raises ``InputError`` subclasses."""
    inputs = open_inputs(config.as_merge_config(), model_dirs=model_dirs, state=settings.state,
                         cache_dir=settings.cache_dir, on_progress=on_progress)
    folder = base_folder(inputs.models[config.base_model.key], settings.state)
    _tokenizer_needed(config, options, folder)
    encoded = key = None
    if config.gate_mode == "cheap_embed":
        encoded = encode_prompts(config, folder)
    if config.gate_mode in HIDDEN_MODES:
        key = _key(config, inputs.models[config.base_model.key], folder)
    plan = build_moe_plan(config, inputs.models, options, encoded=encoded, routers_key=key,  # every check
                          tokenizer_dir=folder)
    if out is not None:  # before the pass reads a weight (the session checks it again)
        refuse_out_over_inputs(out, plan)
    card = config.as_merge_config()  # the model card lists the models as a models: merge lists them
    plan = replace(plan, card_config=card, card_method=CARD_METHOD, card_wording=CARD_WORDING)
    if config.gate_mode == "cheap_embed" and forward and config.base_model.key not in inputs.hub:
        preview = _cheap_embed_gates(config, inputs, encoded)
        preview_plan = build_moe_plan(config, inputs.models, options, encoded=encoded, gates_preview=preview,
                                      tokenizer_dir=folder)
        return Prepared(replace(preview_plan, card_config=card, card_method=CARD_METHOD, card_wording=CARD_WORDING),
                        inputs)
    if key is None or not forward:
        return Prepared(plan, inputs)
    provided = RouterSources()
    running = _hidden_pass(config, inputs, key, provided, settings, folder, starting=starting,
                           on_progress=on_progress)
    resources = Resources((provided,))
    if running.share is not None:
        return Prepared(plan, inputs, resources, beside=running)
    return Prepared(replace(plan, notes=plan.notes + running.degenerate_notes()), inputs, resources)


def base_folder(base: ModelInput, state: StateDir) -> Path:
    """Where the base model's config.json and tokenizer files are: its folder, or a GGUF base's folder of files
    rebuilt from its metadata under the state dir (:func:`~resumerge.inputs.gguf.folder.gguf_folder`; its
    tensors are there too, at the same names), made here once."""
    if base.gguf is None:
        return base.directory
    from resumerge.inputs.gguf.folder import gguf_folder

    return gguf_folder(base, state.gguf_dir)


def _tokenizer_needed(config: MoeConfig, options: PlanOptions, folder: Path) -> None:
    """Refuse (exit 2) a GGUF base whose tokenizer transformers could not rebuild where it is needed: to read the
    prompts (the prompt gate modes), or as the output's tokenizer (unless ``--no-copy-tokenizer``)."""
    from resumerge.inputs.gguf.folder import tokenizer_error

    reason = tokenizer_error(folder)
    if reason is None:
        return
    if config.gate_mode in PROMPT_MODES:
        raise ModelInputError(f"gate_mode {config.gate_mode} reads the prompts with the base's tokenizer: {reason}",
                              yaml_path="base_model", hint="use gate_mode random or uniform_random, with "
                                                           "--no-copy-tokenizer")
    if options.copy_tokenizer:
        raise ModelInputError(f"the output's tokenizer is the base's: {reason}", yaml_path="base_model",
                              hint="pass --no-copy-tokenizer and add the tokenizer files by hand")


def encode_prompts(config: MoeConfig, tokenizer_dir: Path) -> tuple[tuple[Any, Any], ...]:
    """Each gated expert's (positive, negative or None) prompt sets, tokenised with the base's tokenizer (in
    ``tokenizer_dir``; in the prompt work's process: this one does not import transformers)."""
    if "transformers" in sys.modules:  # already imported (a notebook, a test): no memory to save, no process
        from resumerge.runs.moe.prompts import encode, load_tokenizer

        tokenizer = load_tokenizer(tokenizer_dir, config.gate_mode)
        return tuple((encode(tokenizer, p), encode(tokenizer, n) if n else None) for p, n in prompt_texts(config))
    job = {"job": "encode", "mode": config.gate_mode, "tokenizer_dir": str(tokenizer_dir),
           "prompts": prompt_texts(config)}
    with tempfile.TemporaryDirectory(prefix="resumerge-prompts-") as scratch:
        answer = run_child(job, Path(scratch))
    return tuple((frozen(p), frozen(n) if n is not None else None) for p, n in answer["encoded"])


def _cheap_embed_gates(config: MoeConfig, inputs: Inputs, encoded: Any) -> torch.Tensor:
    """The ``cheap_embed`` routers of every layer (one read of the base's embedding), for the degenerate-routing
    warning."""
    from resumerge.inputs.source import InputSources
    from resumerge.runs.moe.routers import cheap_embed_rows

    base = inputs.models[config.base_model.key].recognised(CODECS)
    sources = InputSources.local({base.ref.key: str(base.directory)})
    try:
        embed = read_value(tensor_ref(base.ref.key, base, "model.embed_tokens.weight"), sources)
        return cheap_embed_rows(embed, encoded, int(base.config["num_hidden_layers"]))
    finally:
        sources.close()


def routers_dir(config: MoeConfig, base: ModelInput, state: StateDir) -> Path:
    """Where the hidden-state routers of ``config`` are computed and kept, by content."""
    return state.routers_dir / _key(config, base, base_folder(base, state))


def _key(config: MoeConfig, base: ModelInput, folder: Path) -> str:
    """The content key of ``config``'s forward pass (see :func:`~resumerge.runs.moe.passproc.routers_key`; ``folder``:
    :func:`base_folder`)."""
    return routers_key([(f.name, f.size, f.identity) for f in base.files], config.gate_mode, prompt_texts(config),
                       folder)


def _hidden_pass(config: MoeConfig, inputs: Inputs, key: str, provided: RouterSources, settings: RunSettings,
                 folder: Path, *, starting: Starting, on_progress: ProgressCallback | None) -> HiddenPass:
    """The forward pass ``key`` of the hidden-state modes, its routers provided in ``provided``: found finished in
    the state dir, or started now as ``starting`` says (where; beside the merge when it may be and the budget holds
    both, else finished before this returns). ``folder``: the base's (:func:`base_folder`), where the pass reads
    its config, tokenizer and tensors."""
    from resumerge.runs.moe.forward import pass_bytes
    from resumerge.runs.moe.state import ROUTERS_NAME

    base = inputs.models[config.base_model.key]
    layers = int(base.config["num_hidden_layers"])
    workdir = settings.state.routers_dir / key
    if (workdir / ROUTERS_NAME).is_file():
        if starting.early is not None:
            starting.early.stop()  # not needed: it must not take the merge's cores while it loads
        return HiddenPass(key, workdir, layers, provided)
    transformers_usable(config.gate_mode)
    if config.base_model.key in inputs.hub:
        _fetch_base(inputs.hub[config.base_model.key], settings.state, settings.max_disk, on_progress)
    formats = CODECS.recognise(base.config, base.tensors, where=str(base.directory))
    gates = GatesPass(config, base, folder, key, workdir, layers, pass_bytes(formats, layers), provided)
    return starting.site.start(gates, settings, beside=starting.beside, early=starting.early)


def _fetch_base(meta: RepoMetadata, state: StateDir, max_disk: int | None,
                on_progress: ProgressCallback | None) -> None:
    """A hub base model's weights downloaded (and verified) into the cache for the forward pass, which reads them
    in its own process; refused (exit 2) when they alone exceed ``max_disk``."""
    from resumerge.inputs.hub import fetch_weights

    size = sum(meta.headers[name].file_size for name in meta.weight_files)
    if max_disk is not None and size > max_disk:
        raise InputError(f"the hidden-state gate modes read the hub base model's weights in a process of their own "
                         f"and download them into the cache first: {format_size(size)}, more than --max-disk "
                         f"{format_size(max_disk)}", yaml_path="base_model",
                         hint="give --max-disk room for them, or use cheap_embed or random gates")
    fetch_weights(meta, records_dir=state.records_dir, on_progress=on_progress)

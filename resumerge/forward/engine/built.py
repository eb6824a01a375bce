"""A model's modules built without weights, for a streamed pass (:mod:`.stream`): the native modules where its
family is one they build (:mod:`.native`), else transformers' config and causal-LM modules on the meta device
(:mod:`.onmeta`; a multimodal model's text part, :mod:`.multimodal`); whether the native modules read every tensor
of the checkpoint as it is stored; transformers' progress bars kept off while a module is converted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import import_module
from pathlib import Path
from typing import Any

from resumerge.forward.engine.multimodal import causal_lm_class
from resumerge.forward.engine.native import native_modules
from resumerge.forward.engine.onmeta import weights_on_meta
from resumerge.forward.engine.reader import CastReader
from resumerge.forward.engine.requires import Needs, require_transformers
from resumerge.machine.torch_import import torch

__all__ = ["build_modules", "config_doc", "native_reads_all", "quiet_loading"]


def build_modules(directory: Path, dtype: torch.dtype, *, what: str, native: bool = True) -> tuple[Any, Any]:
    """The config of the model in ``directory`` and its causal-LM modules in ``dtype`` built without weights: the
    native modules where its family is one they build (:mod:`.native`; ``native=False``: never), else
    transformers' config and modules (:func:`weights_on_meta`); ``what`` names the pass in the error of a missing
    transformers. A multimodal model is built by its image-text-to-text class where no causal-LM class maps it
    (:mod:`.multimodal`). Raises what transformers raises for an architecture it does not know, and
    :class:`ModelInputError` for one it builds no causal LM of (T5, a vision-only model)."""
    if native:
        built = native_modules(config_doc(directory), dtype)
        if built is not None:
            return built
    transformers = require_transformers(Needs(what))
    config = transformers.AutoConfig.from_pretrained(str(directory))
    # imported before the block, as the modules' construction would import it: it keeps torch.nn.init's functions
    # as it finds them on import, which must be torch's own, not the block's (see weights_on_meta)
    import_module("transformers.modeling_utils")
    with weights_on_meta():
        model = causal_lm_class(transformers, config).from_config(config, dtype=dtype)
    return config, model


@contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' progress bars off for the block (as they were after it)."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    if shown:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


def config_doc(directory: Path) -> dict[str, Any]:
    """``directory``'s config.json, or {} where it cannot be read (transformers then says what is wrong)."""
    try:
        doc = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def native_reads_all(model: Any, reader: CastReader, tied: bool) -> bool:
    """Whether every parameter of native modules ``model`` is a tensor of the checkpoint under its own name and, where
    stored plainly, in its shape (what :meth:`~resumerge.forward.engine.stream.ModelStream.load` reads without
    transformers' conversion); the head may be missing where it is tied to the embeddings."""
    return all(reader.holds(name, tuple(param.shape)) or (tied and name.startswith("lm_head."))
               for name, param in model.named_parameters())

"""The output config.json of a new stack of layers, built by transformers on the meta device before a weight is written.

Re-indexing the per-layer facts (:mod:`resumerge.merge.plan.layerfacts`) writes what each output layer was; whether the
family's config can say it is transformers' to decide. The output config and each source model's config (of the
donor's family) are built, their models on the meta device (no memory), and the stack is refused in one line
(:class:`ConfigError`, exit 2) where:

- transformers cannot build the output config or its model (a layer-type override map no longer homogeneous);
- a per-layer fact as transformers reads it back differs from the source layer's (Gemma 4 forces the last layer to
  full attention: a stack ending on a sliding layer);
- an output layer is built with other parameters than its source layer (LFM2-MoE's ``num_dense_layers`` cannot
  make a layer after an MoE one dense);
- a tensor outside the layers has another shape in the output model than the one planned (a table packed per
  layer, :mod:`resumerge.merge.plan.packing`, is planned cut for the new stack).

Without transformers nothing is built: :func:`check_built` says so in a note. A family transformers does not know,
or whose source models it cannot build, is not checked.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from resumerge.errors import ConfigError
from resumerge.merge.plan.architecture import layer_config
from resumerge.merge.plan.keptfacts import installed, keep, kept
from resumerge.merge.plan.layerfacts import class_per_layer_keys, config_of, quiet_transformers, same_stack

if TYPE_CHECKING:
    from resumerge.merge.plan.merge_plan import TensorPlan

NOT_BUILT = ("transformers is not installed: the output config.json of the new stack of layers was re-indexed but "
             "not built to check that its family can describe the stack")
LAYER_PARAM = re.compile(r"^(?P<prefix>.*?layers)\.(?P<index>\d+)\.(?P<suffix>.+)$")


def check_built(
    out_config: Mapping[str, Any],
    configs: Mapping[str, Mapping[str, Any]],
    donor: str,
    origins: tuple[tuple[str, int], ...],
    tensors: Mapping[str, TensorPlan],
    slice_path: Callable[[int], str],
) -> list[str]:
    """Check that transformers builds the output ``out_config`` as the stack ``origins`` describes (module
    docstring); ``configs`` are the input models' config.json, ``slice_path(i)`` the YAML path of the slice making
    output layer ``i``. Returns the notes to show (none, or :data:`NOT_BUILT`); raises :class:`ConfigError`."""
    if same_stack(layer_config(configs[donor]), origins):
        return []  # the donor's own stack: its config describes it
    versions = installed()
    if versions is None:
        return [NOT_BUILT]
    # What the check reads, and a stack it passed under the same transformers and torch passes again without them
    # (resumerge.merge.plan.keptfacts): the configs, the stack, and the planned tensors outside the layers.
    key = [out_config, configs, donor, origins,
           [[n, list(tp.shape), tp.blocks is not None] for n, tp in tensors.items() if LAYER_PARAM.match(n) is None]]
    if kept("built", key, versions)[0]:
        return []
    try:
        import torch
        import transformers
    except ImportError:
        return [NOT_BUILT]
    family = out_config.get("model_type")
    keys = sorted({m for m, _ in origins if configs[m].get("model_type") == family})
    with quiet_transformers():
        built = {k: build_meta(transformers, torch, configs[k]) for k in keys}
        sources = {k: b for k, b in built.items() if b is not None}
        if not sources or len(sources) < len(built):
            return []  # a family transformers cannot build from the inputs' own configs: nothing to compare with
        out_cfg = _refusing(transformers, family, lambda: _config(transformers, out_config))
        facts = sorted(class_per_layer_keys(out_cfg.get_text_config().model_type) or ())
        for i, (model, layer) in enumerate(origins):
            if model in sources:
                problem = _fact_difference(out_cfg, sources[model][0], i, layer, family, facts)
                _refuse(i, model, layer, problem, slice_path)
        out = _refusing(transformers, family, lambda: _model(transformers, torch, out_cfg))
        for i, (model, layer) in enumerate(origins):
            if model in sources:
                _refuse(i, model, layer, _param_difference(out, sources[model][1], i, layer, family), slice_path)
        if donor in sources:
            _check_loose(out, sources[donor][1], tensors)
    keep("built", key, versions, True)
    return []


def _refusing(transformers: Any, family: Any, build: Callable[[], Any]) -> Any:
    """What ``build`` returns; what transformers raises in it as a one-line :class:`ConfigError`."""
    try:
        return build()
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"transformers {transformers.__version__} cannot build the output {family} model from its "
            f"config.json: {first}",
            yaml_path="slices",
            hint="choose slices whose layers the family's config can describe in that order",
        ) from None


def _refuse(i: int, model: str, layer: int, problem: str | None, slice_path: Callable[[int], str]) -> None:
    if problem is not None:
        raise ConfigError(f"output layer {i} (layer {layer} of {model}) {problem}", yaml_path=slice_path(i),
                          hint="choose slices whose layers the family's config can describe in that order")


def _config(transformers: Any, doc: Mapping[str, Any]) -> Any:
    return config_of(transformers, doc)


def _model(transformers: Any, torch: Any, config: Any) -> Any:
    """``config``'s causal LM on the meta device, its weights not initialised (half the time of a 110-layer
    Llama-70B's build: 2.4 s, not 4.8)."""
    from contextlib import nullcontext

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # a transformers without it: initialising meta tensors is only slower
        no_init_weights = nullcontext
    with torch.device("meta"), no_init_weights():
        return transformers.AutoModelForCausalLM.from_config(config)


def build_meta(transformers: Any, torch: Any, doc: Mapping[str, Any]) -> tuple[Any, Any] | None:
    """(config, model on the meta device) of config.json ``doc``; None where transformers builds no causal LM of it."""
    try:
        config = _config(transformers, doc)
        if type(config) not in transformers.AutoModelForCausalLM._model_mapping:
            return None
        return config, _model(transformers, torch, config)
    except Exception:
        return None


def _fact_difference(out: Any, source: Any, i: int, layer: int, family: Any, facts: list[str]) -> str | None:
    """How output layer ``i``'s per-layer ``facts`` as transformers reads them back differ from source layer
    ``layer``'s; None when they do not."""
    out_doc, src_doc = out.get_text_config().to_dict(), source.get_text_config().to_dict()
    for key in facts:
        got, want = _at(out_doc.get(key), i), _at(src_doc.get(key), layer)
        if got != want:
            return f"has {key} {want!r}, but a {family} config makes it {got!r} in this place"
    return None


def _param_difference(out: Any, source: Any, i: int, layer: int, family: Any) -> str | None:
    """How output layer ``i`` as transformers builds it differs from source layer ``layer`` in its parameters."""
    got, want = _layer_params(out, i), _layer_params(source, layer)
    if got != want:
        name = sorted(set(got.items()) ^ set(want.items()))[0][0]
        return (f"is built with {name} {_shape(got.get(name))} where its source layer has "
                f"{_shape(want.get(name))}: a {family} config cannot describe that layer in this place")
    return None


def _check_loose(model: Any, donor: Any, tensors: Mapping[str, TensorPlan]) -> None:
    """Refuse a planned tensor outside the layers that the output ``model`` holds with another shape than the
    ``donor``'s model does (the donor's is the one planned: the new stack changed what the tensor must be), or a
    table cut per layer with another shape than the one planned."""
    before = {n: tuple(p.shape) for n, p in donor.named_parameters()}
    before.update({n: tp.shape for n, tp in tensors.items() if tp.blocks is not None})
    for name, param in model.named_parameters():
        if LAYER_PARAM.match(name) is None and name in tensors and before.get(name, tuple(param.shape)) != param.shape:
            raise ConfigError(
                f"{name} is planned as {list(before[name])} (as in its model) but the output model holds it as "
                f"{list(param.shape)}",
                yaml_path="slices",
                hint="choose slices whose layers the family's config can describe in that order",
            )


def _layer_params(model: Any, index: int) -> dict[str, tuple[int, ...]]:
    """Suffix -> shape of the parameters of decoder layer ``index`` (of the language model's decoder: a vision
    tower's layers are not the stack's)."""
    found: dict[str, tuple[int, ...]] = {}
    prefix = None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    for name, param in decoder.named_parameters():
        match = LAYER_PARAM.match(name)
        if match is None or (prefix is not None and match["prefix"] != prefix):
            continue
        prefix = match["prefix"]
        if int(match["index"]) == index:
            found[match["suffix"]] = tuple(param.shape)
    return found


def _at(values: Any, index: int) -> Any:
    return values[index] if isinstance(values, list) and index < len(values) else None


def _shape(shape: tuple[int, ...] | None) -> str:
    return "(none)" if shape is None else str(list(shape))

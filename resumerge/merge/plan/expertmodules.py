"""Fused expert stacks found from the modules transformers builds for a family, for the families
:data:`~resumerge.merge.plan.experts.FUSED_LAYOUTS` does not hold (Granite 4's ``block_sparse_moe.input_linear`` /
``output_linear``, Mistral 4's ``mlp.experts.gate_up_proj`` / ``down_proj``, and the next family's).

The donor's config is built by transformers on the meta device (no memory, no weights initialised). An experts
module is one of the family's own modules (not a torch layer: a convolution's 3-D weight is no stack) holding
3-D parameters whose first axis is the config's expert count. Of each such parameter, the modules say:

- which way it is applied, from the experts module's forward code: ``linear(x, W[e])`` reads ``W[e]`` as
  [out, in], ``x @ W[e]`` (``matmul``, ``bmm``) as [in, out];
- whether it reads the hidden states (its in-axis is the hidden size) and writes something else: the input
  projection; the one reading another width and writing the hidden size is the output projection;
- whether the input projection holds gate and up (the forward splits its output: ``chunk(2`` one half after the
  other, ``[..., ::2]`` alternating) — then each half is merged on its own;
- the checkpoint's name of each stack: the module's own, or the name transformers' conversion mapping renames to it
  on load (Granite's ``input_linear.weight`` → ``experts.gate_up_proj``). A stack the conversion does more to than a
  rename (a transpose, a concatenation) is not found here: its stored layout is not the module's.

Where transformers is missing or cannot build the family, nothing is found (and the stacks of a name
:mod:`~resumerge.merge.plan.experts` knows stay refused).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping
from typing import Any

from resumerge.merge.plan.merge_plan import ExpertStack

# a layer's index in a parameter's or tensor's name: what follows is the name within the layer
_IN_LAYER = re.compile(r"\.(\d+)\.(?P<rest>.+)$")


def module_stacks(config: Mapping[str, Any], count: int, names: Iterable[str]) -> dict[str, ExpertStack | None]:
    """Of the checkpoint tensor ``names``, those that are fused stacks of ``count`` experts in the modules
    transformers builds from ``config`` (its config.json), each with how its experts and projections lie (module
    docstring; None: a stack whose experts module's code does not say how it is applied); {} where transformers is
    not installed, does not know the family, or builds no stack."""
    if count < 2:
        return {}
    built = meta_model(config)
    if built is None:
        return {}
    model, hidden, renames = built
    found = _stacks_in(model, hidden, count)
    out: dict[str, ExpertStack | None] = {}
    for name in names:
        within = _within_layer(renamed(name, renames))
        if within is not None and within in found:
            out[name] = found[within]
    return out


def meta_model(config: Mapping[str, Any]) -> tuple[Any, int, list[tuple[re.Pattern[str], str]]] | None:
    """(the model transformers builds from ``config`` on the meta device, its hidden size, the renamings its
    conversion mapping applies on load); None where it cannot build one."""
    try:
        import torch
        import transformers
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.initialization import no_init_weights
    except ImportError:
        return None
    from resumerge.merge.plan.layerfacts import config_of, quiet_transformers

    try:
        with quiet_transformers():
            cfg = config_of(transformers, config)
            hidden = int(cfg.get_text_config().hidden_size)
            with torch.device("meta"), no_init_weights():
                try:
                    model = transformers.AutoModelForCausalLM.from_config(cfg)
                except ValueError:  # no causal-LM class (Mistral 4): its base model holds the same layers
                    model = transformers.AutoModel.from_config(cfg)
            mapping = get_model_conversion_mapping(model)
    except Exception:  # a family transformers does not know or cannot build from this config: nothing found
        return None
    renames = []
    for rule in mapping:
        if type(rule).__name__ != "WeightRenaming":
            continue  # a converter (transpose, concatenation) stores another layout than the module's
        sources, targets = list(rule.source_patterns), list(rule.target_patterns)
        if len(targets) == 1:
            renames += [(re.compile(source), targets[0]) for source in sources]
    return model, hidden, renames


def names_on_load(config: Mapping[str, Any], names: Iterable[str]) -> list[str]:
    """Checkpoint tensor ``names`` as transformers' conversion for the family of ``config`` (its config.json) renames
    them on load (DeepSeek-V4's ``head.weight`` is its ``lm_head.weight``); the names as they are where transformers
    is missing or cannot build the family."""
    built = meta_model(config)
    return [renamed(name, built[2]) if built is not None else name for name in names]


def renamed(name: str, renames: list[tuple[re.Pattern[str], str]]) -> str:
    """Checkpoint tensor ``name`` as transformers' conversion ``renames`` it on load (its module's name)."""
    for pattern, target in renames:
        name = pattern.sub(target, name)
    return name


def _within_layer(name: str) -> str | None:
    match = _IN_LAYER.search(name)
    return match["rest"] if match is not None else None


def _stacks_in(model: Any, hidden: int, count: int) -> dict[str, ExpertStack | None]:
    """Name within its layer -> :class:`ExpertStack` of every fused stack of ``count`` experts in ``model`` (None:
    a stack whose forward code does not say which way it is applied)."""
    found: dict[str, ExpertStack | None] = {}
    for path, module in model.named_modules():
        if type(module).__module__.startswith("torch."):
            continue
        params: dict[str, tuple[int, ...]] = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)
                  if p.ndim in (2, 3) and p.shape[0] == count}
        weights: dict[str, tuple[int, ...]] = {n: s for n, s in params.items() if len(s) == 3}
        if not weights:
            continue
        for name, stack in _module_stacks(weights, hidden, count, _forward_code(module)).items():
            found.setdefault(_within_layer(f"{path}.{name}") or name, stack)
            bias = f"{name}_bias"  # gpt-oss's form: [count, out] beside its weight
            if len(params.get(bias, ())) == 2:
                biased = None if stack is None else ExpertStack(count, stack.parts, 0, stack.interleaved)
                found.setdefault(_within_layer(f"{path}.{bias}") or bias, biased)
    return found


def _forward_code(module: Any) -> str:
    """The code of ``module``'s forward, and of each of its class's own methods the forward calls (Hunyuan v4's
    ``self._apply_gate(``, where it splits gate and up)."""
    try:
        code = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""
    for name in dict.fromkeys(re.findall(r"self\.(\w+)\(", code)):
        method = getattr(type(module), name, None)
        if name != "forward" and inspect.isfunction(method):
            try:
                code += "\n" + inspect.getsource(method)
            except (OSError, TypeError):
                continue
    return code


def _module_stacks(weights: dict[str, tuple[int, ...]], hidden: int, count: int, code: str
                   ) -> dict[str, ExpertStack | None]:
    """How each 3-D parameter [count, a, b] of one experts module whose forward is ``code`` stacks its experts."""
    applied: dict[str, tuple[int, int, int]] = {}  # name -> (out axis, out size, in size)
    for name, shape in weights.items():
        uses = [line for line in code.splitlines() if re.search(rf"self\.{name}\b", line)]
        if any("linear(" in line for line in uses):
            out_axis = 0  # W[e] is [out, in]
        elif any(re.search(r"@|matmul|bmm", line) for line in uses):
            out_axis = 1  # W[e] is [in, out]
        else:
            continue
        applied[name] = (out_axis, shape[1 + out_axis], shape[2 - out_axis])
    # the input projection reads the hidden states and writes another width; where gate and up together are the
    # hidden size wide, the one reading the hidden states beside a projection that reads another width
    inputs = [n for n, (_, out, into) in applied.items() if into == hidden and out != hidden]
    if not inputs:
        inputs = [n for n, (_, out, into) in applied.items()
                  if into == hidden == out and any(a[2] != hidden for a in applied.values())]
    splits = "chunk(2" in code or "::2]" in code
    out: dict[str, ExpertStack | None] = {}
    for name in weights:
        if name not in applied:
            out[name] = None
        elif name in inputs and splits and applied[name][1] % 2 == 0:
            out[name] = ExpertStack(count, parts=2, axis=applied[name][0], interleaved="::2]" in code)
        else:
            out[name] = ExpertStack(count)
    return out

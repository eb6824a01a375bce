"""A method that merges LoRA adapters through their factors (``core_space``, :attr:`MethodSpec.factor_inputs`): its
parents checked, and each planned tensor's inputs turned into the base and the adapters' factor pairs.

mergekit merges one tensor at a time, so its ports of Core Space (PRs #645/#646) see only each adapter's dense
delta and squeeze it back to rank 16; here the plan pairs each adapter's ``lora_A`` with its ``lora_B`` instead: the
unit of an adapted module reads the base weight and the 2·T small factors, never an m × n delta. A tensor no adapter
factors (norms, the modules an adapter saves whole) is planned as the base alone, as the authors' code keeps it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from resumerge.config.merge_config import MergeConfig
from resumerge.errors import ConfigError
from resumerge.inputs.model import ModelInput
from resumerge.methods.core_space import FACTOR, SCALE, TRANSPOSED
from resumerge.plan.merge_plan import TensorPlan


def check_adapter_parents(config: MergeConfig, models: Mapping[str, ModelInput], method: str) -> None:
    """Refuse, in one line naming the YAML path, any parent but the base that is not a ``base+adapter`` reference
    of that very base, and adapters that change different modules."""
    base = config.base_model
    if base is None:
        return  # the method's base policy refuses it, with its own line
    targets: tuple[str, frozenset[str]] | None = None
    sources = list(config.all_models()) + [s for sl in config.all_slices() for s in sl.sources]
    for src in sources:
        ref = src.model
        if ref.key == base.key:
            continue
        if ref.lora is None:
            raise ConfigError(
                f"{method} merges LoRA adapters of the base, but {ref.key} is not a base+adapter reference",
                yaml_path=src.yaml_path, hint=f"write it as {base.key}+<adapter folder>")
        if ref.path != base.path or ref.revision != base.revision:
            own = ref.path if ref.revision is None else f"{ref.path}@{ref.revision}"
            raise ConfigError(
                f"{method} merges adapters of one base, but {ref.key} applies its adapter to {own}, not to the "
                f"base_model {base.key}", yaml_path=src.yaml_path)
        adapter = models[ref.key].adapter
        if adapter is None:  # opened without its adapter: cannot happen for a '+' reference
            raise ConfigError(f"{ref.key} has no adapter", yaml_path=src.yaml_path)
        changed = frozenset(adapter.targets)
        if targets is None:
            targets = (ref.key, changed)
        elif changed != targets[1]:
            only = sorted(changed ^ targets[1])
            raise ConfigError(
                f"{method} merges adapters of the same modules, but {ref.key} and {targets[0]} differ on "
                f"{len(only)} tensor(s), e.g. {only[0]}", yaml_path=src.yaml_path,
                hint="train the adapters on the same target_modules")


def factor_tensor(tp: TensorPlan) -> TensorPlan:
    """``tp`` with its inputs the base and, for each adapter that factors it (config order), its A and B factors,
    each factor's per-input parameters naming it, its adapter's scale and orientation; the base alone where no
    adapter factors it."""
    if tp.base_index is None:
        return tp
    base = tp.inputs[tp.base_index]
    inputs = [base]
    params = [tp.model_params[tp.base_index]]
    for i, ref in enumerate(tp.inputs):
        if i == tp.base_index or ref.lora is None:
            continue
        lora = ref.lora
        shared = ((SCALE, lora.scale), (TRANSPOSED, lora.fan_in_fan_out))
        inputs += [lora.a, lora.b]
        params += [((FACTOR, "A"), *shared), ((FACTOR, "B"), *shared)]
    return replace(tp, inputs=tuple(inputs), base_index=0, model_params=tuple(params))

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

import yaml

from resumerge.config.merge_config import MergeConfig
from resumerge.errors import ConfigError
from resumerge.inputs.adapters import CONFIG_NAME as ADAPTER_CONFIG
from resumerge.inputs.adapters import WEIGHTS_NAME as ADAPTER_WEIGHTS
from resumerge.inputs.adapters.settings import written_config
from resumerge.inputs.codecs import PLAIN
from resumerge.inputs.model import ModelInput
from resumerge.inputs.safetensors_format import layout_shard
from resumerge.merge.methods.core_space import EMIT, FACTOR, SCALE, TRANSPOSED
from resumerge.merge.plan.merge_plan import Plan, ShardPlan, TensorPlan
from resumerge.outputs.containers import PeftAdapter

CARD = "README.md"


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
        if (ref.path, ref.revision) != (base.path, base.revision) and not _same_files(models, ref.key, base.key):
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


def _same_files(models: Mapping[str, ModelInput], key: str, base_key: str) -> bool:
    """Whether the model under ``key`` (its adapter aside) is the base by content, however its path was written
    (``./base`` and ``/abs/base``): the same weight files, by name, size and identity."""
    mine, base = models.get(key), models.get(base_key)
    if mine is None or base is None:
        return False
    return [(f.name, f.size, f.identity) for f in mine.files] == [(f.name, f.size, f.identity) for f in base.files]


def kept_at_base(config: MergeConfig, models: Mapping[str, ModelInput], method: str) -> list[str]:
    """The plan's notes on what the adapters hold besides factors (``modules_to_save`` copies, trained biases):
    the factor merge keeps the base's tensor there, as the authors' code does, and the user should know."""
    notes = []
    for src in config.all_models():
        adapter = models[src.model.key].adapter if src.model.key in models else None
        if adapter is not None and adapter.replacements:
            names = sorted(adapter.replacements)
            notes.append(f"{method}: {src.model.key} also saves {len(names)} tensor(s) whole (e.g. {names[0]}); "
                         "the merge keeps the base's there, as the authors' code merges LoRA factors only")
    return notes


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


def adapter_output(plan: Plan, config: MergeConfig) -> Plan:
    """``plan`` (of a ``factor_inputs`` method) turned into a merged PEFT adapter (``--out-adapter``): per adapted
    module two float32 units, B′ (m × R′) and A′ (R′ × n) with R′ ≤ Σ rᵢ, named as the first adapter names its
    factors and read from the factors alone; ``adapter_config.json`` (scale 1 everywhere) and the card as the
    plan's side files. Not fingerprinted here: the caller does it."""
    tensors: dict[str, TensorPlan] = {}
    ranks: dict[str, int] = {}
    transposed = False
    for name, tp in plan.tensors.items():
        factors = [(ref, p) for ref, p in zip(tp.inputs, tp.model_params, strict=True) if FACTOR in dict(p)]
        if not factors:
            continue  # no adapter factors it: the merged adapter leaves it to the base
        a_refs = [ref for ref, p in factors if dict(p)[FACTOR] == "A"]
        b_refs = [ref for ref, p in factors if dict(p)[FACTOR] == "B"]
        # fan_in_fan_out is the linear layers' (Conv1D) setting; PEFT transposes every embedding's delta anyway.
        embedding = "lora_embedding_" in a_refs[0].tensor
        transposed = transposed or (not embedding and bool(dict(factors[0][1]).get(TRANSPOSED)))
        rank = min(sum(ref.shape[0] for ref in a_refs), a_refs[0].shape[1])
        ranks[name.removesuffix(".weight")] = rank
        unit = replace(tp, inputs=tuple(ref for ref, _ in factors), base_index=None,
                       model_params=tuple(p for _, p in factors), out_dtype="F32", out_codec=PLAIN, carried=(),
                       copy_of=None, experts=None, vocab_aligned=False, shard=ADAPTER_WEIGHTS)
        a_shape, b_shape = (rank, a_refs[0].shape[1]), (b_refs[0].shape[0], rank)
        for emit, ref, shape in (("A", a_refs[0], a_shape), ("B", b_refs[0], b_shape)):
            tensors[ref.tensor] = replace(unit, name=ref.tensor, shape=shape, params=(*tp.params, (EMIT, emit))).sized()
    if not tensors:
        raise ConfigError("--out-adapter: no tensor of the base is changed by the adapters", yaml_path="models")
    layout = layout_shard({n: (t.out_dtype, t.shape) for n, t in tensors.items()})
    base = config.base_model
    assert base is not None  # check_adapter_parents ran
    side = {ADAPTER_CONFIG: written_config(
        base_model=base.path, target_modules=sorted({m.rpartition(".")[2] for m in ranks}), modules_to_save=(),
        ranks=ranks, fan_in_fan_out=transposed)}
    if plan.options.write_model_card:
        side[CARD] = _card(config, plan, max(ranks.values()))
    return replace(plan, tensors={n: tensors[n] for n in sorted(tensors)},
                   shards=(ShardPlan(ADAPTER_WEIGHTS, tuple(p.name for p in layout.order), layout.file_size),),
                   tokenizer_donor=None, tokenizer_files=(), tokenizer_blobs={}, out_config={},
                   container=PeftAdapter(side), num_layers=0, layer_origins=(), vocab=None, vocab_digest="",
                   accounting=None, filters=())


def _card(config: MergeConfig, plan: Plan, rank: int) -> bytes:
    """The merged adapter's ``README.md``: the base, the adapters and the method with its paper."""
    base = config.base_model
    assert base is not None
    meta = yaml.safe_dump({"base_model": [base.path], "library_name": "peft",
                           "tags": ["resumerge", "peft", "lora", "merge"]}, sort_keys=False)
    adapters = [f"- `{s.model.lora.key}`" for s in config.all_models() if s.model.lora is not None]
    lines = ["---", meta.rstrip("\n"), "---", "# Merged LoRA adapter", "",
             f"This LoRA adapter of `{base.key}` was merged with resumerge from:", "", *adapters, "",
             f"Method: Core Space merging ([arXiv 2509.17786](https://arxiv.org/abs/2509.17786)), rank {rank}.", "",
             "### Configuration", "", "```yaml", config.text.rstrip("\n"), "```", ""]
    return "\n".join(lines).encode("utf-8")

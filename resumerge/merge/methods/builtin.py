"""The built-in merge methods: one explicit, immutable list, in the order their modules were written (as
mergekit's ``merge_methods/registry.py`` lists its methods). A new method module adds its spec here."""

from collections.abc import Mapping
from types import MappingProxyType

from resumerge.merge.methods import (
    arcee_fusion,
    core_space,
    iso,
    karcher,
    linear,
    model_stock,
    multislerp,
    nearswap,
    nuslerp,
    passthrough,
    ram,
    regmean,
    sce,
    slerp,
    task_arithmetic,
    tsv,
)
from resumerge.merge.methods.spec import MethodSpec, declared

BUILTIN: tuple[MethodSpec, ...] = declared(
    arcee_fusion.SPEC,
    karcher.SPEC,
    linear.SPEC,
    model_stock.SPEC,
    multislerp.SPEC,
    nearswap.SPEC,
    nuslerp.SPEC,
    passthrough.SPEC,
    ram.SPEC,
    ram.SPEC_PLUS,
    sce.SPEC,
    slerp.SPEC,
    *task_arithmetic.SPECS,
    tsv.SPEC,
    iso.SPEC_C,
    iso.SPEC_CTS,
    core_space.SPEC,
    regmean.SPEC,
    regmean.SPEC_PLUS,
)
# The same methods by name, read-only: get_method is asked for each of a plan's tensors (three times a tensor by
# plan's estimate), and a 92k-tensor plan's lookups by scanning the list cost a second.
BY_NAME: Mapping[str, MethodSpec] = MappingProxyType({spec.name: spec for spec in BUILTIN})

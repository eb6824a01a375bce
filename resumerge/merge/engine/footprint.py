"""The memory a merge's process holds apart from its units of work, and the smallest budget its merge works under.

``--max-memory`` counts the whole process (:class:`~resumerge.machine.memory.SystemProbe`). Its baseline is what a fresh
``resumerge run`` holds once it has imported the modules a merge uses (torch included), measured once per
installation in a fresh interpreter (:func:`~resumerge.machine.memory.baseline.fresh_baseline`), plus what the run adds
beside its units: the plan and the inputs' headers, the ledger, the threads' stacks and heaps. ``plan`` and ``run``
both name :func:`smallest_run_budget`, so they name the same figure for the same plan on the same installation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from resumerge.config.locations import cache_root
from resumerge.machine import torch_import
from resumerge.machine.memory import SystemProbe, smallest_budget_for
from resumerge.machine.memory.baseline import fresh_baseline
from resumerge.merge.plan.merge_plan import Plan
from resumerge.merge.plan.unitkey import TensorClasses
from resumerge.merge.plan.workunits import Oversized, smallest_budget

__all__ = ["RUN_MODULES", "compile_ahead", "kernel_spec", "measured_spec", "run_baseline", "run_modules",
           "run_overhead", "smallest_run_budget"]

# What ``resumerge run`` imports before its first unit (``python -X importtime`` of a run, less what planning
# imports only for the methods and formats it meets): the baseline is measured in a fresh interpreter importing these.
RUN_MODULES = ("resumerge.cli.commands", "resumerge.cli.render", "resumerge.api",
               "resumerge.merge.engine.session", "resumerge.merge.engine.drive", "resumerge.merge.methods.builtin",
               "resumerge.merge.plan.planner", "torch")
# What a run's process holds beyond a fresh one at its start, besides its units: the ledger's SQLite pages, the
# worker, writer and sampler threads' stacks and heaps, torch's thread pool, buffers glibc keeps; and per planned
# tensor its plan, its inputs' header entries and its ledger rows. Measured: a 111-tensor merge's process held
# 5.4 MB over a fresh one once planned, and grew by about 20 MB more in its first units (issue 71).
RUN_OVERHEAD = 24 << 20
PER_TENSOR = 4 << 10
# The measure's entry that loads a spec of compiled kernels (:func:`kernel_spec`).
_WARM = "resumerge.outputs.gguf.encoders:warm_kernels:"


def run_overhead(plan: Plan) -> int:
    """What the run of ``plan`` holds beside its units and the fresh process's baseline (see the module)."""
    return RUN_OVERHEAD + PER_TENSOR * len(plan.tensors)


def run_baseline(plan: Plan, before: Sequence[str] = ()) -> int:
    """The resident bytes the run of ``plan`` holds apart from its units of work: a fresh run process's baseline
    (cached per installation) that imported ``before`` too (a phase's modules, where the merge follows a phase in
    the run's process) and loaded the compiled kernels its GGUF encoding uses (numba's runtime and each type's
    kernels: about 126 MB for the K-quants, which no import holds and the governor does not reserve:
    :func:`kernel_spec`; every K-quant's and IQ4's where those are all it uses: :func:`measured_spec`), plus
    :func:`run_overhead`. Where a fresh process cannot
    be measured (no interpreter to start, or a container with no room for a second process), this process's own
    reading, torch imported, stands in for it."""
    modules = run_modules(plan, before)
    fresh = fresh_baseline(modules, cache_root())
    # its kernels could not be loaded there (a compilation over the measure's time): measured without them
    if fresh is None and modules[-1].startswith(_WARM):
        fresh = fresh_baseline((*RUN_MODULES, *before), cache_root())
    if fresh is None:
        torch_import.load()
        fresh = SystemProbe().rss()
    return fresh + run_overhead(plan)


def run_modules(plan: Plan, before: Sequence[str] = ()) -> tuple[str, ...]:
    """What :func:`run_baseline`'s fresh process imports (and loads) for the run of ``plan`` after ``before``."""
    spec = measured_spec(kernel_spec(plan))
    return (*RUN_MODULES, *before, *((f"{_WARM}{spec}",) if spec else ()))


def smallest_run_budget(plan: Plan, baseline: int, device: str | None = None, classes: TensorClasses | None = None,
                        *, threads: int | None = None) -> Oversized:
    """The smallest ``--max-memory`` the merge of ``plan`` works under beside ``baseline`` (:func:`run_baseline`),
    with the tensor whose step sets it (no tensor, ``""``, for a plan without tensors: its baseline alone)."""
    worst = smallest_budget(plan, baseline, device, classes, threads=threads)
    return worst if worst is not None else Oversized("", "", smallest_budget_for(0, baseline_bytes=baseline))


def kernel_spec(plan: Plan) -> str:
    """The compiled kernels the GGUF encoding of ``plan`` loads (each tensor's type, and a release's each file's, with
    or without its importance matrix), as :func:`~resumerge.outputs.gguf.encoders.warm_kernels` reads them:
    ``"12,14w"`` (type ids, ``w`` where weighted); ``""`` where none is compiled (no such type, or numba missing).
    A size target's (``--gguf-target-size``): each tensor it chooses counts every candidate type, weighted, in place
    of its own (the importance pass measures it at each of them in the run's process, and the merge encodes it at
    the one chosen), so the plan before the choice and the one after it name the same kernels."""
    from resumerge.merge.plan.ggufbudget import chosen_tensor
    from resumerge.outputs.gguf import jit
    from resumerge.outputs.gguf.encoders import SEARCHED, UNWEIGHTED
    from resumerge.outputs.gguf.outcodec import GgufOutCodec
    from resumerge.outputs.gguf.releasecodec import ReleaseCodec
    from resumerge.outputs.gguf.sensitivity import candidate_types

    targeted = plan.options.gguf_target_size is not None or plan.options.gguf_target_bpw is not None
    found: set[str] = set()
    pending: list[tuple[object, tuple[int, ...]]] = [(tp.out_codec, tp.shape) for tp in plan.tensors.values()]
    while pending:
        codec, shape = pending.pop()
        if isinstance(codec, ReleaseCodec):
            pending.extend((each, shape) for each in codec.codecs)
        elif not isinstance(codec, GgufOutCodec):
            continue
        elif targeted and chosen_tensor(codec.gguf_name, shape):
            found.update(f"{each}w" if each in SEARCHED else str(each)
                         for each in candidate_types(shape[-1]) if each in SEARCHED or each in UNWEIGHTED)
        elif codec.ggml_type in SEARCHED or codec.ggml_type in UNWEIGHTED:
            found.add(f"{codec.ggml_type}{'w' if codec.imatrix and codec.ggml_type in SEARCHED else ''}")
    if not found or jit.numba_module() is None:
        return ""
    return ",".join(sorted(found))


def compile_ahead(plan: Plan, cores: int | None = None) -> tuple[tuple[str, ...], ...]:
    """Module lists whose fresh processes, started together, compile the kernels :func:`run_baseline` loads for
    ``plan`` (:func:`measured_spec`) into numba's disk cache, so that its measurements (two for a run with an
    importance pass: :func:`~resumerge.machine.memory.baseline.measure_ahead`) load them rather than each compiling
    them all (27 CPU s for the 7-type release's, in one process): the spec's entries by family
    (:func:`~resumerge.outputs.gguf.encoders.kernel_family`, whose kernels they share), the families dealt over at
    most ``cores`` processes (this machine's CPUs). Empty where nothing is compiled, or where numba's cache holds
    them already (:func:`~resumerge.outputs.gguf.jit.on_disk`)."""
    spec = measured_spec(kernel_spec(plan))
    if not spec:
        return ()
    from resumerge.outputs.gguf import jit
    from resumerge.outputs.gguf.encoders import kernel_family

    families: dict[str, list[str]] = {}
    for entry in spec.split(","):
        families.setdefault(kernel_family(int(entry.rstrip("w"))), []).append(entry)
    if jit.on_disk(families):  # compiled before: each measurement loads them (a process each would cost 3 CPU s)
        return ()
    groups: list[list[str]] = [[] for _ in range(min(len(families), max(1, cores or os.cpu_count() or 1)))]
    for i, entries in enumerate(families.values()):
        groups[i % len(groups)].extend(entries)
    return tuple((f"{_WARM}{','.join(group)}",) for group in groups)


def measured_spec(spec: str) -> str:
    """The kernels :func:`run_baseline` loads in its measurement for a run that loads ``spec``
    (:func:`kernel_spec`): where they are all K-quants' or IQ4's (IQ4_NL, IQ4_XS: the fallbacks of K-quant mixes for
    rows not of 256 values), every one of those, weighted and not, so that all such runs of an installation read
    one measurement (one fresh process importing torch and numba, 4-6 CPU s) rather than one per set of types.
    Measured in fresh processes (bench/bench_kernel_baseline.py): any such set, one type or all fourteen kernels,
    held 362.3-365.6 MB, numba's runtime about 126 MB of it, so the union names at most 3.3 MB more than the set a
    run loads and never less. A set with another i-quant's, TQ's or MXFP4's kernel is measured as it is: those sets'
    figures are not the sum of their kernels' (the 1- to 3-bit i-quants' with the K-quants' held 450 MB, either
    family alone 371 and 365)."""
    from resumerge.inputs.gguf.ggmltypes import IQ4_NL, IQ4_XS
    from resumerge.outputs.gguf.kquants import K_TYPES

    alike = (*K_TYPES, IQ4_NL, IQ4_XS)
    entries = spec.split(",") if spec else []
    if not entries or any(int(each.rstrip("w")) not in alike for each in entries):
        return spec
    return ",".join(sorted(f"{code}{weighted}" for code in alike for weighted in ("", "w")))

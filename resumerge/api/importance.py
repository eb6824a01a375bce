"""``run --out-type gguf --imatrix-texts FILE``: the importance matrix computed on the merge itself before its GGUF
is encoded. The merge's float plan (the same config and options, written as safetensors) is opened as the model it
describes, never written (:class:`~resumerge.merge.engine.unwritten.UnwrittenMerge`), and the texts run through it by
:func:`~resumerge.analyses.importance.onmerge.importance_on_merge` into the file the GGUF plan's codecs read
(``PlanOptions.imatrix``, in the state dir: :func:`computed_imatrix`). The pass is a phase of the run
(:class:`ImportancePhase`): recorded with the plan before it starts, judged against the budget by ``plan``'s own
figures (:func:`importance_cost`) before anything is written, resumed from its journal by ``resume``."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from resumerge.analyses.estimate.firstpass import FirstPass
    from resumerge.config.locations import StateDir
    from resumerge.config.settings import RunSettings
    from resumerge.merge.plan.merge_plan import Plan, PlanOptions
    from resumerge.merge.plan.prepared import Prepared, Progress


@dataclass(frozen=True)
class ImportancePhase:
    """``--imatrix-texts``' pass as a phase of the run (:class:`~resumerge.merge.plan.prepared.Phase`): the matrix
    of the merge ``text`` describes (planned with ``options``; its models at ``model_dirs`` where a resume found
    them) over ``options.imatrix_texts``, under ``settings``; ``command`` continues it."""

    text: str
    options: PlanOptions
    settings: RunSettings
    command: str
    model_dirs: Mapping[str, str] | None = None
    name: ClassVar[str] = "the importance matrix pass over the merge"

    @property
    def key(self) -> str:
        """The matrix's name: the config's and the texts' digest (:func:`imatrix_key`)."""
        return Path(self.options.imatrix or "").stem

    def admit(self, plan: Plan, max_memory: int | None) -> None:
        """Refuse (exit 2) a budget the pass's step does not fit in beside its process, as ``plan`` names it."""
        from resumerge.errors import UsageError
        from resumerge.machine.memory import SystemProbe, default_budget, format_size

        texts = self.options.imatrix_texts
        assert texts is not None, "a phase of --imatrix-texts"
        cost = importance_cost(texts, measuring=measures_costs(self.options))(plan)
        budget = max_memory if max_memory is not None else default_budget(SystemProbe())
        if cost.smallest_budget > budget:
            raise UsageError(f"{self.name} needs a budget of {format_size(cost.smallest_budget)} (its process about "
                             f"{format_size(cost.baseline_bytes)}, its largest step {format_size(cost.held_bytes)}), "
                             f"more than the budget of {format_size(budget)}",
                             hint=f"rerun with --max-memory {format_size(cost.smallest_budget, compact=True)} or more")
        if cost.merge_budget > budget:  # the merge after it, in the process the pass leaves, its kernels loaded
            raise UsageError(f"the merge after {self.name} needs a budget of {format_size(cost.merge_budget)} (its "
                             f"process about {format_size(cost.merge_baseline_bytes)} with the pass's modules and the "
                             f"GGUF encoders' kernels), more than the budget of {format_size(budget)}",
                             hint=f"rerun with --max-memory {format_size(cost.merge_budget, compact=True)} or more")

    def run(self, progress: Progress, tell: Callable[[str], None]) -> None:
        """The pass (:func:`importance_pass`), each layer made durable told as ``(done, layers, "layer")``; its
        budget judged by :meth:`admit` already, by ``plan``'s figures."""
        importance_pass(self.text, self.options, self.settings, command=self.command, model_dirs=self.model_dirs,
                        tell=tell, progress=lambda done, total: progress(done, total, "layer"), judged=True)


def importance_phases(text: str, options: PlanOptions, settings: RunSettings, *, command: str,
                      model_dirs: Mapping[str, str] | None = None) -> tuple[ImportancePhase, ...]:
    """The run's phases before its merge: the importance pass where ``options`` ask one, else none."""
    if options.imatrix_texts is None or options.imatrix is None:
        return ()
    return (ImportancePhase(text, options, settings, command, model_dirs),)


def importance_pass(text: str, options: PlanOptions, settings: RunSettings, *, command: str,
                    model_dirs: Mapping[str, str] | None = None, tell: Callable[[str], None] | None = None,
                    progress: Callable[[int, int], None] | None = None, judged: bool = False) -> None:
    """Compute the importance matrix of the merge ``text`` describes (planned with ``options``; its models at
    ``model_dirs`` where a resume found them) over ``options.imatrix_texts`` into ``options.imatrix``, within
    ``settings``' memory budget; nothing where the options ask none, or the file holds this very matrix already.
    ``command`` continues it (a second process is told it); ``tell``: what the user must hear; ``progress``: the
    layers done, as each is made durable; ``judged``: its budget judged already (the run's phase, by ``plan``'s
    figures). Raises UsageError (exit 2) before any weight is read for a text longer
    than the merge's context, a family resumerge does not write as GGUF, a budget too small."""
    if options.imatrix_texts is None or options.imatrix is None:
        return
    from resumerge.analyses.importance.onmerge import PassTerms, importance_on_merge
    from resumerge.config.merge_config import load_config_text
    from resumerge.forward.sums.imatrix import gguf_arch
    from resumerge.forward.text.texts import context_of, load_tokenizer, sequences
    from resumerge.inputs.catalog import fetch_inputs
    from resumerge.machine.memory import MemoryGovernor, SystemProbe, default_budget
    from resumerge.merge.engine.devices import set_torch_threads
    from resumerge.merge.engine.session import prepare
    from resumerge.merge.engine.unwritten import UnwrittenMerge

    texts = options.imatrix_texts
    state = settings.state
    # The GGUF options at their defaults: the merge's float plan, whose values the pass reads.
    floats = replace(options, out_type="safetensors", gguf_type="f16", gguf_tensor_types=(), gguf_output_type=None,
                     gguf_token_embedding_type=None, imatrix=None, imatrix_texts=None, gguf_split_max_size=None,
                     gguf_override_kv=(), gguf_pure=False, gguf_target_size=None, gguf_target_bpw=None,
                     gguf_chosen_types=())
    prepared = prepare(load_config_text(text), floats, model_dirs=model_dirs, state=state, cache_dir=settings.cache_dir)
    fetch_inputs(prepared.opened(), state=state)
    set_torch_threads(settings.num_threads)  # run's thread count: the merged values are run's
    budget = settings.max_memory if settings.max_memory is not None else default_budget(SystemProbe())
    with MemoryGovernor(budget, SystemProbe()) as governor, \
            UnwrittenMerge(prepared.plan, state.unwritten_dir, governor=governor) as merge:
        arch = gguf_arch(merge.config.get("model_type"), "--imatrix-texts")
        tokenizer = load_tokenizer([merge.directory], what="resumerge run --imatrix-texts", plain=True)
        tokens = sequences(tokenizer, Path(texts), context_of([("the merge", merge.config)]),
                           option="--imatrix-texts")
        if tell is not None:
            tell(f"importance matrix: {len(tokens)} texts of {os.path.basename(texts)} through the merge, "
                 "one decoder layer at a time (--imatrix-texts)")
        out = Path(options.imatrix)
        out.parent.mkdir(parents=True, exist_ok=True)
        terms = PassTerms(os.path.basename(texts), settings.max_memory, command, judged, measures_costs(options))
        report = importance_on_merge(merge, arch, tokens, out, terms, progress)
    if tell is not None:
        found = "found computed" if report.reused else "computed"
        tell(f"importance matrix {found} on the merge: {report.entries} weights, {report.texts} texts, "
             f"{report.tokens} tokens")


def measures_costs(options: PlanOptions) -> bool:
    """Whether the pass measures each linear's costs too: a size target's (``--gguf-target-size``)."""
    return options.gguf_target_size is not None or options.gguf_target_bpw is not None


def target_settle(text: str, options: PlanOptions, settings: RunSettings,
                  model_dirs: Mapping[str, str] | None = None) -> Callable[[Plan], Prepared | None] | None:
    """How a run with a size target (``--gguf-target-size``, its types not chosen yet) settles its plan once the
    importance pass measured the costs: the types :func:`~resumerge.merge.plan.ggufbudget.choose_for` picks
    recorded in the options (``gguf_chosen_types``) and the merge ``text`` planned again with them; None for a run
    without a target or whose options hold the choice already."""
    if not measures_costs(options) or options.gguf_chosen_types or options.imatrix is None:
        return None
    imatrix = options.imatrix

    def settle(plan: Plan) -> Prepared:
        import json

        from resumerge.analyses.importance.onmerge import costs_path
        from resumerge.config.merge_config import load_config_text
        from resumerge.merge.engine.session import prepare
        from resumerge.merge.plan.ggufbudget import Target, choose_for, chosen_pairs

        costs = json.loads(costs_path(Path(imatrix)).read_text(encoding="utf-8"))
        (shard,) = plan.shards
        choice = choose_for(plan.tensors, shard.file_size, Target(options.gguf_target_size, options.gguf_target_bpw),
                            costs)
        chosen = replace(options, gguf_chosen_types=chosen_pairs(choice))
        return prepare(load_config_text(text), chosen, model_dirs=model_dirs or plan.model_dirs, state=settings.state,
                       cache_dir=settings.cache_dir)

    return settle


def recorded_choice(options: PlanOptions, text: str, ledger: Path) -> PlanOptions:
    """``options`` of a run with a size target, with the types the run into the same OUT recorded in ``ledger``
    chose, where that run had the same config text, mix, target and texts: running the same command again
    continues the run its choice settled, as ``resume`` does (any other difference still makes another plan, which
    the run refuses as such); else ``options``."""
    if not measures_costs(options) or options.gguf_chosen_types or not ledger.is_file():
        return options
    from resumerge.errors import LedgerError
    from resumerge.merge.store.ledger_read import reading, run_row

    try:
        with reading(ledger, "ledger") as conn:
            row = run_row(conn)
    except LedgerError:
        return options  # the run itself says what is wrong with it
    if row is None or row.config_text != text:
        return options
    same = all(row.options.get(name) == getattr(options, name) for name in _TARGET_OPTIONS)
    chosen = tuple(row.options.get("gguf_chosen_types") or ())
    return replace(options, gguf_chosen_types=chosen) if same and chosen else options


# What makes a recorded choice this run's (recorded_choice).
_TARGET_OPTIONS = ("out_type", "gguf_type", "gguf_target_size", "gguf_target_bpw", "imatrix_texts_sha256")


def computed_imatrix(options: PlanOptions, text: str, state: StateDir) -> PlanOptions:
    """``options`` with, for ``--imatrix-texts``, where the run writes the importance matrix it computes on the
    merge: a file in the state dir named by the config and the texts (the plan's codecs read it there); unchanged
    without it."""
    if options.imatrix_texts is None:
        return options
    if options.imatrix_texts_sha256 is None:  # options made by hand: the digest the API's front door records
        from resumerge.api.ggufoptions import file_sha256

        options = replace(options, imatrix_texts_sha256=file_sha256(Path(options.imatrix_texts)))
    assert options.imatrix_texts_sha256 is not None
    return replace(options, imatrix=str(state.root / IMATRIX_DIR /
                                        f"{imatrix_key(text, options.imatrix_texts_sha256)}.gguf"))


def imatrix_key(text: str, texts_sha256: str) -> str:
    """The name of the importance matrix computed for the merge config ``text`` from the texts whose bytes have the
    digest ``texts_sha256`` (other texts, another file; the same texts from any folder, the same file)."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps([text, texts_sha256]).encode()).hexdigest()[:16]


# Under the state dir: the importance matrices computed on merges (--imatrix-texts), each with its pass's journal.
IMATRIX_DIR = "imatrix"

# The pass's float32 forward per weight of a layer's matrices and token: 1.35e-10 s measured for a 2048 x 5632
# matmul over 60 tokens on one core of the project's 2-core machine (torch 2.13, under the other engineers' load).
_SECONDS_PER_WEIGHT_TOKEN = 1.35e-10
# A text's tokens where no input folder holds a tokenizer plan can read (GGUF inputs): about one per 4 bytes.
_BYTES_PER_TOKEN = 4
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def importance_cost(texts: str, *, measuring: bool = False) -> Callable[[Plan], FirstPass]:
    """What ``run --imatrix-texts texts`` spends on its importance matrix pass before the merge, from ``plan`` (the
    GGUF merge's: its tensors are the float merge's, encoded otherwise): the pass reads each decoder layer's and the
    embeddings' tensors once, merged as read (their inputs' bytes, their share of the merge's compute), holds its
    largest step beside the hidden states (:func:`~resumerge.analyses.importance.onmerge.pass_held`; the step as the
    pass counts it, ``_ImportanceJob._step``, beside its process as it starts, :func:`pass_baseline`: the figure
    the run's phase judges), journals every layer's hidden states and the sums so far, and runs the texts' tokens
    through every layer's matrices; ``measuring`` (a size target): with each matrix's cost measured at every
    candidate type (:func:`measuring_seconds`)."""

    def cost(plan: Plan) -> FirstPass:
        from resumerge.analyses.estimate.firstpass import FirstPass
        from resumerge.analyses.importance.ahead import ahead_fits
        from resumerge.analyses.importance.onmerge import pass_held, states_bytes, texts_held
        from resumerge.inputs.codecs.plain import PLAIN
        from resumerge.inputs.gguf.names import expert_target
        from resumerge.merge.engine.unwritten.compute import rows_alone
        from resumerge.merge.plan.workunits import estimate_bytes

        tokens, distinct, lengths = _tokens(plan, Path(texts))
        hidden = int(plan.out_config.get("hidden_size") or 0)
        config = plan.out_config
        experts = int(config.get("num_experts") or config.get("num_local_experts") or 1)
        used = int(config.get("num_experts_per_tok") or experts)
        read = total = matrices = whole = 0  # whole: the largest merge of any tensor (the room a read-ahead uses)
        # By step (a layer, or the embeddings), as the pass's guard counts it (onmerge._ImportanceJob._step): its
        # float32 values (the embeddings' of the rows the texts use, where they merge alone; ``tables``: whole),
        # and the largest merge of its own tensors as the float plan the pass reads makes it (their values, not the
        # GGUF's blocks).
        held: dict[str, int] = {}
        tables: dict[str, int] = {}
        merges: dict[str, int] = {}
        sums: dict[str, int] = {}  # by layer: its linears' input columns (one float64 sum each)
        for name, tp in plan.tensors.items():
            size = sum(i.end - i.start for i in tp.inputs)
            total += size
            floats, spec = replace(tp, out_codec=PLAIN, carried=()).sized(), plan.method_of(tp)
            whole = max(whole, estimate_bytes(floats, spec))
            layer = _LAYER.search(name)
            if layer is None and "embed_tokens" not in name:
                continue  # the head and the last norm: the pass never runs them
            read += size
            step = layer.group(1) if layer is not None else "embeddings"
            values = math.prod(tp.shape)
            rows = (distinct if layer is None and distinct and len(tp.shape) == 2 and rows_alone(floats, spec)
                    else None)
            tables[step] = tables.get(step, 0) + 4 * values
            held[step] = held.get(step, 0) + 4 * values * (rows or tp.shape[0]) // tp.shape[0]
            merges[step] = max(merges.get(step, 0), estimate_bytes(floats, spec, rows=rows))
            if layer is not None and len(tp.shape) in (2, 3):
                # a routed expert's weights see only the tokens routed to it: used of experts, on average
                routed = expert_target(name) is not None
                matrices += values * used // experts if routed else values
                sums[step] = sums.get(step, 0) + math.prod(tp.shape[:-2]) * tp.shape[-1]
        layers = len(sums)
        needs = {step: held[step] + merges[step] for step in held}
        layered = [need for step, need in needs.items() if step != "embeddings"]
        ahead = ahead_fits(max(tables.values(), default=0),
                           max((m for step, m in merges.items() if step != "embeddings"), default=0), whole)
        largest = max(needs.values(), default=0) + (max(layered, default=0) if ahead else 0)
        # beside it, the texts' products as a layer runs them (and a size target's costs measured)
        largest += texts_held(((n, tp.shape) for n, tp in plan.tensors.items()), lengths, hidden,
                              measuring=measuring)
        states = states_bytes(tokens, hidden) // 2  # one set of hidden states, as a layer's journal holds it
        layer_sums = 8 * max(sums.values(), default=0)
        # Each layer's journal: the hidden states leaving it and every sum so far (the older file deleted after).
        written = sum(states + layer_sums * (i + 1) for i in range(layers))
        matrix = 4 * sum(sums.values())
        return FirstPass(f"{ImportancePhase.name} ({Path(texts).name}, --imatrix-texts)", tokens,
                         read, read / total if total else 0.0, written + matrix,
                         2 * (states + layer_sums * layers) + matrix, pass_held(largest, tokens, hidden),
                         matrices * tokens * _SECONDS_PER_WEIGHT_TOKEN
                         + (measuring_seconds(plan, tokens) if measuring else 0.0),
                         pass_baseline(plan, measuring=measuring), *merge_after_pass(plan))

    return cost


# The cost of a matrix at one candidate type, per value measured (encoded with the matrix, decoded, its error
# summed): 280 ns measured on a 576 x 1536 matrix at the 32-value candidates on one core of the project's 2-core
# machine (numba 0.68, under the other engineers' load); 1.1 µs on a 512 x 1536 one at the K- and i-quants (550 ns
# unloaded: the i-quants' grid searches are most of it).
_SECONDS_PER_VALUE_TYPE = 2.8e-7
_SECONDS_PER_VALUE_SEARCHED = 1.1e-6


def measuring_seconds(plan: Plan, tokens: int) -> float:
    """The CPU seconds the pass spends measuring the costs of ``plan``'s decoder matrices (a size target's) over
    ``tokens`` tokens of texts: each at its candidate types, and its layer run again on the first texts (at most
    :data:`~resumerge.outputs.gguf.sensitivity.RERUN_TOKENS` tokens or so) once per matrix and once for its gain."""
    from resumerge.merge.plan.ggufbudget import chosen_tensor
    from resumerge.outputs.gguf.outcodec import GgufOutCodec
    from resumerge.outputs.gguf.sensitivity import K_CANDIDATES, RERUN_TOKENS, candidate_types, measured_values

    seconds = 0.0
    layers: dict[str, list[int]] = {}  # by layer: its chosen matrices' values, and how many there are
    for name, tp in plan.tensors.items():
        codec = tp.out_codec
        if isinstance(codec, GgufOutCodec) and chosen_tensor(codec.gguf_name, tp.shape):
            types = candidate_types(tp.shape[-1])
            each = _SECONDS_PER_VALUE_SEARCHED if types == K_CANDIDATES else _SECONDS_PER_VALUE_TYPE
            seconds += measured_values(tp.shape) * len(types) * each
            found = _LAYER.search(name)
            layer = layers.setdefault(found.group(1) if found else name, [0, 0])
            layer[0] += math.prod(tp.shape)
            layer[1] += 1
    reruns = sum(values * (count + 1) for values, count in layers.values())
    return seconds + reruns * min(tokens, RERUN_TOKENS) * _SECONDS_PER_WEIGHT_TOKEN


# What the pass's process has imported as it starts, beyond a run's modules: the pass's own, a tokenizer's library,
# numba where it is installed (a K-quant run imports it for its encoders, and scipy with it), and the family's
# modules: resumerge's own where it builds them (forward.engine.native), else transformers' and its modeling module.
# On real SmolLM2 to q4_k_m the run's process held 346 MB as its pass started; a fresh process of these modules
# 309 MB, of a run's alone 247 MB.
PASS_MODULES = ("resumerge.forward.engine.stream", "resumerge.analyses.importance.onmerge",
                "resumerge.merge.engine.unwritten")
_OPTIONAL = ("tokenizers", "numba")


def pass_modules(plan: Plan) -> tuple[str, ...]:
    """What the run's process imports for its importance pass over ``plan``'s merge, beyond a run's modules
    (:data:`PASS_MODULES`, the optional ones installed, then the family's: :func:`_family_modules`)."""
    import importlib.util

    return (*PASS_MODULES, *(m for m in _OPTIONAL if importlib.util.find_spec(m) is not None), *_family_modules(plan))


def _family_modules(plan: Plan) -> tuple[str, ...]:
    """The modules the pass builds ``plan``'s family with: resumerge's own (forward.engine.native), else
    transformers'."""
    from resumerge.forward.engine.native.config import read_config

    family = str(plan.out_config.get("model_type") or "")
    if read_config(plan.out_config) is not None:
        return ("resumerge.forward.engine.native.modules",)
    return ("transformers", *((f"transformers.models.{family}.modeling_{family}",) if family.isidentifier() else ()))


def pass_baseline(plan: Plan, *, measuring: bool = False) -> int:
    """What the run's process holds as its importance pass starts: a fresh process that imported the run's modules
    and the pass's (:func:`pass_modules`; measured once per installation,
    :func:`~resumerge.machine.memory.baseline.fresh_baseline`), the run's overhead and its two plans (the GGUF merge's
    and the float one the pass reads); the merge's baseline where no fresh process can be measured. ``measuring`` (a
    size target's pass, which encodes each matrix at every candidate type): with those types' kernels and tables
    loaded, the baseline of the merge after it (:func:`merge_after_pass`, whose kernels count the candidates':
    :func:`~resumerge.merge.engine.footprint.kernel_spec`)."""
    from resumerge.config.locations import cache_root
    from resumerge.machine.memory.baseline import fresh_baseline, measure_ahead
    from resumerge.merge.engine.footprint import (
        PER_TENSOR,
        RUN_MODULES,
        compile_ahead,
        run_baseline,
        run_modules,
        run_overhead,
    )

    modules = pass_modules(plan)
    # This one and the merge's after it (merge_after_pass, the merge's own guard): on an installation's first such
    # run, measured together rather than one after another, the encoders' kernels compiled once for both.
    measure_ahead(((*RUN_MODULES, *modules), run_modules(plan, modules), run_modules(plan)), cache_root(),
                  prepare=compile_ahead(plan))
    if measuring:
        return merge_after_pass(plan)[0]
    fresh = fresh_baseline((*RUN_MODULES, *modules), cache_root())
    if fresh is None:  # a family transformers names otherwise
        fresh = fresh_baseline((*RUN_MODULES, *modules[:len(modules) - len(_family_modules(plan))]), cache_root())
    if fresh is None:
        return run_baseline(plan)
    return fresh + run_overhead(plan) + PER_TENSOR * len(plan.tensors)


def merge_after_pass(plan: Plan) -> tuple[int, int]:
    """The merge of ``plan`` as it follows the importance pass in the run's process: its baseline (the process with
    the pass's modules imported and the encoders' kernels loaded,
    :func:`~resumerge.merge.engine.footprint.run_baseline`, and the float plan the pass read) and the smallest
    budget it works under beside it. That process holds at least what the merge's own does: the larger of the two
    fresh measurements counts (each is measured once, and two fresh processes differ by some MB; the merge's own
    guard, :func:`~resumerge.merge.engine.devices.make_governor`, judges by the other one)."""
    from resumerge.merge.engine.footprint import PER_TENSOR, run_baseline, smallest_run_budget

    baseline = max(run_baseline(plan, pass_modules(plan)), run_baseline(plan)) + PER_TENSOR * len(plan.tensors)
    return baseline, smallest_run_budget(plan, baseline).needed


def _tokens(plan: Plan, texts: Path) -> tuple[int, int | None, list[int]]:
    """The tokens of ``texts`` as the pass counts them, how many distinct ones, and each text's, by the first input
    folder's tokenizer read without transformers (the donor's first); else about one per :data:`_BYTES_PER_TOKEN`
    bytes of each text (the distinct ones unknown: None), and each text's the most it can be (what a layer holds of
    it is counted by them: a byte a token, and one more, within the model's context)."""
    from resumerge.forward.text.plaintok import plain_tokenizer
    from resumerge.forward.text.texts import read_texts, sequences

    for key in (plan.donor, *plan.model_dirs):
        folder = plan.model_dirs.get(key)
        tokenizer = plain_tokenizer(Path(folder)) if folder is not None else None
        if tokenizer is not None:
            found = sequences(tokenizer, texts, option="--imatrix-texts")
            return sum(len(t) for t in found), len({t for each in found for t in each}), [len(t) for t in found]
    lines = [line.encode() for line in read_texts(texts, "--imatrix-texts").splitlines() if line.strip()]
    context = int(plan.out_config.get("max_position_embeddings") or 0)
    return (sum(1 + math.ceil(len(line) / _BYTES_PER_TOKEN) for line in lines), None,
            [min(1 + len(line), context) if context > 0 else 1 + len(line) for line in lines])

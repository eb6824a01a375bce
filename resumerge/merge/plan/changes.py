"""What changed between a recorded run and a plan made today, in sentences a user can act on: the version, an
option (both values), an input file (new, changed, gone) or the config's keys (``models[0].parameters.weight 0.5 →
0.6``). A resume whose plan has another fingerprint is refused with these (:mod:`resumerge.merge.plan.merge_plan`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from pathlib import PurePath
from typing import Any

from resumerge.config.yamldiff import config_changes
from resumerge.merge.plan.merge_plan import LATER_OPTIONS, PATH_OPTIONS, Plan, PlanOptions, fingerprint_parts

# Names of the parts a kind of run adds to its plan's fingerprint (Plan.extra_parts) that the sentences below tell:
# a file it read beside the weights (READ_PART + "KEY/NAME": a transplant's tokenizers) and its card's own words.
READ_PART, CARD_PART = "read ", "card"


def describe_changes(
    recorded_parts: Mapping[str, str],
    recorded_inputs: Mapping[str, list[list[Any]]],
    plan: Plan,
    *,
    recorded_options: Mapping[str, Any] | None = None,
    configs: tuple[str, str] | None = None,
) -> list[str]:
    """Human sentences for each difference between a recorded run and ``plan`` (empty when none).

    With ``recorded_options`` (the run's recorded PlanOptions) a changed option is named with both values; with
    ``configs`` (the recorded config text and today's) a changed plan is told as the config's keys and values that
    changed (``models[0].parameters.weight 0.5 → 0.6``); without them, or when the configs read alike (an input's
    tensors changed), the sentence names what may have changed."""
    now = fingerprint_parts(plan)
    changes = []
    if recorded_parts.get("version") != now["version"]:
        changes.append(f"resumerge version changed ({recorded_parts.get('version')} -> {now['version']})")
    if recorded_parts.get("options") != now["options"]:
        pinned = (recorded_options is not None and plan.options.num_threads is not None
                  and recorded_options.get("num_threads") == plan.options.num_threads)
        changes.extend(_option_changes(recorded_options, plan.options) or ([
            f"-j {plan.options.num_threads}'s kernels changed (an earlier resumerge split MKL's kernels over -j's "
            "threads where each tensor now computes on one)"] if pinned else []) or [
            "output options changed (--out-shard-size, --random-seed, --device, tokenizer copying, "
            "--no-write-model-card, --unsafe-truncate-embeddings, --dequantize or, for slerp, karcher, "
            "model_stock and nuslerp, -j/--num-threads)"])
    if recorded_parts.get("inputs") != now["inputs"]:
        for model, files in sorted(plan.inputs.items()):
            before = {f[0]: f for f in recorded_inputs.get(model, [])}
            for name, size, ident in files:
                old = before.get(name)
                if old is None:
                    changes.append(f"input {model}/{name} is new")
                elif list(old) != [name, size, ident]:
                    changes.append(f"input file {model}/{name} changed (size {old[1]} -> {size})")
            for name in sorted(set(before) - {f[0] for f in files}):
                changes.append(f"input file {model}/{name} is gone")
        missing = sorted(set(recorded_inputs) - set(plan.inputs))
        changes.extend(f"input model {m} is no longer used" for m in missing)
        if not changes:
            changes.append("input files changed")
    for part in sorted({p for p in (*recorded_parts, *now) if p.startswith(READ_PART)}):
        file = part.removeprefix(READ_PART)
        if part not in now:
            changes.append(f"input file {file} is gone")
        elif part not in recorded_parts:
            changes.append(f"input file {file} is new")
        elif recorded_parts[part] != now[part]:
            changes.append(f"input file {file} changed (its bytes differ)")
    if recorded_parts.get("plan") != now["plan"]:
        told = [f"config: {c}" for c in config_changes(*configs)] if configs is not None else []
        # The options, inputs or version already said explain a plan whose config reads alike.
        changes.extend(told or ([] if changes else [
            "the merge plan changed (config, method parameters or input tensor layout)"]))
    if recorded_parts.get(CARD_PART) != now.get(CARD_PART) and not changes:
        changes.append("the model card changed (what it shows of the command line, such as --allow-crimes, of the "
                       "tokens or of the notes)")
    return changes


def recorded_options(options: PlanOptions) -> dict[str, Any]:
    """``options`` as a run records them (its ledger, OUT's manifest) and its fingerprint hashes them
    (:func:`~resumerge.merge.plan.merge_plan.fingerprint_parts`): every field, but a file given by its path
    (``--imatrix``, ``--imatrix-texts``: PATH_OPTIONS) by its base name alone, to show, beside the digest of its bytes
    (what the output's bytes depend on, fingerprinted), and the place of the importance matrix the run computes
    (``--imatrix-texts``), a file in the state dir, not at all: two runs of the same files from other folders or
    machines record the same, and no machine path is published with the output. Where this machine read the files
    the ledger says apart (:func:`local_files`); a resume elsewhere is given them again. The computed matrix a
    resume puts back in its own state dir (:func:`resumerge.api.importance.computed_imatrix`)."""
    found = asdict(options)
    if options.imatrix_texts is not None:
        found["imatrix"] = None
    for name in PATH_OPTIONS:
        found[name] = _base_name(found[name])
    return found


def local_files(options: PlanOptions) -> dict[str, str]:
    """Where this machine reads the files ``options`` give by path, by option (the matrix a run computes not: it is
    the state dir's)."""
    found = {name: getattr(options, name) for name in PATH_OPTIONS if getattr(options, name) is not None}
    if options.imatrix_texts is not None:
        found.pop("imatrix", None)
    return found


def _base_name(path: Any) -> Any:
    """The last part of a recorded path (a base name, None as is)."""
    return path if path is None else PurePath(str(path)).name


def _option_changes(recorded: Mapping[str, Any] | None, options: PlanOptions) -> list[str]:
    """``--option OLD → NEW`` for each output option that differs from the ``recorded`` PlanOptions."""
    if recorded is None:
        return []
    now = {k: v for k, v in recorded_options(options).items() if k not in ("allow_crimes", "stream_inputs")}
    # The recorded options are JSON: a tuple option (--gguf-tensor-type) comes back a list, which never equals it.
    then = {k: tuple(v) if isinstance(v, list) else _base_name(v) if k in PATH_OPTIONS else v
            for k, v in ((k, recorded.get(k, LATER_OPTIONS.get(k))) for k in now)}
    return [f"--{k.replace('_', '-')} {then[k]} → {v}" for k, v in now.items() if then[k] != v]

"""A finished check's section in the model card of a resumerge output: the verdict, each model's NLL and the
merge's KL from it, the layer named, the thresholds, the prompts and where the drift chart is.

The section sits between two HTML comments (invisible on the hub), so checking again replaces it and never adds a
second one. The card is changed only where resumerge wrote it and only through the run's own ledger
(:func:`run_state`: in the check's state dir, else the one a command given no ``--state-dir`` finds): its ledger
holds README.md committed and the bytes on disk still match; the new card is committed as every output file is
(:func:`~resumerge.merge.store.recommit.recommit_small`: ledger row, then manifest), so ``verify`` passes after it.
Where the check finds no ledger of the run (a state dir of its own, or a machine without the run's), the card is left as
it is and the line says so: a card changed through the manifest alone would disagree with a ledger kept elsewhere,
which ``verify`` then calls damaged and a ``resume`` rebuilds without the section (issue 70). A ``resume`` that
rebuilds the card (deleted or damaged) writes the last check's section back (:func:`restore_section`). A hub OUT's
card is left as committed: changing it is a commit to the repo, which the check does not make.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from resumerge.analyses.check.names import in_short, short_names
from resumerge.analyses.check.report import CheckReport
from resumerge.config.hubtarget import is_hub_target
from resumerge.config.locations import StateDir
from resumerge.errors import LedgerError
from resumerge.merge.store.recommit import committed_file, recommit_small

CARD_NAME = "README.md"
# The kind of run a tokenizer transplant's ledger records, and what its check against MODEL means.
TRANSPLANT = "tokensurgeon"
TRANSPLANT_LEAD = (
    "This model is MODEL's weights with DONOR's tokenizer; its check against MODEL (as `--base`) is over texts made "
    "of tokens both tokenizers hold, matched by the bytes each stands for (`Ġthe` and `▁the` are one), each model "
    "reading the same tokens by its own ids. Its KL from MODEL and top-1 "
    "agreement are over the shared tokens: near 0 and 100 % say the rows of those tokens predict as MODEL's do (a "
    "merge's \"no effect\" is what a transplant aims at; a shared token the transplant approximated rather than "
    "copied, one its mergekit matching does not find such as a byte-level `Ã©` for `é`, moves them); its NLL is "
    "over its whole vocabulary, DONOR's tokens that MODEL lacked included.")
BEGIN = "<!-- resumerge check: begin (replaced by each check) -->"
END = "<!-- resumerge check: end -->"


def update_card(model: str | os.PathLike[str], state: StateDir, report: CheckReport,
                default_state: StateDir | None = None) -> str | None:
    """Write ``report``'s section into ``model``'s card when it is a resumerge output, its run's ledger found by
    :func:`run_state`; the one line that says what became of the card (None: ``model`` is no resumerge output, so it
    has no card of resumerge's)."""
    where = os.fspath(model)
    if is_hub_target(where):
        return (f"the model card of {where} is left as committed: a check makes no commit to the repo (the "
                "report is in the state dir)")
    out = Path(where)
    run = run_state(out, state, default_state)
    if run is None:
        if _is_output(out, state):
            return (f"{out / CARD_NAME} is left as it is, without the check's section: the run's ledger is neither "
                    "in the check's state dir nor in the default one (check again with the merge's --state-dir to "
                    "add it)")
        return None
    try:
        found = committed_file(out, CARD_NAME, run)
    except LedgerError:
        return None
    if found is None or not found.ledger:
        return f"{out / CARD_NAME} was not written by resumerge: left as it is, without the check's section"
    if found.data is None:
        return (f"{out / CARD_NAME} no longer matches what resumerge wrote (edited or damaged): left as it is, "
                "without the check's section")
    missing = not_compared(out, report)
    if missing:  # a one-off comparison: the published card describes the merge beside its own base and parents
        return (f"{out / CARD_NAME} is left as it is: this check did not compare the merge with its own "
                f"{', '.join(missing)} (a check without --base/--parent, or with all of them, writes the section)")
    text = found.data.decode("utf-8", errors="replace")
    updated = with_section(text, render_section(report, transplant=run_kind(out, run) == TRANSPLANT)).encode("utf-8")
    if updated == found.data:
        return f"{out / CARD_NAME}: the check's section is up to date"
    if not recommit_small(out, found, updated, run):
        return f"{out / CARD_NAME} is not updated: a merge into {out} is running"
    return f"{out / CARD_NAME}: the check's section written (its checksum recorded: verify passes)"


def restore_section(model: str | os.PathLike[str], state: StateDir) -> str | None:
    """Write the section of ``model``'s last check back into its card, where a later ``resume`` rebuilt the card
    from the plan (the card was deleted or damaged) and so dropped it: the check's ``check`` event in the run's
    ledger names its report, which the section is rendered from. None where there is nothing to restore (no
    ledger, no check recorded, its report gone, or the card has the section already)."""
    import json

    from resumerge.analyses.check.report import CheckReport
    from resumerge.merge.store.ledger_read import reading

    where = os.fspath(model)
    if is_hub_target(where):
        return None
    ledger = state.run(where).ledger
    card = Path(where) / CARD_NAME
    if not ledger.is_file() or not card.is_file() or BEGIN in card.read_text(errors="replace"):
        return None
    try:
        with reading(ledger, "ledger") as conn:
            rows = conn.execute("SELECT data FROM events WHERE kind = 'check' ORDER BY id DESC").fetchall()
    except LedgerError:  # an unreadable record: the card stays as built
        return None
    for row in rows:  # the newest check that wrote the section: a one-off comparison never did
        try:
            found = json.loads(row["data"] or "{}").get("report")
            report = CheckReport.from_json(json.loads(Path(found).read_text())) if isinstance(found, str) else None
        except (OSError, ValueError, KeyError, TypeError):  # its report gone: an older one may still be there
            continue
        if report is not None and not not_compared(where, report):
            return update_card(where, state, report)
    return None


def not_compared(out: str | os.PathLike[str], report: CheckReport) -> list[str]:
    """The roles and names of the models ``out``'s record names as its base and parents that ``report`` did not
    compare it with (empty: the check is of the merge beside all of its own models, as its card describes it); a
    record that cannot be read names nothing that is missing, only the models the check was given count."""
    from resumerge.analyses.check.models import recorded_models, same_model
    from resumerge.errors import ResumergeError

    try:
        base, parents = recorded_models(Path(out))
    except ResumergeError:
        return []
    compared = {same_model(m.path) for m in report.models[1:]}
    wanted = ([("base", base)] if base is not None else []) + [("parent", p) for p in parents]
    return [f"{role} {Path(path).name or path}" for role, path in wanted if same_model(path) not in compared]


def run_kind(out: str | os.PathLike[str], state: StateDir) -> str | None:
    """The kind of run its ledger in ``state`` records for ``out`` (``merge``, ``tokensurgeon``, ...; None: none
    recorded, or a ledger that cannot be read)."""
    from resumerge.merge.store.ledger_read import reading

    try:
        with reading(state.run(out).ledger, "ledger") as conn:
            row = conn.execute("SELECT kind FROM run LIMIT 1").fetchone()
    except (LedgerError, LookupError, sqlite3.Error):
        return None
    return str(row["kind"]) if row is not None and row["kind"] else None


def run_state(out: str | os.PathLike[str], state: StateDir, default_state: StateDir | None = None) -> StateDir | None:
    """The state dir that holds the ledger of the run into ``out``: ``state`` (the check's), else
    ``default_state``, the one a command given no ``--state-dir`` finds (``$RESUMERGE_STATE_DIR``, the user's own, or
    ``./state``: the API resolves it, this package resolves none; None: ``state`` alone); None where neither does."""
    from resumerge.merge.store.ledger_read import LEDGER_NAME

    for candidate in (state,) if default_state is None else (state, default_state):
        if (candidate.run_dir(out) / LEDGER_NAME).is_file():
            return candidate
    return None


def _is_output(out: Path, state: StateDir) -> bool:
    from resumerge.merge.store.ledger_read import LEDGER_NAME
    from resumerge.merge.store.manifest import manifest_path

    return manifest_path(out).is_file() or (state.run_dir(out) / LEDGER_NAME).is_file()


def with_section(card: str, section: str) -> str:
    """``card`` with its check section (between :data:`BEGIN` and :data:`END`) replaced by ``section``, or
    ``section`` appended when it has none."""
    start = card.find(BEGIN)
    if start >= 0:
        stop = card.find(END, start)
        tail = card[stop + len(END):] if stop >= 0 else ""
        return card[:start] + section + tail.lstrip("\n")
    return card.rstrip("\n") + "\n\n" + section


def render_section(report: CheckReport, *, transplant: bool = False) -> str:
    """The card's check section (Markdown, ending in a newline): the merge and its own base and parents in the
    table (a model the check was also given is listed as "also compared with"), each by its short name
    (:mod:`.names`): a card is published, and a local absolute path says nothing on the hub. How the vocabularies
    met where they differ (KL and top-1 over the shared tokens). A ``transplant``'s (``resumerge tokensurgeon``)
    says what its check against MODEL means: a merge's "no effect" is what a transplant aims at."""
    def num(x: float | None, f: str = ".4f") -> str:
        return "-" if x is None else format(x, f)

    paths = [m.path for m in report.models]
    names = short_names(paths)
    verdict = report.verdict.replace("_", " ")
    lines = [BEGIN, "## Check", "",
             f"`resumerge check`: **{verdict}** (exit {report.exit_code}), over {report.sequences} sequences, "
             f"{report.tokens} predicted tokens.", ""]
    if transplant:
        lines += [TRANSPLANT_LEAD, ""]
    lines += ["| role | model | NLL | KL(this ‖ merge) | top-1 agreement |", "|---|---|---|---|---|"]
    for m, name in zip(report.models, names):
        if m.own:
            lines.append(f"| {m.role} | {_cell(name)} | {num(m.nll)} | {num(m.kl, '.4g')} | {num(m.top1, '.1%')} |")
    others = [f"{_cell(name)} (NLL {num(m.nll)}, KL {num(m.kl, '.4g')})" for m, name in zip(report.models, names)
              if not m.own]
    layer = "none" if report.broken_layer is None else f"decoder layer {report.broken_layer} (0-based)"
    lines += [""] + ([f"- Also compared with: {', '.join(others)}."] if others else [])
    lines.append(f"- Broken layer: {layer}.")
    if report.compared is not None:
        lines.append(f"- Compared: {_cell(report.compared)}.")
    if report.vocabulary is not None:
        lines.append(f"- Vocabularies: {_cell(report.vocabulary)}.")
    lines += [f"- {_cell(in_short(reason, paths, names))}" for reason in report.reasons]
    lines.append("- Thresholds: " + ", ".join(f"{k} {v:g}" for k, v in sorted(report.thresholds.items())) + ".")
    lines.append(f"- Prompts: {report.prompts}." if report.prompts else "- Prompts: not recorded.")
    if report.chart is not None:
        chart = Path(report.chart)
        lines.append(f"- Per-layer drift chart: `{chart.name}` in the check's folder of the state dir that ran it "
                     f"(`checks/{chart.parent.name}/`).")
    lines += [END, ""]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")

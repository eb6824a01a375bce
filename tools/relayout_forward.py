#!/usr/bin/env python3
"""Issue 98's fourth step: ``forward/``, one flat room of 37 files, put in rooms by what they hold, as a script the
integrator runs again once every branch has merged (others edit ``forward/`` in parallel).

What it does, in order (each step idempotent: run again on a moved tree it changes nothing but the references a
merged branch still writes the old way):

1. ``from resumerge.forward import CastReader, Weights, ...`` (the names ``forward/__init__.py`` re-exported) is
   written as an import of the module that holds them (``forward.reader``, ``forward.journal``), as are the dotted
   names ``resumerge.forward.CastReader``...: the package becomes a group, whose ``__init__`` imports nothing. So is
   a name a merged branch still takes from the module it left when that was split by job (:data:`LEFT`:
   ``rayactor.ModelNode`` is ``modelnode``'s, ``stream.build_modules`` is ``built``'s).
2. Moves, with ``git mv``, each module of ``forward/`` into its room (:data:`ROOMS`): ``engine/`` (a model streamed
   through its modules), ``text/`` (token sequences, vocabularies, batches), ``opening/`` (the one opener, the hub
   reads), ``job/`` (the pass: driver, loop, journal, proof, admission, placement), ``compared/`` (models run side by
   side, their heads, their steps' bytes), ``placing/`` (where the executor places a pass: sites, Ray), ``sums/``
   (the importance matrix's sums). A module some branch adds again at an old path is refused (both exist: merge them
   by hand); one it adds that no room names is reported (``LEFT FOR YOU``), not moved.
3. Rewrites every reference to a moved module in every text file of the checkout (git's tracked and untracked, not
   ignored; CHANGELOG.md, docs/performance.md and the relayout scripts with their tests left alone), with
   tools/relayout.py's rewriters: dotted names, ``from resumerge.a import b`` where ``b`` moved, paths, relative
   ``:mod:`` references.
4. Writes each room's ``__init__.py`` where it is missing (its job, its ``May import:`` line, its modules in
   ``__all__``; a hand-edited one is kept) and ``forward/__init__.py`` as a group's (its rooms listed, nothing
   imported) where it is not one yet; reports a room that imports a layer its line does not name; writes
   docs/architecture.md's tree again.
5. Sorts the imports it touched (``ruff check --fix --select I``) and refolds comment and docstring lines the longer
   names pushed past 120 characters.

Run after tools/relayout.py, tools/relayout_machine.py and tools/relayout_clients.py (an older script may write a
flat ``forward/x.py`` name, which this one then moves into its room).

Usage: ``python tools/relayout_forward.py [ROOT]`` (ROOT: the checkout, default the one this file is in);
``--check``: say what would move and exit 1 if anything would, changing nothing.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# tools/relayout_machine.py, whose tools/relayout.py (movers and rewriters) this script runs: beside it, on the path as
# `python tools/relayout_forward.py` runs (sys.path[0] is tools/).
import relayout_machine as M

R = M.R

GROUP = "forward"
# Each room: its modules (and packages) of the flat forward/, its job (the docstring's first paragraph) and what it may
# import. The rooms' order is their floors: a room imports only rooms above it in this list.
ROOMS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "engine": (
        ("stream", "built", "reader", "calls", "layerlists", "tail", "multimodal", "onmeta", "handed", "standins",
         "device", "requires", "native"),
        "The layer-streamed forward engine: a model's modules built without weights (:mod:`.built`: transformers' own "
        "for the model's architecture, or, for the common dense families, :mod:`.native`'s, which compute the same "
        "numbers to the bit without importing transformers), each decoder layer given its weights, read through the "
        "codecs in the compute dtype (:mod:`.reader`), only while it runs (:mod:`.stream`).\n\n"
        "A pass's \"layers\" are the forward's decoder-layer calls in its order (:mod:`.calls`: a forward that loops "
        "some layers calls them several times, each call a step of the pass), from one list of layers or several "
        "(:mod:`.layerlists`), with what a layer hands a later one (:mod:`.handed`), the stand-ins that record the "
        "calls (:mod:`.standins`) and what the base model does after its layers (:mod:`.tail`). Where the layers run, "
        "the CPU or one GPU with its budget (:mod:`.device`); the one \"is transformers here\" check "
        "(:mod:`.requires`). transformers is imported only inside the functions that need it.",
        "errors, inputs, machine, merge.plan (input references only)",
    ),
    "text": (
        ("texts", "plaintok", "tokens", "vocabs", "batches"),
        "The token sequences a pass runs and how they go through the layers: the built-in texts, a prompts file and "
        "the context rule, the one tokenizer loader (:mod:`.texts`; the tokenizer read without transformers where it "
        "can be, :mod:`.plaintok`), a check's sequences remembered (:mod:`.tokens`), how models whose vocabularies "
        "differ meet over the tokens they share (:mod:`.vocabs`), and the batches, padded on the right to the longest "
        "of each (:mod:`.batches`).",
        "errors, config, inputs, machine, merge.vocab, forward.engine (the \"is transformers here\" check)",
    ),
    "opening": (
        ("opened", "hubreads"),
        "The models a pass opens: the one opener (:func:`~.opened.open_for_pass`: a local folder, an ``hf://`` repo, "
        "a GGUF file or split set, a GGUF file of a hub repo; headers only), and a hub model's reads held to the "
        "hub's checksums, journaled in a ledger the client hands in (:class:`~.hubreads.PassReads`).",
        "errors, config, inputs",
    ),
    "job": (
        ("driver", "layerpass", "journal", "folder", "threads", "admission", "proof", "placement"),
        "The one journaled layer pass every analysis runs on, and its driver: a pass is a job "
        "(:class:`~.driver.PassJob`) that :func:`~.driver.drive` runs always in the same order: the folder's lock "
        "(:mod:`.folder`), the answer cache, the thread count kept in the folder (:mod:`.threads`), the content "
        "proof of the local models (:mod:`.proof`), the fit, each step's admission by the RAM governor "
        "(:mod:`.admission`), the loop, the end.\n\n"
        "The loop (:class:`~.layerpass.LayerPass`) restarts from the pass's journal (:mod:`.journal`: one file per "
        "decoder layer, saved durably), hands each layer to the client's :class:`~.layerpass.Step`, saves what "
        "leaves it and reaches the pass's kill point. Where the models run is a :class:`~.placement.Placement` "
        "(:class:`~.placement.Streams`: every model in this process, one layer at a time); the executors' own "
        "placements are :mod:`resumerge.forward.placing`'s.",
        "errors, config, inputs, machine, forward.engine, forward.text, forward.opening",
    ),
    "compared": (
        ("passes", "heads", "needs"),
        "Models run side by side over the same token sequences, as a check compares them, with their heads and the "
        "bytes their steps hold.\n\n"
        "The pass (:mod:`.passes`): the merge first, one decoder layer at a time, in float32; the heads and the "
        "figures from their log-probabilities (:mod:`.heads`, which eval and the search stream too); the bytes each "
        "step holds (:mod:`.needs`), from which a budget is found.",
        "errors, config, inputs, machine, merge.engine (the unwritten merge), forward.engine, forward.text, "
        "forward.opening, forward.job",
    ),
    "placing": (
        ("sites", "onray", "rayactor", "modelnode"),
        "Where the run's executor places a forward pass: one site per executor, found by its name (:mod:`.sites`), "
        "and a Ray cluster's share of it: where each model's actor runs and how a model travels to it "
        "(:mod:`.onray`), the driver's side of the actors (:mod:`.rayactor`) and one model as its node runs it "
        "(:mod:`.modelnode`).",
        "errors, config, inputs, machine, forward.engine, forward.text, forward.opening, forward.job, "
        "forward.compared",
    ),
    "sums": (
        ("imatrix", "routed"),
        "What the importance pass sums over a model's linears, as llama-imatrix writes it: each weight's entry under "
        "its GGUF name (:mod:`.imatrix`), and a mixture of experts' routed projections, per expert (:mod:`.routed`).",
        "errors, inputs, machine, outputs",
    ),
}
PACKAGES = frozenset({"native"})
# The names forward/__init__.py re-exported, by the module that holds them.
REEXPORTS: dict[str, str] = {
    **dict.fromkeys(("CastReader", "Location", "Weights", "base_formats", "pass_bytes", "step_sizes"), "reader"),
    "durable_save": "journal",
}
# Names that left a module (flat name; "" the package) when it was split, by the module that holds them now.
LEFT: dict[str, dict[str, str]] = {
    "": REEXPORTS,
    "rayactor": {"ModelNode": "modelnode"},
    "stream": {"build_modules": "built", "config_doc": "built", "native_reads_all": "built", "quiet_loading": "built"},
}
GROUP_DOC = (
    "The forward engine and the one journaled layer pass every analysis runs on (``check``, ``measure``, ``eval``, "
    "the importance matrix, the MoE hidden-state gates, the search), in rooms by what they hold.\n\n"
    "A group: each package here is a layer of its own, with its own ``May import:`` line (tests/test_layout.py holds "
    "them to it), each room importing only the rooms listed above it; this file imports nothing."
)
SKIP_FILES = frozenset({*M.SKIP_FILES, "docs/performance.md", "tools/relayout_clients.py",
                        "tests/test_relayout_clients.py", "tools/relayout_forward.py",
                        "tests/test_relayout_forward.py"})
ROOM_INIT = '''\
"""{doc}

May import: {may}.
"""

__all__ = [
{names}
]
'''


def moves() -> list[R.Move]:
    """Every module of the flat ``forward/`` into its room (those moved already are skipped by the mover)."""
    return [R.Move(f"{GROUP}/{name}" + ("" if name in PACKAGES else ".py"),
                   f"{GROUP}/{room}/{name}" + ("" if name in PACKAGES else ".py"))
            for room, (held, _, _) in ROOMS.items() for name in held]


def _fold(text: str) -> str:
    return "\n\n".join(R._fold_paragraph(p, R.LINE - 4) for p in text.split("\n\n"))


def unpack_reexports(root: Path, say: list[str]) -> None:
    """``from resumerge.forward import <re-exported names>`` and ``resumerge.forward.<name>``, written with the
    module that holds the name, and so a name that left its module when the module was split (:data:`LEFT`), each
    still at its old flat path: the references' rewrite moves it on."""
    changed = 0
    for path in R.text_files(root):
        if path.relative_to(root).as_posix() in SKIP_FILES or path == root / "resumerge" / GROUP / "__init__.py":
            continue
        text = path.read_text(encoding="utf-8")
        new = text
        for source, names in LEFT.items():
            new = _unpacked(new, source, names, path.suffix == ".py")
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed += 1
    if changed:
        say.append(f"imports of names from the modules that hold them now in {changed} files")


def _unpacked(text: str, source: str, held: dict[str, str], code: bool) -> str:
    """``text`` with ``from <source> import ...`` split where it names one of ``held`` (name -> the module that
    holds it), and the dotted ``<source>.<name>`` written with its module."""
    base = f"resumerge.{GROUP}" + (f".{source}" if source else "")

    def one(match: re.Match[str]) -> str:
        indent, names = match.group(1), [n.strip() for n in match.group(2).split(",") if n.strip()]
        by_module: dict[str, list[str]] = {}
        kept = []
        for name in names:
            module = held.get(name.split(" as ")[0].strip())
            (by_module.setdefault(module, []) if module else kept).append(name)
        if not by_module:
            return match.group(0)
        lines = [f"{indent}from {base} import {', '.join(kept)}"] if kept else []
        lines += [f"{indent}from resumerge.{GROUP}.{m} import {', '.join(n)}" for m, n in sorted(by_module.items())]
        return "\n".join(lines)

    if code:
        text = re.sub(rf"^([ \t]*)from {re.escape(base)} import ([\w ,]+)$", one, text, flags=re.MULTILINE)
    dotted = re.compile(rf"(?<![\w.]){re.escape(base)}\.({'|'.join(held)})(?!\w)")
    return dotted.sub(lambda m: f"resumerge.{GROUP}.{held[m.group(1)]}.{m.group(1)}", text)


def write_rooms(root: Path, say: list[str]) -> None:
    """Each room's ``__init__.py`` where it is missing (a hand-edited one is kept)."""
    for room, (_, doc, may) in ROOMS.items():
        folder = root / "resumerge" / GROUP / room
        init = folder / "__init__.py"
        if not folder.is_dir() or init.exists():
            continue
        held = sorted({p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}
                      | {p.parent.name for p in folder.glob("*/__init__.py")})
        body = ROOM_INIT.format(doc=_fold(doc), may=may, names=M._listed(held))
        may_line = body[body.index("May import:"):body.index(".\n", body.index("May import:")) + 1]
        body = body.replace(may_line, R._fold_paragraph(may_line, R.LINE))
        init.write_text(body, encoding="utf-8")
        say.append(f"write resumerge/{GROUP}/{room}/__init__.py")


def write_group(root: Path, say: list[str]) -> None:
    """``forward/__init__.py`` as a group's (its rooms, each with its first sentence; nothing imported), where it is
    not one yet (it still has a ``May import:`` line or imports something)."""
    init = root / "resumerge" / GROUP / "__init__.py"
    if not init.exists():
        return
    text = init.read_text(encoding="utf-8")
    if R._may_import_span(text) is None and not re.search(r"^(from|import) ", text, re.MULTILINE):
        return
    rooms = [room for room in ROOMS if (init.parent / room / "__init__.py").exists()]
    lines = []
    for room in rooms:
        doc = (init.parent / room / "__init__.py").read_text(encoding="utf-8").split('"""')[1]
        first = re.split(r"(?<=[.:])\s", doc.split("\n\n")[0].replace("\n", " "), maxsplit=1)[0].rstrip(".:")
        lines.append(R._fold_hanging(f"- :mod:`.{room}`: {first}.", R.LINE - 4))
    names = ", ".join(f'"{n}"' for n in sorted(rooms))
    init.write_text(f'"""{_fold(GROUP_DOC)}\n\n' + "\n".join(lines) + f'\n"""\n\n__all__ = [{names}]\n',
                    encoding="utf-8")
    say.append(f"write resumerge/{GROUP}/__init__.py (a group)")


def unplaced(root: Path, say: list[str]) -> None:
    """A module a merged branch added to the flat ``forward/`` that no room names: for a person to place."""
    named = {n for held, _, _ in ROOMS.values() for n in held}
    folder = root / "resumerge" / GROUP
    for path in sorted(folder.glob("*.py")):
        if path.name != "__init__.py" and path.stem not in named:
            say.append(f"LEFT FOR YOU: resumerge/{GROUP}/{path.name} is in no room: add it to ROOMS and run again")


def undeclared(root: Path, say: list[str]) -> None:
    """A room that imports a layer its ``May import:`` line does not name (a merged branch's new import)."""
    groups = (*M.GROUPS, GROUP)
    for room in ROOMS:
        init = root / "resumerge" / GROUP / room / "__init__.py"
        if not init.exists():
            continue
        text = init.read_text(encoding="utf-8")
        span = R._may_import_span(text)
        listed = {M._name(i) for i in M._items(text[span[0] + len("May import: "):span[1]])} if span else set()
        for used in sorted(R.imported_layers(init.parent, groups=groups) - listed - {f"{GROUP}.{room}", "errors"}):
            if any(used.startswith(f"{name}.") for name in listed):
                continue
            say.append(f"LEFT FOR YOU: {GROUP}.{room} imports {used}, which its 'May import:' line does not name")


def architecture(root: Path, say: list[str]) -> None:
    """docs/architecture.md's tree (tools/relayout.py's), forward/'s rooms listed as a group's layers."""
    path = root / "docs" / "architecture.md"
    if not path.exists():
        return
    R.GROUPS.setdefault(GROUP, "")
    section = R.tree_section(root).replace("A group (`analyses/`, `merge/`, `runs/`)",
                                           "A group (`analyses/`, `forward/`, `merge/`, `runs/`)")
    text = path.read_text(encoding="utf-8")
    start, end = text.find(R.TREE_START), text.find(R.TREE_END)
    if start < 0 or end < 0:
        say.append("LEFT FOR YOU: docs/architecture.md has no tree section to write")
        return
    new = text[:start] + section + text[end + len(R.TREE_END) + 1:]
    if new != text:
        say.append("docs/architecture.md: the tree")
        path.write_text(new, encoding="utf-8")


def relayout(root: Path, dry: bool = False) -> list[str]:
    return R.run_moves(root, moves(), dry, skip=SKIP_FILES, before=(unpack_reexports,),
                       after=(write_rooms, write_group, unplaced, undeclared, architecture))


if __name__ == "__main__":
    sys.exit(R.main(run=relayout, doc=__doc__, name="relayout_forward"))

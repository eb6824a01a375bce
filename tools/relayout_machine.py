#!/usr/bin/env python3
"""Issue 98's re-layout of ``resumerge/``: the infrastructure every floor uses out of ``merge/`` into one bottom
package, ``machine/``, as a script the integrator runs again once every branch has merged.

What it does, in order (each step idempotent: run again on a moved tree it changes nothing but the references a
merged branch still writes the old way):

1. Moves, with ``git mv``, what resumerge needs of the machine it runs on and that is no part of a merge into
   ``resumerge/machine/``: durable writes and the checksums they record, the kill points, the run's locks (the run
   lock, the planning mark), a job's thread count, disks and filesystems (``merge/store/``), the Ray connection
   (``merge/engine/cluster/connect.py``, as ``rayconnect.py``), the memory governor (``memory/``, whole) and
   ``torch_import.py``; then (issue 98's second step) what keeps workers on a Ray cluster's nodes and hosts the
   forward passes there (``merge/engine/cluster/``'s actor, launch, keeper, kept, hostcalls and hosting, into
   ``machine/cluster/``). ``resumerge/`` goes from 16 entries to 15; ``merge/`` keeps the ledger, the manifest, the
   sink and the merge (its cluster driver, warm start and shard stream among it).
2. Rewrites every reference to a moved module in every text file of the checkout (git's tracked and untracked, not
   ignored; CHANGELOG.md and the two relayout scripts with their tests left alone), with tools/relayout.py's own
   rewriters: dotted names, ``from resumerge.a import b`` where ``b`` moved, paths, relative ``:mod:`` references;
   drops the moved modules' names from the ``__all__`` of the packages they left.
3. Keeps the layers' declarations true: writes ``machine/__init__.py`` and ``machine/cluster/__init__.py`` where
   they are missing (their ``May import:`` lines: errors, config; and machine), the latter named in the former's
   ``__all__``; in every ``May import:`` line, ``memory`` and ``torch_import`` become ``machine``, which
   is added where the layer's code imports it (``torch_import`` was a leaf every module could import; the bottom
   package is declared); ``merge.store`` / ``merge.engine`` are dropped where the layer no longer imports them. Prose
   in parentheses naming a moved module is reported (``LEFT FOR YOU``), not rewritten. tests/test_layout.py's leaves
   are ``errors`` alone; docs/architecture.md's tree is written again.
4. Sorts the imports it touched (``ruff check --fix --select I``) and refolds comment and docstring lines the longer
   names pushed past 120 characters.

Usage: ``python tools/relayout_machine.py [ROOT]`` (ROOT: the checkout, default the one this file is in);
``--check``: say what would move and exit 1 if anything would, changing nothing.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# tools/relayout.py (issue 83's), whose movers and rewriters this script runs with its own moves: beside it, on the
# path as `python tools/relayout_machine.py` runs (sys.path[0] is tools/).
import relayout as R

Move = R.Move

BOTTOM = "machine"
# Single modules moved (old path under resumerge/ -> new path under resumerge/).
MODULE_MOVES: tuple[tuple[str, str], ...] = (
    ("torch_import.py", "machine/torch_import.py"),
    ("merge/store/durable.py", "machine/durable.py"),
    ("merge/store/checksums.py", "machine/checksums.py"),
    ("merge/store/killpoints.py", "machine/killpoints.py"),
    ("merge/store/runlock.py", "machine/runlock.py"),
    ("merge/store/planning.py", "machine/planning.py"),
    ("merge/store/threadcount.py", "machine/threadcount.py"),
    ("merge/store/diskprobe.py", "machine/diskprobe.py"),
    ("merge/store/filesystems.py", "machine/filesystems.py"),
    ("merge/engine/cluster/connect.py", "machine/rayconnect.py"),
    # Issue 98's second step: a node's worker actor, its start and end, the kept workers and the passes they host,
    # which the merge's driver and the forward passes both use (the actor is handed its stream's class by name).
    ("merge/engine/cluster/actor.py", "machine/cluster/actor.py"),
    ("merge/engine/cluster/launch.py", "machine/cluster/launch.py"),
    ("merge/engine/cluster/keeper.py", "machine/cluster/keeper.py"),
    ("merge/engine/cluster/kept.py", "machine/cluster/kept.py"),
    ("merge/engine/cluster/hostcalls.py", "machine/cluster/hostcalls.py"),
    ("merge/engine/cluster/hosting.py", "machine/cluster/hosting.py"),
)
# Whole packages moved (old path under resumerge/ -> new path under resumerge/).
PACKAGE_MOVES: tuple[tuple[str, str], ...] = (("memory", "machine/memory"),)
# The layer names a 'May import:' line wrote for what moved into the bottom package.
BECOME_BOTTOM = ("memory", "torch_import")
# Layers a line names that lost modules to the bottom package: dropped from a line whose layer no longer imports them.
EMPTIED = ("merge.store", "merge.engine")
SKIP_FILES = {"CHANGELOG.md", "tools/relayout.py", "tests/test_relayout.py", "tools/relayout_machine.py",
              "tests/test_relayout_machine.py"}
GROUPS = ("analyses", "merge", "runs")

BOTTOM_INIT = '''\
"""The machine every floor stands on: what resumerge needs of the computers it runs on, and no part of a merge.

Durable writes (:mod:`.durable`: temp, fsync, rename, fsync of the folder) and the checksums they record
(:mod:`.checksums`), the named points where a test kills the process (:mod:`.killpoints`), the locks a run or a
job holds (:mod:`.runlock`, :mod:`.planning`), a job's thread count kept in its folder (:mod:`.threadcount`), the
disks and filesystems a path lives on (:mod:`.diskprobe`, :mod:`.filesystems`), torch imported on its first use
(:mod:`.torch_import`), the memory governor (:mod:`.memory`) and the Ray cluster, found and joined
(:mod:`.rayconnect`). Every other layer may import it; it imports nothing above ``config``.

May import: errors, config.
"""

__all__ = [
{names}
]
'''


CLUSTER_INIT = '''\
"""The workers resumerge keeps on a Ray cluster's nodes, and what they host: a node's worker actor
(:mod:`.actor`, made with the class of the stream it computes with, which whoever starts it names: the merge's
shard stream), how the workers start on their nodes and end (:mod:`.launch`), kept for the next run and leased
(:mod:`.kept`, watched in the worker by :mod:`.keeper`), and a forward pass's objects hosted in them or in a fresh
actor of their own (:mod:`.hosting`; the worker's side, :mod:`.hostcalls`). The merge's driver
(:mod:`resumerge.merge.engine.cluster`) and the forward passes (:mod:`resumerge.forward.onray`) both use it; it
imports nothing of either.

May import: errors, config, machine.
"""

__all__ = [
{names}
]
'''
# The bottom package's own packages (folder under resumerge/, the __init__ written where it is missing), each named
# in the bottom package's __all__.
SUBPACKAGES: tuple[tuple[str, str], ...] = (("machine/cluster", CLUSTER_INIT),)


def moves() -> list[Move]:
    return [*(Move(o, n) for o, n in MODULE_MOVES), *(Move(o, n) for o, n in PACKAGE_MOVES)]


def write_bottom_init(root: Path, say: list[str]) -> None:
    """The bottom package's ``__init__.py``, where it is missing (a hand-edited one is kept)."""
    folder = root / "resumerge" / BOTTOM
    init = folder / "__init__.py"
    if not folder.is_dir() or init.exists():
        return
    held = sorted({p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}
                  | {p.parent.name for p in folder.glob("*/__init__.py")})
    init.write_text(BOTTOM_INIT.format(names=_listed(held)), encoding="utf-8")
    say.append(f"write resumerge/{BOTTOM}/__init__.py")


def _listed(names: list[str]) -> str:
    return "\n".join(f'    "{n}",' for n in names)


def write_subpackages(root: Path, say: list[str]) -> None:
    """Each of the bottom package's own packages gets its ``__init__.py`` where it is missing (a hand-edited one is
    kept) and is named in the bottom package's ``__all__``."""
    bottom = root / "resumerge" / BOTTOM / "__init__.py"
    for folder, template in SUBPACKAGES:
        where = root / "resumerge" / folder
        if not where.is_dir():
            continue
        init = where / "__init__.py"
        if not init.exists():
            held = sorted(p.stem for p in where.glob("*.py") if p.name != "__init__.py")
            init.write_text(template.format(names=_listed(held)), encoding="utf-8")
            say.append(f"write resumerge/{folder}/__init__.py")
        if not bottom.exists():
            continue
        text = bottom.read_text(encoding="utf-8")
        found = re.search(r"__all__ = \[([^\]]*)\]", text)
        names = re.findall(r'"(\w+)"', found.group(1)) if found else []
        if found and where.name not in names:
            bottom.write_text(text[:found.start()] + f"__all__ = [\n{_listed(sorted([*names, where.name]))}\n]"
                              + text[found.end():], encoding="utf-8")
            say.append(f"resumerge/{BOTTOM}/__init__.py: {where.name} into __all__")


def drop_from_all(root: Path, say: list[str], done: list[Move] | None = None) -> None:
    """The packages a module left (one of ``done``, else of this script's moves) no longer list it in ``__all__``."""
    pkg = root / "resumerge"
    for move in moves() if done is None else done:
        old = pkg / move.old
        init = old.parent / "__init__.py"
        if old.exists() or not init.exists():
            continue
        name = Path(move.old).stem
        text = init.read_text(encoding="utf-8")
        new = re.sub(rf'(\n\s*"{re.escape(name)}",(?=\s*\n))|("{re.escape(name)}", ?)|(, ?"{re.escape(name)}")',
                     "", text, count=1)
        if new != text:
            say.append(f"{init.relative_to(root)}: {name} out of __all__")
            init.write_text(new, encoding="utf-8")


def _items(body: str) -> list[str]:
    """A 'May import:' body split at its commas outside parentheses, each item stripped (the final full stop off)."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(body):
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    items.append(body[start:])
    out = [" ".join(item.split()) for item in items]
    if out:
        out[-1] = out[-1].rstrip().removesuffix(".").rstrip()
    return [item for item in out if item]


def _name(item: str) -> str:
    return item.split("(")[0].strip()


def declared(text: str, layer: str, uses: set[str]) -> tuple[str, list[str]]:
    """``text`` (an ``__init__``'s) with its 'May import:' paragraph rewritten for the bottom package, and what is
    left for a person (prose in parentheses naming a moved module)."""
    span = R._may_import_span(text)
    if span is None:
        return text, []
    para = text[span[0]:span[1]]
    head, body = para[:len("May import: ")], para[len("May import: "):]
    kept: list[str] = []
    seen: set[str] = set()
    for item in _items(body):
        name = _name(item)
        if name in BECOME_BOTTOM:
            item, name = BOTTOM + item[len(name):], BOTTOM
        if name == "nothing" and BOTTOM in uses:
            item, name = BOTTOM + item[len(name):], BOTTOM
        if name in EMPTIED and name not in uses and name != layer:
            continue
        if name in seen:
            continue
        seen.add(name)
        kept.append(item)
    if BOTTOM in uses and BOTTOM not in seen and not (layer == BOTTOM or layer.startswith(BOTTOM + ".")):
        at = max((i + 1 for i, item in enumerate(kept) if _name(item) in ("errors", "config")), default=0)
        kept.insert(at, BOTTOM)
    new_body = ", ".join(kept) + "."
    moved_names = {Path(m.old).stem for m in moves()} - {"connect"}
    left = [f"{layer}: 'May import:' prose names a module now in {BOTTOM}/: {item}" for item in kept
            if "(" in item and moved_names & set(re.findall(r"\w+", item.split("(", 1)[1]))]
    if " ".join(new_body.split()) == " ".join(body.split()):
        return text, left
    return text[:span[0]] + R._fold_paragraph(head + new_body, R.LINE - 4) + text[span[1]:], left


def rewrite_declarations(root: Path, say: list[str]) -> None:
    pkg = root / "resumerge"
    for init in sorted(pkg.rglob("*/__init__.py")):
        layer = ".".join(init.parent.relative_to(pkg).parts)
        if layer in GROUPS:
            continue
        text = init.read_text(encoding="utf-8")
        new, left = declared(text, layer, R.imported_layers(init.parent, groups=GROUPS))
        say.extend(f"LEFT FOR YOU: {each}" for each in left)
        if new != text:
            say.append(f"declare {layer}'s layers ({init.relative_to(root)})")
            init.write_text(new, encoding="utf-8")


LAYOUT_EDITS: tuple[tuple[str, str], ...] = (
    (r'LEAVES = \("errors", "torch_import"\)', 'LEAVES = ("errors",)'),
    (r"# Top-level modules every module may import: they import nothing of resumerge\.",
     "# The top-level module every module may import: it imports nothing of resumerge."),
    (r"a package is allowed itself and the two leaves any module may import, ``errors`` and\n``torch_import``\.",
     "a package is allowed itself and the leaf any module may import, ``errors`` (the bottom\npackage, "
     "``machine``, is declared like any other)."),
    (r"config, forward,\n# inputs, memory, outputs\), the two leaves \(errors, torch_import\)",
     "config, forward,\n# inputs, machine, outputs), the leaf (errors)"),
    (r"Issue 83 holds it to 16\.", "Issue 98 brought it to 15 (memory/ and torch_import into machine/)."),
)


def layout_test(root: Path, say: list[str]) -> None:
    path = root / "tests" / "test_layout.py"
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8")
    new = text
    for old, replacement in LAYOUT_EDITS:
        new = re.sub(old, lambda _, r=replacement: r, new, count=1)
    if new != text:
        say.append("tests/test_layout.py: errors the one leaf, machine declared")
        path.write_text(new, encoding="utf-8")
        R.fold_long_lines(path)


def relayout(root: Path, dry: bool = False) -> list[str]:
    return R.run_moves(root, moves(), dry, skip=frozenset(SKIP_FILES), after=(
        drop_from_all, write_bottom_init, write_subpackages, rewrite_declarations, layout_test, R.architecture))


if __name__ == "__main__":
    sys.exit(R.main(run=relayout, doc=__doc__, name="relayout_machine"))

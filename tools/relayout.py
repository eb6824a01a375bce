#!/usr/bin/env python3
"""Issue 83's re-layout of ``resumerge/``, as a script the integrator runs once every branch has merged.

What it does, in order (each step idempotent: run again on a moved tree it changes nothing):

1. Moves, with ``git mv`` (whatever the folders hold when it runs, not a fixed list of files):
   - the forward pass's library out of ``analyses/check/`` (and ``analyses/``) into ``forward/`` (the vocabularies,
     heads, token caches, step bytes, the compared pass, the models a pass opens, the Ray actor and its hosts) and
     the importance matrix's GGUF entries into ``forward/``; check's canvas and font into ``outputs/``: so no
     analysis imports another;
   - the kinds of run (``extract``, ``moe``, ``recipes``, ``transplant``, ``evolve``) under ``runs/``, the merge's
     own layers (``plan``, ``engine``, ``methods``, ``vocab``, ``store``) under ``merge/``, ``estimate`` under
     ``analyses/``: ``resumerge/`` goes from 25 entries to 16, and ``resumerge.estimate`` / ``resumerge.evolve`` no
     longer shadow the API's ``estimate`` / ``evolve``.
2. Rewrites every reference to a moved module in every text file of the checkout (git's tracked and untracked,
   not ignored; CHANGELOG.md, history, left alone): dotted names (imports, ``-m resumerge.x`` and monkeypatch
   targets, docstrings' ``:mod:`` references), ``from resumerge.a import b`` where ``b`` moved, paths
   (``resumerge/a/b.py``, and ``a/b.py`` as the docs write paths under ``resumerge/``), and a moved module's
   relative references (``:mod:`.x```) whose sibling stayed behind.
3. Keeps the layers' declarations true: each ``May import:`` line names the new layers (``merge.plan``,
   ``runs.moe``...), the analyses' lines no longer name each other, forward's names what its new modules import;
   writes the groups' ``__init__.py`` (``analyses``, ``merge``, ``runs``: packages that hold layers), sets
   test_layout's cap to 16, and writes the tree into docs/architecture.md.
4. Sorts the imports it touched (``ruff check --fix --select I``) and refolds the comment and docstring lines the
   longer names pushed past 120 characters.

``lm_eval.py`` stays at the top: ``python -m resumerge.lm_eval`` is issue 86's promise, so ``lm_eval`` is the one
module left that shadows an API name (``resumerge.api.lm_eval``).

Usage: ``python tools/relayout.py [ROOT]`` (ROOT: the checkout, default the one this file is in); ``--check``: say
what would move and exit 1 if anything would, changing nothing.
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

# Single modules moved, before the packages (old path under resumerge/ -> new path under resumerge/).
MODULE_MOVES: tuple[tuple[str, str], ...] = (
    ("analyses/check/vocabs.py", "forward/vocabs.py"),
    ("analyses/check/heads.py", "forward/heads.py"),
    ("analyses/check/tokens.py", "forward/tokens.py"),
    ("analyses/check/needs.py", "forward/needs.py"),
    ("analyses/check/passes.py", "forward/passes.py"),
    ("analyses/check/models.py", "forward/models.py"),
    ("analyses/check/onray.py", "forward/rayactor.py"),
    ("analyses/onray.py", "forward/onray.py"),
    ("analyses/importance/entries.py", "forward/imatrix.py"),
    ("analyses/check/canvas.py", "outputs/canvas.py"),
    ("analyses/check/glyphs.py", "outputs/glyphs.py"),
)
# Whole packages moved into a group (old top-level package -> group).
PACKAGE_MOVES: tuple[tuple[str, str], ...] = (
    ("extract", "runs"), ("moe", "runs"), ("recipes", "runs"), ("transplant", "runs"), ("evolve", "runs"),
    ("estimate", "analyses"),
    ("plan", "merge"), ("engine", "merge"), ("methods", "merge"), ("vocab", "merge"), ("store", "merge"),
)
GROUPS: dict[str, str] = {
    "analyses": "The analyses: what resumerge learns from models by running them (check, measure, eval, the "
                "importance matrix) or from a run before it runs (estimate), beside the kinds of run that write them.",
    "runs": "The kinds of run besides a merge: LoRA extraction, MoE upcycling, recipes of several stages, the "
            "tokenizer transplant and the evolutionary search.",
    "merge": "The merge itself, layer by layer: its methods, its vocabulary, its plan, the engine that runs it and "
             "the store that makes each step durable.",
}
# Names a layer's 'May import:' line gains: what its moved-in modules import (forward's Ray actor runs on the
# engine's cluster, its vocabularies meet through merge.vocab, the imatrix entries are written as outputs' GGUF).
GAINS: dict[str, tuple[str, ...]] = {
    "forward": ("merge.engine", "merge.vocab", "outputs"),
    "analyses.check": ("outputs",),
    "runs.evolve": ("outputs",),
}
# What a 'May import:' line naming the whole group ``analyses`` means for a layer now inside a group that may not
# import the analyses as a whole (the search scores with eval's tasks, nothing else of the analyses).
NARROWED: dict[str, dict[str, tuple[str, ...]]] = {"runs.evolve": {"analyses": ("analyses.evaluation",)}}
SKIP_FILES = {"CHANGELOG.md", "tools/relayout.py", "tests/test_relayout.py"}
LINE = 120
TREE_START, TREE_END = "<!-- the tree (tools/relayout.py writes it) -->", "<!-- end of the tree -->"
MAX_ENTRIES = 16


@dataclass(frozen=True)
class Move:
    old: str  # path under resumerge/, a module "a/b.py" or a package "a"
    new: str

    def dotted(self) -> tuple[str, str]:
        return _dotted(self.old), _dotted(self.new)


def _dotted(path: str) -> str:
    return "resumerge." + path.removesuffix(".py").replace("/", ".")


def _moves() -> list[Move]:
    return [*(Move(o, n) for o, n in MODULE_MOVES), *(Move(p, f"{g}/{p}") for p, g in PACKAGE_MOVES)]


def _run(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=root, text=True, capture_output=True, check=check)


def _in_git(root: Path) -> bool:
    return _run(root, "git", "rev-parse", "--is-inside-work-tree", check=False).returncode == 0


def _drop_caches(folder: Path) -> None:
    for cache in sorted(folder.rglob("__pycache__"), reverse=True):
        shutil.rmtree(cache, ignore_errors=True)


def move_files(root: Path, moves: list[Move], say: list[str], dry: bool = False) -> list[Move]:
    """Move what has not moved yet; the moves done. A destination already there with its source gone is done;
    both there is refused (someone else's file would be overwritten)."""
    pkg, git, done = root / "resumerge", _in_git(root), []
    for move in moves:
        old, new = pkg / move.old, pkg / move.new
        if not old.exists() or (old.is_dir() and not any(p.name != "__pycache__" for p in old.iterdir())):
            if old.is_dir():
                shutil.rmtree(old) if not dry else None  # only caches left: the folder would count as an entry
            continue
        if new.exists():
            raise SystemExit(f"relayout: both resumerge/{move.old} and resumerge/{move.new} exist: merge them by hand")
        say.append(f"move resumerge/{move.old} -> resumerge/{move.new}")
        done.append(move)
        if dry:
            continue
        new.parent.mkdir(parents=True, exist_ok=True)
        if old.is_dir():
            _drop_caches(old)
        if git and _run(root, "git", "ls-files", "--error-unmatch", str(old), check=False).returncode == 0:
            _run(root, "git", "mv", str(old), str(new))
        if old.exists():  # untracked files git mv left (or no git): moved as they are
            if old.is_dir():
                new.mkdir(parents=True, exist_ok=True)
                for each in sorted(old.iterdir()):
                    shutil.move(str(each), str(new / each.name))
                old.rmdir()
            else:
                shutil.move(str(old), str(new))
    return done


def text_files(root: Path) -> list[Path]:
    """Every text file of the checkout: git's tracked and untracked ones it does not ignore (without git: all)."""
    if _in_git(root):
        listed = _run(root, "git", "ls-files", "--cached", "--others", "--exclude-standard").stdout.splitlines()
        paths = [root / p for p in listed]
    else:
        paths = [p for p in root.rglob("*") if ".git" not in p.parts]
    out = []
    for path in sorted(set(paths)):
        rel = path.relative_to(root).as_posix()
        if rel in SKIP_FILES or not path.is_file() or "__pycache__" in path.parts:
            continue
        try:
            path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(path)
    return out


def _renames(moves: list[Move]) -> list[tuple[str, str]]:
    """(old dotted, new dotted), longest first, so a module moved out of a moved package wins."""
    return sorted((m.dotted() for m in moves), key=lambda pair: -len(pair[0]))


def rename_dotted(text: str, renames: list[tuple[str, str]]) -> str:
    for old, new in renames:
        text = re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w])", new, text)
    return text


def rename_from_imports(text: str, renames: list[tuple[str, str]]) -> str:
    """``from resumerge.a import b`` where ``resumerge.a.b`` moved: ``from <new parent> import <new name>``."""
    table = dict(renames)

    def one(match: re.Match[str]) -> str:
        indent, base, names = match.group(1), match.group(2), match.group(3)
        parts = [n.strip() for n in names.split(",") if n.strip()]
        moved = {}
        for part in parts:
            name = part.split(" as ")[0].strip()
            if f"{base}.{name}" in table:
                moved[part] = table[f"{base}.{name}"]
        if not moved:
            return match.group(0)
        lines = []
        kept = [p for p in parts if p not in moved]
        if kept:
            lines.append(f"{indent}from {base} import {', '.join(kept)}")
        for part, new in moved.items():
            name = part.split(" as ")[0].strip()
            alias = part.split(" as ")[1].strip() if " as " in part else None
            parent, leaf = new.rsplit(".", 1)
            if alias is None and leaf != name:
                alias = name
            lines.append(f"{indent}from {parent} import {leaf}" + (f" as {alias}" if alias else ""))
        return "\n".join(lines)

    return re.sub(r"^([ \t]*)from (resumerge(?:\.[\w.]+)?) import ([\w ,]+)$", one, text, flags=re.MULTILINE)


def rename_paths(text: str, moves: list[Move]) -> str:
    """``resumerge/a/b.py`` and ``resumerge/a/`` anywhere; ``a/b.py`` (a path under resumerge/, as the docs write
    them) where it names a .py file."""
    for move in sorted(moves, key=lambda m: -len(m.old)):
        old, new = move.old, move.new
        text = re.sub(rf"(?<![\w/.-])resumerge/{re.escape(old)}(?![\w])", f"resumerge/{new}", text)
        if old.endswith(".py"):
            text = re.sub(rf"(?<![\w/.-]){re.escape(old)}(?![\w])", new, text)
        else:
            text = re.sub(rf"(?<![\w/.-]){re.escape(old)}/((?:[\w]+/)*[\w]+\.py)(?![\w])", rf"{new}/\1", text)
    return text


def relative_references(path: Path, text: str, old_module: str, renames: list[tuple[str, str]]) -> str:
    """A file's ``:role:`~.x.y``` references to a module ``x`` beside it, resolved against where the file was
    (``old_module``) and written absolute where ``.x`` would now name another module (the file moved, or ``x``
    did)."""
    table = sorted(renames, key=lambda pair: -len(pair[0]))
    pkg = next(folder for folder in path.parents if folder.name == "resumerge")  # the nearest: the package
    old_package = old_module if path.name == "__init__.py" else old_module.rsplit(".", 1)[0]
    here = ".".join(path.relative_to(pkg.parent).with_suffix("").parts).removesuffix(".__init__")
    new_package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]

    def mapped(dotted: str) -> str:
        for old, new in table:
            if dotted == old or dotted.startswith(old + "."):
                return new + dotted[len(old):]
        return dotted

    def is_module(dotted: str) -> bool:
        where = pkg.parent.joinpath(*dotted.split("."))
        return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()

    def one(match: re.Match[str]) -> str:
        role, tilde, rest = match.group(1), match.group(2), match.group(3)
        first = rest.split(".")[0]
        if not is_module(mapped(f"{old_package}.{first}")):
            return match.group(0)  # a name of the module itself, not a sibling module
        target = mapped(f"{old_package}.{rest}")
        if f"{new_package}.{rest}" == target:
            return match.group(0)
        return f"{role}`{tilde}{target}`"

    return re.sub(r"(:\w+:)`(~?)\.([\w.]+)`", one, text)


def _may_import_span(text: str) -> tuple[int, int] | None:
    """Where the ``May import:`` paragraph of an ``__init__``'s text is: its line and those continuing it, up to a
    blank line or the docstring's closing quotes (left out)."""
    match = re.search(r"^May import: ", text, re.MULTILINE)
    if match is None:
        return None
    end = match.start()
    for line in text[match.start():].split("\n"):
        if not line.strip() or (end > match.start() and line.lstrip().startswith('"""')):
            break
        quotes = line.find('"""')
        if quotes >= 0:
            return match.start(), end + len(line[:quotes].rstrip())
        end += len(line) + 1
    return match.start(), end - 1


def declared_layers(text: str, layer: str, unit_map: dict[str, str], groups: set[str]) -> str:
    """Rewrite the ``May import:`` paragraph of an ``__init__`` text for the new layers."""
    span = _may_import_span(text)
    if span is None:
        return text
    para = text[span[0]:span[1]]
    names = sorted(unit_map, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w.(])(" + "|".join(map(re.escape, names)) + r")(?![\w]|\.\w)") if names else None
    head, body = para[:len("May import: ")], para[len("May import: "):]
    # Rename outside parentheses only: what a parenthesis says is prose.
    pieces = re.split(r"(\([^)]*\))", body)
    for i in range(0, len(pieces), 2):
        if pattern is not None:
            pieces[i] = pattern.sub(lambda m: unit_map[m.group(1)], pieces[i])
        for name, narrowed in NARROWED.get(layer, {}).items():
            pieces[i] = re.sub(rf"(?<![\w.]){re.escape(name)}(?![\w]|\.\w)", ", ".join(narrowed), pieces[i])
    body = "".join(pieces)
    listed = [n.strip().rstrip(".").strip() for n in re.sub(r"\(.*?\)", "", body, flags=re.DOTALL)
              .replace("\n", " ").split(",")]
    # An analysis imports no other analysis.
    if layer.startswith("analyses."):
        for name in listed:
            if name == "analyses" or (name.startswith("analyses.") and name != layer):
                body = re.sub(rf"(?<![\w.]){re.escape(name)}(?: \([^)]*\))?, |, {re.escape(name)}(?: \([^)]*\))?"
                              rf"(?=[,.\s]|$)", "", body, count=1)
    listed = [n.strip().rstrip(".").strip() for n in re.sub(r"\(.*?\)", "", body, flags=re.DOTALL)
              .replace("\n", " ").split(",")]
    gained = [g for g in GAINS.get(layer, ()) if g not in listed]
    if gained:
        body = body.rstrip()
        end = "." if body.endswith(".") else ""
        body = body.removesuffix(".") + ", " + ", ".join(gained) + end
    if body == para[len(head):]:
        return text
    new_para = _fold_paragraph(head + body.replace("\n", " "), LINE - 4)
    return text[:span[0]] + new_para + text[span[1]:]


def _fold_paragraph(text: str, width: int) -> str:
    words, lines, line = text.split(" "), [], ""
    for word in words:
        if not word:
            continue
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    return "\n".join(lines)


def group_init(root: Path, group: str) -> str:
    """A group's ``__init__.py``: its job, what it holds (each layer's first sentence), and ``__all__``."""
    folder = root / "resumerge" / group
    held = sorted(p.parent.name for p in folder.glob("*/__init__.py"))
    lines = []
    for name in held:
        doc = ast.get_docstring(ast.parse((folder / name / "__init__.py").read_text(encoding="utf-8"))) or ""
        first = re.split(r"(?<=[.:])\s", doc.split("\n\n")[0].replace("\n", " "), maxsplit=1)[0].rstrip(".:")
        lines.append(f"- :mod:`.{name}`: {first}.")
    text = GROUPS[group] + "\n\n" + (
        "A group: each package here is a layer of its own, with its own ``May import:`` line (tests/test_layout.py "
        "holds them to it; no analysis imports another); this file imports nothing.")
    body = "\n\n".join(_fold_paragraph(p, LINE - 4) for p in text.split("\n\n"))
    listing = "\n".join(_fold_hanging(line, LINE - 4) for line in lines)
    names = ", ".join(f'"{n}"' for n in held)
    return f'"""{body}\n\n{listing}\n"""\n\n__all__ = [{names}]\n'


def _fold_hanging(line: str, width: int) -> str:
    folded = _fold_paragraph(line, width - 2).split("\n")
    return "\n".join([folded[0], *("  " + each for each in folded[1:])])


def write_groups(root: Path, say: list[str]) -> None:
    for group in GROUPS:
        init = root / "resumerge" / group / "__init__.py"
        if not init.parent.is_dir():
            continue
        text = group_init(root, group)
        if not init.exists() or init.read_text(encoding="utf-8") != text:
            say.append(f"write resumerge/{group}/__init__.py")
            init.write_text(text, encoding="utf-8")


def unit_map(moves: list[Move]) -> dict[str, str]:
    """Old layer names (as 'May import:' lines write them) -> new ones: the packages moved whole into a group."""
    return {m.old: m.new.replace("/", ".") for m in moves if not m.old.endswith(".py") and "/" not in m.old}


def rewrite_declarations(root: Path, say: list[str]) -> None:
    pkg = root / "resumerge"
    units = unit_map(_moves())
    groups = set(GROUPS)
    for init in sorted(pkg.rglob("*/__init__.py")):  # the layers' and, for their readers, their subpackages'
        layer = ".".join(init.parent.relative_to(pkg).parts)
        if layer in groups:
            continue
        text = init.read_text(encoding="utf-8")
        new = declared_layers(text, layer, units, groups)
        if new != text:
            say.append(f"declare {layer}'s layers ({init.relative_to(root)})")
            init.write_text(new, encoding="utf-8")


def layout_test(root: Path, say: list[str]) -> None:
    path = root / "tests" / "test_layout.py"
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8")
    comment = ("# The groups (analyses, merge, runs: packages that hold layers), the layers beside them (api, cli, "
               "config, forward,\n# inputs, memory, outputs), the two leaves (errors, torch_import), the package's "
               "own files and ``lm_eval.py``\n# (``python -m resumerge.lm_eval``: lm-eval's command line with "
               "``--model resumerge``). Issue 83 holds it to 16.\n")
    new = re.sub(r"(?:^#.*\n)*^MAX_ENTRIES = \d+\n", comment + f"MAX_ENTRIES = {MAX_ENTRIES}\n", text,
                 count=1, flags=re.MULTILINE)
    if new != text:
        say.append("tests/test_layout.py: MAX_ENTRIES = 16")
        path.write_text(new, encoding="utf-8")


ROOT_PARAGRAPH = """\
The public Python API is :mod:`resumerge.api`'s, every name of its ``__all__`` reachable here as ``resumerge.NAME``
(derived from it, not copied: a name the API exports is exported here too), but for a name one of the package's own
modules holds (``lm_eval``, the module of ``python -m resumerge.lm_eval``): importing that module binds its name here,
so that call is ``resumerge.api.lm_eval``, and ``__all__`` leaves it out. The API imports its calls on their first
use, so that ``import resumerge`` (and ``resumerge status``) never pays for importing torch."""


def root_docstring(root: Path, say: list[str]) -> None:
    """The package's docstring named estimate and evolve among the modules that shadow API names: only lm_eval
    does now (run before the references are rewritten, which would rename what it names)."""
    path = root / "resumerge" / "__init__.py"
    text = path.read_text(encoding="utf-8")
    new = re.sub(r"The public Python API is .*?pays for importing torch\.", lambda _: ROOT_PARAGRAPH, text, count=1,
                 flags=re.DOTALL)
    if new == text and "``evolve``" in text:  # the old sentence, written otherwise than this script knows
        say.append("LEFT FOR YOU: resumerge/__init__.py's docstring: say only lm_eval shadows an API name")
    if new != text:
        say.append("resumerge/__init__.py: only lm_eval shadows an API name")
        path.write_text(new, encoding="utf-8")


def collision_tests(root: Path, say: list[str]) -> None:
    """The tests that name the modules shadowing API names: ``estimate`` and ``evolve`` no longer do (run before the
    references are rewritten)."""
    for path in sorted((root / "tests").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        new = re.sub(r'\{"estimate",\s*"evolve",\s*"lm_eval"\}', '{"lm_eval"}', text)
        new = re.sub(r"\(``resumerge\.evolve``\s+is\s+the\s+package\s+once\s+imported\)",
                     "(``resumerge.lm_eval``, once imported)", new)
        if new != text:
            say.append(f"{path.relative_to(root)}: only lm_eval shadows an API name")
            path.write_text(new, encoding="utf-8")


def tree_section(root: Path) -> str:
    """The package's top-level entries and the groups' layers, each with its docstring's first sentence."""
    pkg = root / "resumerge"

    def first(path: Path) -> str:
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        except (OSError, SyntaxError):
            return ""
        sentence = re.split(r"(?<=[.:])\s", doc.split("\n\n")[0].replace("\n", " "), maxsplit=1)[0]
        return sentence.rstrip(":").rstrip(".").replace("``", "`") + "."

    rows = []
    for entry in sorted(p for p in pkg.iterdir() if p.name != "__pycache__"):
        if entry.is_dir():
            init = entry / "__init__.py"
            rows.append(f"- `{entry.name}/`: {first(init)}")
            if entry.name in GROUPS:
                for sub in sorted(p.parent for p in entry.glob("*/__init__.py")):
                    rows.append(f"  - `{entry.name}/{sub.name}/`: {first(sub / '__init__.py')}")
        elif entry.suffix == ".py":
            rows.append(f"- `{entry.name}`: {first(entry)}")
        else:
            rows.append(f"- `{entry.name}`: the package's typing marker (PEP 561).")
    lines = [TREE_START, "## The tree", "",
             f"`resumerge/` holds {sum(1 for p in pkg.iterdir() if p.name != '__pycache__')} entries "
             "(tests/test_layout.py caps them at 16). A group (`analyses/`, `merge/`, `runs/`) holds packages "
             "that belong together; each of them is a layer with its own `May import:` line, and no analysis "
             "imports another.", "",
             *rows, TREE_END]
    return "\n".join(lines) + "\n"


def architecture(root: Path, say: list[str]) -> None:
    path = root / "docs" / "architecture.md"
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8")
    section = tree_section(root)
    if TREE_START in text and TREE_END in text:
        new = re.sub(re.escape(TREE_START) + r".*?" + re.escape(TREE_END) + r"\n", lambda _: section, text,
                     count=1, flags=re.DOTALL)
    else:
        head, sep, rest = text.partition("\n## ")
        new = head.rstrip("\n") + "\n\n" + section + ("\n## " + rest if sep else "")
    if new != text:
        say.append("docs/architecture.md: the tree")
        path.write_text(new, encoding="utf-8")


def fold_long_lines(path: Path) -> bool:
    """Refold comment and docstring lines over :data:`LINE` characters into the line after, where that line
    continues the same comment or docstring paragraph (so the text reads the same); code lines are left to ruff."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    if not any(len(line) > LINE for line in lines):
        return False
    inside = _docstring_lines(text)
    changed = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if len(line) <= LINE:
            i += 1
            continue
        comment = re.match(r"^(\s*)# ", line)
        if comment:
            indent = comment.group(1)
            cut = line.rfind(" ", 0, LINE + 1)
            if cut <= len(indent) + 2:
                i += 1
                continue
            head, tail = line[:cut], line[cut + 1:]
            following = lines[i + 1] if i + 1 < len(lines) else ""
            if re.match(rf"^{re.escape(indent)}# \S", following):
                lines[i], lines[i + 1] = head, f"{indent}# {tail} {following[len(indent) + 2:]}"
            else:
                lines[i:i + 1] = [head, f"{indent}# {tail}"]
            changed = True
            continue  # the same line again: it fits now; the next may overflow in turn
        trailing = re.match(r"^(\s*)(\S.*?)  # (.*)$", line)
        if i not in inside and trailing and trailing.group(2).count('"') % 2 == 0 \
                and trailing.group(2).count("'") % 2 == 0:  # the '#' outside any string
            # Code with a comment after it: the comment goes above, folded like any comment.
            indent = trailing.group(1)
            lines[i:i + 1] = [f"{indent}# {trailing.group(3)}", f"{indent}{trailing.group(2)}"]
            inside = {j + (j >= i) for j in inside}
            changed = True
            continue
        if i in inside:  # a docstring's line: its tail joins the next line of its paragraph, else a line of its own
            indent = re.match(r"^\s*", line).group(0)  # type: ignore[union-attr]
            cut = line.rfind(" ", 0, LINE + 1)
            following = lines[i + 1].strip() if i + 1 in inside and i + 1 < len(lines) else ""
            if cut > len(indent) + 3:
                head, tail = line[:cut], line[cut + 1:]
                if following and not line.rstrip().endswith('"""') \
                        and not following.startswith(('"""', "- ", ":", ">>>", "*")):
                    margin = lines[i + 1][:len(lines[i + 1]) - len(lines[i + 1].lstrip())]
                    lines[i], lines[i + 1] = head, f"{margin}{tail} {following}"
                else:
                    lines[i:i + 1] = [head, f"{indent}{tail}"]
                    inside = {j + (j > i) for j in inside} | {i + 1}
                changed = True
                continue
        i += 1
    if changed:
        path.write_text("\n".join(lines), encoding="utf-8")
    return changed


def _docstring_lines(text: str) -> set[int]:
    """The 0-based indexes of the lines of the docstrings (modules', classes', functions'): prose, refolded freely;
    other triple-quoted strings (a child process's code) are left alone."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return set()
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str) and first.end_lineno is not None:
                found.update(range(first.lineno - 1, first.end_lineno))
    return found


def tidy(root: Path, touched: list[Path], say: list[str]) -> None:
    """The files a re-layout rewrote made tidy again: their imports sorted, the comment and docstring lines the
    longer names pushed past the line limit refolded, and a code line still past it said (``LEFT FOR YOU``)."""
    sort_imports(root, touched, say)
    folded = [p for p in touched if p.suffix == ".py" and fold_long_lines(p)]
    if folded:
        say.append(f"refolded long comment/docstring lines in {len(folded)} files")
    for path in touched:
        if path.suffix == ".py":
            for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
                if len(line) > LINE:
                    say.append(f"LEFT FOR YOU: {path.relative_to(root)}:{number}: {len(line)} characters (code)")


def sort_imports(root: Path, files: Iterable[Path], say: list[str]) -> None:
    py = [str(p) for p in files if p.suffix == ".py"]
    if not py:
        return
    ruff = shutil.which("ruff")
    if ruff is None:
        say.append("ruff not found: imports left unsorted (run ruff check --fix --select I)")
        return
    for start in range(0, len(py), 200):
        subprocess.run([ruff, "check", "--quiet", "--fix", "--select", "I", *py[start:start + 200]], cwd=root,
                       capture_output=True, text=True, check=False)


def imported_layers(folder: Path, units: dict[str, str] | None = None, groups: Iterable[str] = GROUPS) -> set[str]:
    """The layers the modules under ``folder`` import (every import, inside functions and TYPE_CHECKING too), named
    as the 'May import:' lines name them: a top-level package or module (its new name in ``units``), or
    ``group.layer`` for a package of ``groups``."""
    found: set[str] = set()
    units, groups = units or {}, set(groups)
    for path in folder.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for name in names:
                parts = name.split(".")
                if parts[0] != "resumerge" or len(parts) < 2:
                    continue
                top = units.get(parts[1], parts[1])
                found.add(f"{parts[1]}.{parts[2]}" if parts[1] in groups and len(parts) > 2 else top)
    return found


def _analyses_allowed(root: Path) -> set[str] | None:
    """What the analyses' one ``May import:`` line allowed each of them, in the new names (None: it has none, it
    is a group already)."""
    init = root / "resumerge" / "analyses" / "__init__.py"
    if not init.exists():
        return None
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    match = re.search(r"^May import: (.*(?:\n.+)*)", doc, re.MULTILINE)
    if match is None:
        return None
    units = unit_map(_moves())
    listed = re.sub(r"\(.*?\)", "", match.group(1).replace("\n", " "))
    names = {n.strip().rstrip(".").strip() for n in listed.split(",")}
    return {units.get(n, n) for n in names if n and n != "nothing"}


def rewrite_references(root: Path, moves: list[Move], say: list[str], skip: frozenset[str] = frozenset()) -> list[Path]:
    """Rewrite every reference to a moved module in every text file (:func:`text_files`, but those in ``skip``):
    imports, dotted names, paths, and a moved module's relative references; the files changed."""
    moved_from = {}  # new path of a moved file -> its old dotted module
    pkg = root / "resumerge"
    for move in moves:
        there = pkg / move.new
        if there.is_file():
            moved_from[there] = _dotted(move.old)
        elif there.is_dir():
            for each in there.rglob("*.py"):
                rel = each.relative_to(there).with_suffix("").as_posix().replace("/", ".")
                moved_from[each] = _dotted(move.old) + ("" if rel == "__init__" else "." + rel.removesuffix(
                    ".__init__"))
    renames = _renames(moves)
    touched = []
    for path in text_files(root):
        if path.relative_to(root).as_posix() in skip:
            continue
        text = path.read_text(encoding="utf-8")
        new = rename_from_imports(text, renames) if path.suffix == ".py" else text
        new = rename_dotted(new, renames)
        new = rename_paths(new, moves)
        if path.suffix == ".py" and path.is_relative_to(pkg):
            old_module = moved_from.get(path)
            if old_module is None:  # a file that stayed: its relative references to siblings that left
                rel = path.relative_to(root).with_suffix("").as_posix().replace("/", ".")
                old_module = rel
            new = relative_references(path, new, old_module, renames)
        if new != text:
            path.write_text(new, encoding="utf-8")
            touched.append(path)
    if touched:
        say.append(f"rewrote references in {len(touched)} files")
    return touched


Step = Callable[[Path, list[str]], None]


def run_moves(root: Path, moves: list[Move], dry: bool, *, skip: frozenset[str] = frozenset(),
              before: Iterable[Step] = (), after: Iterable[Step] = ()) -> list[str]:
    """A sibling script's run, said line by line: its ``before`` steps (a real run only), ``moves`` made (only said
    where ``dry``), the references rewritten outside ``skip``, its ``after`` steps, and the rewritten files tidied."""
    say: list[str] = []
    for step in () if dry else before:
        step(root, say)
    move_files(root, moves, say, dry)
    if dry:
        return say
    touched = rewrite_references(root, moves, say, skip)
    for step in after:
        step(root, say)
    tidy(root, touched, say)
    return say


def relayout(root: Path, dry: bool = False) -> list[str]:
    say: list[str] = []
    moves = _moves()
    # Each analysis keeps what the analyses' one line allowed it and it imports (each line is its own from now on).
    allowed = _analyses_allowed(root)
    # Every move, done now or before: the references a merged branch still writes the old way are rewritten too.
    move_files(root, moves, say, dry)
    if dry:
        return say
    root_docstring(root, say)
    collision_tests(root, say)
    touched = rewrite_references(root, moves, say)
    pkg = root / "resumerge"
    if allowed is not None:
        for sub in sorted((pkg / "analyses").glob("*/__init__.py")):
            layer = f"analyses.{sub.parent.name}"
            used = imported_layers(sub.parent, unit_map(moves)) & allowed
            GAINS[layer] = tuple(sorted({*GAINS.get(layer, ()), *used} - {"errors", "torch_import"}))
    write_groups(root, say)
    rewrite_declarations(root, say)
    layout_test(root, say)
    architecture(root, say)
    tidy(root, touched, say)
    return say


def main(argv: list[str] | None = None, *, run: Callable[[Path, bool], list[str]] | None = None,
         doc: str | None = None, name: str = "relayout") -> int:
    """The command line of this script, and of a sibling that hands in its own ``run`` (its moves), ``doc`` and
    ``name``."""
    parser = argparse.ArgumentParser(description=(doc or __doc__ or "").split("\n\n")[0])
    parser.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--check", action="store_true", help="say what would move; exit 1 if anything would")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if not (root / "resumerge" / "__init__.py").exists():
        print(f"{name}: {root} is not a resumerge checkout (no resumerge/__init__.py)", file=sys.stderr)
        return 2
    said = (run or relayout)(root, args.check)
    print("\n".join(said) if said else f"{name}: nothing to do")
    return 1 if args.check and said else 0


if __name__ == "__main__":
    sys.exit(main())

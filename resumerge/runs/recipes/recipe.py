"""Multi-document (mergekit-multi) recipes: parse every stage, check the names and the graph, order the stages.

A recipe is a YAML file of several merge configs separated by ``---``. Each document may set ``name:``; a model
reference whose path is a stage name reads that stage's output (as mergekit-multi does, the name wins over a
local folder or hub repo of the same name). The one unnamed document is the final merge and goes to OUT; the
named stages go to the intermediate dir. Without an unnamed document, the one stage no other stage reads is the
final merge. Everything here is checked from the YAML alone, before any model file is opened: each document as a
normal config (errors keep their YAML path, prefixed ``[stage NAME]`` or ``[document N]``), stage names,
duplicate names, references to stages, cycles, and how many final merges there are.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import yaml

from resumerge.config.merge_config import MergeConfig, config_from_document, parse_documents
from resumerge.config.modelref import ModelRef
from resumerge.errors import ConfigError, ResumergeError
from resumerge.runs.transplant.spec import stage_of

# Names become directory names under the intermediate dir and must stay referable as a model path.
_BAD_NAME_CHARS = frozenset("/\\\x00@+")
_MAX_NAME = 200
_MARKER = re.compile(r"^(---|\.\.\.)(?=\s|$)(.*)$", re.DOTALL)


@dataclass(frozen=True)
class Stage:
    """One document of a recipe: its name (None for the unnamed final merge), 1-based document number, its own
    YAML text (what its output's ``mergekit_config.yml`` holds), its validated config, and the stages it reads
    (names, in YAML order)."""

    name: str | None
    document: int
    text: str
    config: MergeConfig
    needs: tuple[str, ...]
    # A stage that transplants a tokenizer (``tokensurgeon:``): its recorded options (its config lists MODEL and
    # DONOR as a passthrough's models); None for a merge.
    surgery: str | None = None

    @property
    def label(self) -> str:
        """How messages name the stage: ``stage NAME`` or ``document N`` for the unnamed one."""
        return f"stage {self.name}" if self.name is not None else f"document {self.document}"

    @property
    def key(self) -> str:
        """A stable identity within the recipe: the name, or ``#N`` for the unnamed document."""
        return self.name if self.name is not None else f"#{self.document}"


@dataclass(frozen=True)
class Recipe:
    """A validated recipe: ``stages`` in dependency order (producers first, ties in document order) and the
    ``final`` stage, whose output is OUT."""

    text: str
    stages: tuple[Stage, ...]
    final: Stage

    def stage(self, name: str) -> Stage:
        """The stage called ``name``; raises KeyError."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)

    def consumers(self, stage: Stage) -> tuple[Stage, ...]:
        """The stages that read ``stage``'s output."""
        return tuple(s for s in self.stages if stage.name is not None and stage.name in s.needs)

    @property
    def roots(self) -> tuple[Stage, ...]:
        """The stages nothing reads: the final merge first, then named stages no other stage uses (mergekit-multi
        builds those too, in the intermediate dir)."""
        others = tuple(s for s in self.stages if s is not self.final and not self.consumers(s))
        return (self.final, *others)


def is_recipe_text(text: str) -> bool:
    """True when ``text`` holds more than one non-empty YAML document (bad YAML counts as not a recipe: the
    single-config loader reports it)."""
    try:
        return len(parse_documents(text)) > 1  # the run's one parse of its text (parse_documents keeps it)
    except ConfigError:
        pass  # bad YAML, a repeated key, no document: PyYAML's own loader counts (a recipe repeating a key is one)
    try:
        return sum(1 for d in yaml.safe_load_all(text) if d is not None) > 1
    except yaml.YAMLError:
        return False


def load_recipe_text(text: str, *, source: str = "recipe") -> Recipe:
    """Parse and validate the recipe ``text``; raises :class:`ConfigError` (exit 2) for the first problem.

    Checks, in order: YAML syntax; each document as a merge config; stage names (strings usable as a folder
    and a model path); duplicate names; more than one unnamed document; stage references with a revision or a
    LoRA adapter; cycles (the message lists the cycle); more than one final merge.
    """
    docs = parse_documents(text, source=source)
    texts = _document_texts(text, docs)
    stages: list[Stage] = []
    seen: dict[str, int] = {}
    unnamed: int | None = None
    for number, (doc, own) in enumerate(zip(docs, texts), start=1):
        name = doc.get("name") if isinstance(doc, dict) else None
        label = f"stage {name}" if isinstance(name, str) else f"document {number}"
        with stage_errors(label):
            surgery = stage_of(doc) if isinstance(doc, dict) else None
            config = config_from_document(surgery[1] if surgery else doc, own, source=f"{source} document {number}")
        if config.name is None:
            if unnamed is not None:
                raise ConfigError(
                    f"more than one unnamed (final) merge: documents {unnamed} and {number}",
                    yaml_path=f"[document {number}]",
                    hint="name every stage except the final merge (name: ...); the unnamed one is written to OUT",
                )
            unnamed = number
        else:
            _check_name(config.name, number)
            if config.name in seen:
                raise ConfigError(
                    f"duplicate stage name {config.name!r} (documents {seen[config.name]} and {number})",
                    yaml_path=f"[document {number}] name",
                    hint="give every stage its own name",
                )
            seen[config.name] = number
        stages.append(Stage(config.name, number, own, config, (), surgery[0] if surgery else None))
    stages = [_with_needs(s, set(seen)) for s in stages]
    _check_cycles(stages)
    final = _final(stages)
    return Recipe(text, _ordered(stages), final)


@contextmanager
def stage_errors(label: str) -> Iterator[None]:
    """Prefix a :class:`ResumergeError` raised inside the block with ``[label]``.

    The prefix goes in front of the YAML path when there is one (``[stage a] models[0].model``), else in front
    of the message, so a file path the error carries still shows. An error is prefixed once, by the innermost
    block.
    """
    try:
        yield
    except ResumergeError as exc:
        if not getattr(exc, "_stage_prefixed", False):
            where = f"[{label}]"
            if exc.yaml_path:
                exc.yaml_path = f"{where} {exc.yaml_path}"
            elif exc.path:
                exc.message = f"{where} {exc.message}"
                exc.args = (exc.message,)
            else:
                exc.yaml_path = where
            exc._stage_prefixed = True  # type: ignore[attr-defined]
        raise


def near_stage_name(recipe: Recipe, path: str) -> str | None:
    """The stage name ``path`` was probably meant to be (a typo), or None."""
    names = [s.name for s in recipe.stages if s.name is not None]
    close = difflib.get_close_matches(path, names, n=1, cutoff=0.75)
    return close[0] if close else None


def _document_texts(text: str, docs: list[Any]) -> list[str]:
    """Each non-empty document's own YAML text, so a stage's ``mergekit_config.yml`` shows what the user wrote.

    Documents are split at ``---`` / ``...`` lines (YAML forbids those at column 0 inside a scalar). When a piece
    does not load back to exactly the parsed document (directives, exotic layouts) the document is re-serialised.
    """
    pieces: list[list[str]] = [[]]
    for line in text.splitlines(keepends=True):
        match = _MARKER.match(line)
        if match is None:
            pieces[-1].append(line)
            continue
        pieces.append([])
        rest = match[2].strip(" \t")
        if match[1] == "---" and rest.strip():
            pieces[-1].append(rest)
    texts = []
    for piece in pieces:
        chunk = "".join(piece).strip("\n")
        try:
            loaded = yaml.safe_load(chunk) if chunk.strip() else None
        except yaml.YAMLError:
            loaded = None
        if loaded is not None:
            texts.append(chunk + "\n")
    if len(texts) != len(docs) or any(yaml.safe_load(t) != d for t, d in zip(texts, docs)):
        return [yaml.safe_dump(d, sort_keys=False) for d in docs]
    return texts


def _check_name(name: str, number: int) -> None:
    bad = sorted(_BAD_NAME_CHARS & set(name))
    problem = None
    if not name.strip() or name != name.strip():
        problem = "must not be empty or start or end with spaces"
    elif name in (".", "..") or name.startswith("."):
        problem = "must not start with '.'"
    elif bad:
        problem = f"must not contain {' '.join(repr(c) for c in bad)}"
    elif len(name) > _MAX_NAME:
        problem = f"is longer than {_MAX_NAME} characters"
    if problem:
        raise ConfigError(
            f"stage name {name!r} {problem}",
            yaml_path=f"[document {number}] name",
            hint="a stage name becomes a folder in the intermediate dir and a model path in later stages",
        )


def _references(config: MergeConfig) -> Iterator[tuple[ModelRef, str]]:
    """Every model reference of ``config`` with its YAML path, in YAML order (repeats included)."""
    if config.base_model is not None:
        yield config.base_model, "base_model"
    for src in config.all_models():
        yield src.model, f"{src.yaml_path}.model"
    for sl in config.all_slices():
        if sl.base_model is not None:
            yield sl.base_model, f"{sl.yaml_path}.base_model"
        for src in sl.sources:
            yield src.model, f"{src.yaml_path}.model"


def _with_needs(stage: Stage, names: set[str]) -> Stage:
    needs: list[str] = []
    for ref, where in _references(stage.config):
        if ref.path not in names:
            continue
        if ref.revision is not None or ref.lora is not None:
            what = f"a revision (@{ref.revision})" if ref.revision is not None else "a LoRA adapter"
            raise ConfigError(
                f"the reference to stage {ref.path!r} has {what}; a stage's output has neither",
                yaml_path=f"[{stage.label}] {where}",
                hint=f"write just {ref.path!r}",
            )
        if ref.path not in needs:
            needs.append(ref.path)
    if needs and stage.surgery is not None:  # its tokenizers are read when it is planned, before a stage has run
        raise ConfigError(f"a tokensurgeon stage reads models, not stages: it reads {needs[0]!r}",
                          yaml_path=f"[{stage.label}] tokensurgeon",
                          hint="transplant the models first, then merge the transplanted model in a later stage")
    return replace(stage, needs=tuple(needs))


def _where(stage: Stage, name: str) -> str:
    return next(w for ref, w in _references(stage.config) if ref.path == name)


def _check_cycles(stages: list[Stage]) -> None:
    by_name = {s.name: s for s in stages if s.name is not None}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in by_name[name].needs:
            if state.get(dep) == 1:
                cycle = [*path[path.index(dep):], dep] if dep in path else [name, dep]
                first = by_name[cycle[0]]
                raise ConfigError(
                    f"stages form a cycle: {' -> '.join(cycle)}",
                    yaml_path=f"[{first.label}] {_where(first, cycle[1])}",
                    hint="a stage can only read stages that do not read it back",
                )
            if state.get(dep) is None:
                visit(dep, [*path, dep])
        state[name] = 2

    for stage in stages:
        if stage.name is not None and state.get(stage.name) is None:
            visit(stage.name, [stage.name])


def _final(stages: list[Stage]) -> Stage:
    unnamed = [s for s in stages if s.name is None]
    if unnamed:
        return unnamed[0]
    used = {n for s in stages for n in s.needs}
    sinks = [s for s in stages if s.name not in used]
    if len(sinks) > 1:
        raise ConfigError(
            f"the recipe has {len(sinks)} final merges (stages no other stage reads): "
            + ", ".join(str(s.name) for s in sinks),
            yaml_path=f"[{sinks[1].label}]",
            hint="leave the final merge unnamed: it is written to OUT, the named stages to the intermediate dir",
        )
    return sinks[0]


def _ordered(stages: list[Stage]) -> tuple[Stage, ...]:
    """Producers before consumers; among stages that are ready, the earlier document first."""
    done: set[str] = set()
    left = list(stages)
    order: list[Stage] = []
    while left:
        ready = next(s for s in left if all(n in done for n in s.needs))
        order.append(ready)
        left.remove(ready)
        if ready.name is not None:
            done.add(ready.name)
    return tuple(order)

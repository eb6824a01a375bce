"""Which modules of the fine-tune become LoRA factors, which are saved whole, and which are left out.

mergekit-extract-lora's rules, decided from tensor names and shapes (never weights): a module with a 2-D weight is
decomposed (a token embedding transposed, as PEFT's ``lora_embedding_A/B``); a module whose weight is not a matrix
(norms) is saved whole under ``modules_to_save`` unless ``--skip-undecomposable``; embeddings and the head are
saved whole unless ``--embed-lora`` (or always, when the vocabularies differ); ``--save-module`` names modules (full
name or last component) to save whole; ``-i``/``-e`` regexes choose, by ``re.search`` on the module name, which of
the others are extracted; a module PEFT could not wrap in the model transformers builds is refused
(:mod:`.loadable`). Names, embeddings, ``modules_to_save`` entries and modules holding parameters of their own
follow the model PEFT loads the adapter onto (:mod:`.peftview`).
Every mistake is a :class:`UsageError` or :class:`ModelInputError` (exit 2) raised here,
before any weight is read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from resumerge.errors import ModelInputError, UsageError
from resumerge.inputs.model import ModelInput
from resumerge.merge.plan.architecture import is_head, is_input_embedding
from resumerge.runs.extract.loadable import check_loadable
from resumerge.runs.extract.peftview import PeftView, peft_view
from resumerge.runs.extract.spec import ExtractSpec

# Last components of embedding modules (nn.Embedding) besides the token embeddings is_input_embedding knows.
_EMBEDDING_NAMES = frozenset({"wte", "wpe", "word_embeddings", "position_embeddings", "embed_positions",
                              "token_type_embeddings", "embed_tokens"})


@dataclass(frozen=True)
class LoraModule:
    """A module decomposed into LoRA factors: its name, its weight and bias tensors (FT's and BASE's names are the
    same, except a tied head read from the embedding), ``embedding`` when the delta is transposed
    (``lora_embedding_A/B``), its rank, and the rows kept of both when --unsafe-truncate-embeddings cuts them."""

    name: str
    weight: str
    bias: str | None
    embedding: bool
    rank: int
    keep_rows: int | None = None


@dataclass(frozen=True)
class ModuleChoice:
    """The outcome of planning the modules: LoRA modules, FT tensors saved whole, and the adapter config's lists."""

    lora: tuple[LoraModule, ...]
    saved: tuple[tuple[str, str], ...]  # (adapter tensor name, FT tensor name)
    modules_to_save: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The last components of the decomposed modules, sorted (PEFT's ``target_modules``)."""
        return tuple(sorted({m.name.split(".")[-1] for m in self.lora}))


@dataclass(frozen=True)
class _Module:
    name: str  # the model's name of the module (PEFT's: .peftview)
    weight: str  # the tensor holding its weight (a tied head: the embedding)
    shape: tuple[int, ...]
    bias: str | None
    embedding: bool
    head: bool
    module: str = ""  # the checkpoint's name, which -e/-i regexes match (the model's when empty)

    @property
    def stored(self) -> str:
        return self.module or self.name


def choose_modules(spec: ExtractSpec, ft: ModelInput, base: ModelInput, *, truncate: bool = False) -> ModuleChoice:
    """Plan every module of ``ft`` against ``base`` under ``spec`` (headers only)."""
    view = peft_view(base.config)
    modules = _modules(ft, view)
    names = [m.stored for m in modules]
    _check_patterns(spec, names)
    embed_lora = spec.embed_lora
    notes: list[str] = []
    if embed_lora and _vocab(ft, modules) != _vocab(base, _modules(base, view)):
        notes.append("the vocabularies differ: embeddings and head are saved whole (--embed-lora ignored)")
        embed_lora = False
    save = list(spec.save_modules)
    whole: list[_Module] = []
    lora: list[LoraModule] = []
    saved: list[tuple[str, str]] = []
    owned = _owned(spec, ft, view, names)
    for m in modules:
        key = m.name.split(".")[-1]
        whole_embedding = not embed_lora and (m.embedding or m.head) and not _matches(spec.exclude_regexes, m.stored)
        if view.owner(m.name) in owned:  # saved with the module holding it, under that module's entry
            saved.extend(_whole(m))
        elif m.name in save or m.stored in save or key in save or whole_embedding:
            whole.append(m)
        elif _extracted(spec, m.stored):
            if len(m.shape) == 2:
                lora.append(_lora(spec, m, base, truncate))
            elif not spec.skip_undecomposable:
                whole.append(m)
    for m in whole:
        saved.extend(_whole(m))
    for owner in owned:
        saved.extend((f"base_model.model.{owner}.{leaf}", f"{owned[owner]}.{leaf}") for leaf in view.owners[owner])
    save = [*save, *(e for e in _entries(view, whole, owned) if e not in save)]
    recorded = dict(spec.ranks)
    if recorded:  # --sv-epsilon's ranks: a module with no singular value above epsilon gets no LoRA
        dropped = [m.name for m in lora if recorded.get(m.name, m.rank) == 0]
        lora = [replace(m, rank=recorded.get(m.name, m.rank)) for m in lora if m.name not in dropped]
        if dropped:
            notes.append(f"{len(dropped)} modules have no singular value above --sv-epsilon and get no LoRA: "
                         + ", ".join(dropped[:5]) + (", …" if len(dropped) > 5 else ""))
    check_loadable(base.config, [(m.name, m.weight.removesuffix(".weight")) for m in lora])
    return ModuleChoice(tuple(lora), tuple(saved), tuple(save), tuple(notes))


def _owned(spec: ExtractSpec, ft: ModelInput, view: PeftView, names: list[str]) -> dict[str, str]:
    """The modules saved whole because they hold parameters of their own (Mamba's ``A_log``), which PEFT can only
    save with their module: model name -> checkpoint name; none with --skip-undecomposable or where -i/-e leave
    them out."""
    found = {}
    for stored in {n.rpartition(".")[0] for n in ft.tensors if n.rpartition(".")[2] not in ("weight", "bias")}:
        owner = view.name(stored)
        if owner in view.owners and _extracted(spec, stored) and not spec.skip_undecomposable:
            found[owner] = stored
    return found


def _entries(view: PeftView, whole: list[_Module], owned: Mapping[str, str]) -> list[str]:
    """``modules_to_save``: for each kind of module saved whole (by its last component, in order), the shortest end
    of their names no other module's name ends with (.peftview), or each one's own where they share none."""
    inside = {m.name for m in whole} | set(owned)
    kinds: dict[str, list[str]] = {}
    for name in [*(m.name for m in whole), *owned]:
        kinds.setdefault(name.split(".")[-1], []).append(name)
    return [e for names in kinds.values() for e in view.suffixes(names, inside)]


def _modules(model: ModelInput, view: PeftView | None = None) -> list[_Module]:
    """The model's modules with a weight, embeddings first and the head last (transformers' module order for the
    families resumerge knows), a tied head standing in for a missing ``lm_head``; named as ``view`` (PEFT's model)
    names them, an ``nn.Embedding`` of it an embedding whatever its name."""
    view = view or PeftView()
    tensors = model.tensors
    found = []
    for name in tensors:
        if not name.endswith(".weight"):
            continue
        module = name[: -len(".weight")]
        bias = module + ".bias"
        named = view.name(module)
        embedding = is_input_embedding(name) or module.split(".")[-1] in _EMBEDDING_NAMES or named in view.embeddings
        found.append(_Module(named, name, tuple(tensors[name].entry.shape), bias if bias in tensors else None,
                             embedding and not is_head(name), is_head(name), module if named != module else ""))
    if not any(m.head for m in found) and model.config.get("tie_word_embeddings", False):
        embed = next((m for m in found if m.weight.endswith("embed_tokens.weight")), None)
        if embed is not None:
            found.append(_Module("lm_head", embed.weight, embed.shape, None, False, True))
    return sorted(found, key=lambda m: (0 if m.embedding else 2 if m.head else 1, _natural(m.name)))


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that puts layer 2 before layer 10."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in name.split("."))


def _vocab(model: ModelInput, modules: list[_Module]) -> int | None:
    for m in modules:
        if m.embedding and is_input_embedding(m.weight):
            return m.shape[0]
    return None


def _check_patterns(spec: ExtractSpec, names: list[str]) -> None:
    """Refuse a regex that matches no module and a --save-module that names none (mistyped names would otherwise
    silently change the adapter)."""
    for flag, regexes in (("--include-regex", spec.include_regexes), ("--exclude-regex", spec.exclude_regexes)):
        for regex in regexes:
            try:
                compiled = re.compile(regex)
            except re.error as exc:
                raise UsageError(f"{flag} {regex!r} is not a valid regular expression: {exc}") from None
            if not any(compiled.search(n) for n in names):
                raise UsageError(f"{flag} {regex!r} matches no module of the model",
                                 hint=f"module names look like {names[len(names) // 2]!r}")
    lasts = {n.split(".")[-1] for n in names}
    for wanted in spec.save_modules:
        if wanted not in names and wanted not in lasts:
            raise UsageError(f"--save-module {wanted!r} names no module of the model",
                             hint=f"give a module's full name or its last part, e.g. {sorted(lasts)[0]!r}")


def _matches(regexes: tuple[str, ...], name: str) -> bool:
    return any(re.search(r, name) for r in regexes)


def _extracted(spec: ExtractSpec, name: str) -> bool:
    if spec.include_regexes and not _matches(spec.include_regexes, name):
        return False
    return not _matches(spec.exclude_regexes, name)


def _whole(m: _Module) -> list[tuple[str, str]]:
    out = [(f"base_model.model.{m.name}.weight", m.weight)]
    if m.bias is not None:
        out.append((f"base_model.model.{m.name}.bias", m.bias))
    return out


def _lora(spec: ExtractSpec, m: _Module, base: ModelInput, truncate: bool) -> LoraModule:
    """The LoRA plan of 2-D module ``m``; refuses a module BASE lacks or holds in another shape."""
    found = base.tensors.get(m.weight)
    if found is None:
        raise ModelInputError(f"tensor {m.weight} of the fine-tuned model is missing from the base model",
                              tensor=m.weight, hint="exclude the module with -e, or check the base model")
    other = tuple(found.entry.shape)
    keep = None
    if other != m.shape:
        if truncate and m.shape[1:] == other[1:] and (m.embedding or m.head):
            keep = min(m.shape[0], other[0])
        else:
            raise ModelInputError(
                f"tensor {m.weight} has shape {list(m.shape)} in the fine-tuned model and {list(other)} in the base",
                tensor=m.weight,
                hint="the models differ in architecture or size; a vocabulary difference is cut by "
                     "--unsafe-truncate-embeddings",
            )
    if m.bias is not None and m.bias not in base.tensors:
        raise ModelInputError(f"tensor {m.bias} of the fine-tuned model is missing from the base model",
                              tensor=m.bias)
    rows = keep if keep is not None else m.shape[0]
    rank = min(spec.max_rank, rows, m.shape[1])
    return LoraModule(m.name, m.weight, m.bias, m.embedding, rank, keep)


def rank_pattern(lora: tuple[LoraModule, ...]) -> tuple[int, Mapping[str, int]]:
    """PEFT's ``r`` (the largest rank) and the modules whose rank differs from it."""
    top = max((m.rank for m in lora), default=0)
    return top, {m.name: m.rank for m in lora if m.rank != top}

"""Load and validate mergekit YAML configs, before any model file is opened.

Everything that can be checked from the YAML alone is checked here: syntax (``yaml.safe_load`` only, so tags
that construct objects are refused), unknown keys, the method name, parameter shapes, dtype names, layer range
forms, model reference syntax, base-model placement. Each problem is a :class:`ConfigError` whose ``yaml_path``
says where it is (``slices[1].sources[0].layer_range``). Checks that need the models' headers live in the planner.
"""

from __future__ import annotations

import copy
import difflib
import functools
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from resumerge.config.modelref import ModelRef, parse_model_ref
from resumerge.config.params import Setting, check_setting
from resumerge.config.yamltext import DuplicateKeyError, UniqueKeyLoader, anchor_holders, decode_config
from resumerge.errors import ConfigError, UsageError

_E = TypeVar("_E")  # what one entry of a config list parses to

TOP_LEVEL_KEYS = frozenset(
    {
        "merge_method",
        "models",
        "slices",
        "modules",
        "base_model",
        "parameters",
        "dtype",
        "out_dtype",
        "tokenizer_source",
        "tokenizer",
        "chat_template",
        "name",
    }
)
# The dtypes a merge computes in or writes: float types only. mergekit 0.1.5 also takes int64 (its dtype_from_name
# serves other uses), which cuts every weight to an integer (|w| < 1 becomes 0) and writes a model that is noise.
FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")
DTYPES = frozenset(FLOAT_DTYPES)
# Keys of a model's config.json: such a file given as CONFIG gets said for what it is.
MODEL_CONFIG_KEYS = ("architectures", "model_type", "hidden_size", "num_hidden_layers")


class UnknownKeyError(ConfigError):
    """A key no mergekit config has: ``key`` at ``yaml_path``, ``where`` saying in what (" in a module")."""

    def __init__(self, key: str, yaml_path: str, *, where: str = "", hint: str | None = None,
                 near: str | None = None) -> None:
        # A misspelling of a key the mapping lacks (merge_methd for merge_method) is named: removing it would not
        # give the config what it meant, so "removing it changes nothing" is said only of other keys.
        what = "mergekit would ignore it" if near else "mergekit would ignore it, so removing it changes nothing"
        super().__init__(f"unknown key {key!r}{where}: {what}", yaml_path=yaml_path,
                         hint=f"did you mean {near!r}?" if near else hint)
        self.key, self.where = key, where


def near_key(key: str, allowed: Collection[str], given: Collection[object] = ()) -> str | None:
    """The allowed key ``key`` is most likely a misspelling of, among those the mapping (keys ``given``) lacks."""
    found = difflib.get_close_matches(key, sorted(a for a in allowed if a not in given), n=1, cutoff=0.8)
    return found[0] if found else None


def unknown_key_error(key: str, yaml_path: str, *, where: str = "", hint: str | None = None,
                      allowed: Collection[str] = (), given: Collection[object] = ()) -> ConfigError:
    """The error for an unknown key. mergekit ignores unknown keys silently; resumerge refuses them (a misspelt
    key would otherwise do nothing), and says that mergekit would ignore it, so that removing it changes nothing —
    true unless the key holds a YAML anchor used elsewhere, which :func:`honest_unknown_key` says instead, or is
    a misspelling of one of the ``allowed`` keys the mapping (keys ``given``) lacks, which is named."""
    return UnknownKeyError(key, yaml_path, where=where, hint=hint, near=near_key(key, allowed, given))


def honest_unknown_key(error: UnknownKeyError, text: str) -> ConfigError:
    """``error`` about the config of YAML ``text``, or where its key holds a YAML anchor the config uses elsewhere
    (:func:`~resumerge.config.yamltext.anchor_holders`) the refusal that says so: removing it would break the
    config."""
    if error.yaml_path not in anchor_holders(text):
        return error
    return ConfigError(
        f"unknown key {error.key!r}{error.where}: mergekit would ignore it, but it holds a YAML anchor the config "
        "uses elsewhere", yaml_path=error.yaml_path,
        hint="move the anchor under a top-level key of its own (x-common:, say), which resumerge ignores as "
             "mergekit does",
    )


@dataclass(frozen=True)
class SourceConfig:
    """One input of a slice (or one entry of ``models:``), with its own parameters."""

    model: ModelRef
    layer_range: tuple[int, int] | None
    parameters: Mapping[str, Setting]
    yaml_path: str


@dataclass(frozen=True)
class SliceConfig:
    """One output slice: sources merged layer by layer, with slice-level parameters and base."""

    sources: tuple[SourceConfig, ...]
    base_model: ModelRef | None
    parameters: Mapping[str, Setting]
    yaml_path: str


@dataclass(frozen=True)
class ModuleConfig:
    """One entry of ``modules:``: a module of a multi-module model merged from its own ``models`` or ``slices``
    (exactly one is set), with module-level parameters (between the slice's and the top level's)."""

    name: str
    models: tuple[SourceConfig, ...] | None
    slices: tuple[SliceConfig, ...] | None
    parameters: Mapping[str, Setting]
    yaml_path: str


@dataclass(frozen=True)
class MergeConfig:
    """A validated mergekit config. ``slices`` is None for the ``models:`` form (and vice versa)."""

    text: str
    merge_method: str
    models: tuple[SourceConfig, ...] | None
    slices: tuple[SliceConfig, ...] | None
    base_model: ModelRef | None
    parameters: Mapping[str, Setting]
    dtype: str | None
    out_dtype: str | None
    tokenizer_source: str | None
    tokenizer: Mapping[str, Any] | None
    chat_template: str | None
    name: str | None = None
    # What the planner tells the user of the config itself (a top-level key ignored as mergekit ignores it).
    warnings: tuple[str, ...] = field(default=())
    # The ``modules:`` form (models and slices are then None).
    modules: tuple[ModuleConfig, ...] | None = None

    def all_models(self) -> tuple[SourceConfig, ...]:
        """The ``models:`` entries, of the top level or of every ``modules:`` entry given that way."""
        return (self.models or ()) + tuple(s for m in self.modules or () for s in m.models or ())

    def all_slices(self) -> tuple[SliceConfig, ...]:
        """The slices, of the top level or of every ``modules:`` entry given that way."""
        return (self.slices or ()) + tuple(sl for m in self.modules or () for sl in m.slices or ())

    def referenced_models(self) -> list[ModelRef]:
        """Every model the config names, deduplicated, in YAML order with the base model first."""
        refs: list[ModelRef] = []
        if self.base_model is not None:
            refs.append(self.base_model)
        for sl in self.all_slices():
            if sl.base_model is not None:
                refs.append(sl.base_model)
        refs.extend(s.model for s in self.all_models())
        refs.extend(s.model for sl in self.all_slices() for s in sl.sources)
        seen: set[str] = set()
        unique = []
        for ref in refs:
            if ref.key not in seen:
                seen.add(ref.key)
                unique.append(ref)
        return unique


def load_config_text(text: str, *, source: str = "config") -> MergeConfig:
    """Parse and validate YAML ``text``; raises :class:`ConfigError` naming the YAML path of the first problem.

    ``text`` must hold one document; a multi-document (mergekit-multi) recipe is read by
    :func:`resumerge.runs.recipes.recipe.load_recipe_text`.
    """
    docs = parse_documents(text, source=source)
    if len(docs) > 1:
        raise ConfigError(
            f"{source} holds {len(docs)} YAML documents (a mergekit-multi recipe)",
            hint="resumerge run, resume and status take recipes as a whole; this command takes one merge config",
        )
    return config_from_document(docs[0], text, source=source)


def parse_documents(text: str, *, source: str = "config") -> list[Any]:
    """The non-empty YAML documents of ``text`` (safe loader only); raises :class:`ConfigError` for bad YAML
    (with line and column), a key given twice in one mapping (naming both lines), or no document at all."""
    try:
        docs = copy.deepcopy(list(_loaded(text)))
    except DuplicateKeyError as exc:
        raise ConfigError(f"{source}: {exc}", hint="keep one of them (YAML would silently use the last)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(
            f"{source} is not valid YAML{where}: {problem}",
            hint="resumerge reads plain YAML only (no !!python tags)",
        ) from None
    if not docs:
        raise ConfigError(f"{source} is empty", hint="give at least merge_method and models or slices")
    return docs


@functools.lru_cache(maxsize=8)
def _loaded(text: str) -> tuple[Any, ...]:
    """The non-empty documents of ``text``, loaded once per process for one text (a run reads its config's text
    five times: which kind of run it is, the check, the plan, the model card; the key is the text itself, so the
    cache cannot go stale). :func:`parse_documents` hands each caller its own deep copy; an error is not cached."""
    return tuple(d for d in yaml.load_all(text, Loader=UniqueKeyLoader) if d is not None)


def config_from_document(doc: Any, text: str, *, source: str = "config") -> MergeConfig:
    """Validate one parsed YAML document ``doc`` whose YAML text is ``text``; raises :class:`ConfigError`."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{source} must be a YAML mapping, got {type(doc).__name__}")
    return _parse(doc, text)


def _parse(doc: dict[str, Any], text: str) -> MergeConfig:
    model_keys = [k for k in MODEL_CONFIG_KEYS if k in doc]
    if model_keys and "merge_method" not in doc:
        raise ConfigError(
            f"this looks like a model's config.json (it has {', '.join(repr(k) for k in model_keys)}), "
            "not a merge config",
            hint="CONFIG is a mergekit YAML (merge_method, and models, slices or modules); "
                 "the model's directory goes under models:",
        )
    unknown = sorted(str(k) for k in doc if k not in TOP_LEVEL_KEYS)
    holders = anchor_holders(text) if unknown else frozenset()
    refused = [k for k in unknown if k not in holders]
    if refused:
        raise unknown_key_error(refused[0], refused[0],
                                hint=f"allowed top-level keys: {', '.join(sorted(TOP_LEVEL_KEYS))}",
                                # without merge_method, a mergekit-moe config whose experts: is misspelt
                                allowed=TOP_LEVEL_KEYS | ({"experts"} if "merge_method" not in doc else set()),
                                given=doc)
    # A top-level key holding YAML anchors the config uses (x-common: &defaults …) is ignored, as mergekit ignores
    # every unknown key: it cannot be a misspelt setting, and removing it would break the config.
    warnings = tuple(f"{k}: ignored, as mergekit ignores it (it holds YAML anchors the config uses)" for k in unknown)
    try:
        return _parse_settings(doc, text, warnings)
    except UnknownKeyError as exc:
        raise honest_unknown_key(exc, text) from None


def _parse_settings(doc: dict[str, Any], text: str, warnings: tuple[str, ...]) -> MergeConfig:
    method = doc.get("merge_method")
    if not isinstance(method, str) or not method:
        raise ConfigError("merge_method is required and must be a string", yaml_path="merge_method")
    forms = [k for k in ("models", "slices", "modules") if doc.get(k) is not None]
    if len(forms) != 1:
        raise ConfigError(
            "Exactly one of 'models', 'slices', or 'modules' must be present",
            yaml_path=forms[1] if len(forms) > 1 else "models",
        )
    if doc.get("tokenizer_source") is not None and doc.get("tokenizer") is not None:
        raise ConfigError("Cannot specify both tokenizer_source and tokenizer", yaml_path="tokenizer")
    base = _model(doc["base_model"], "base_model") if doc.get("base_model") is not None else None
    models = slices = modules = None
    if forms[0] == "models":
        models = _models(doc["models"])
    elif forms[0] == "slices":
        slices = _slices(doc["slices"])
    else:
        modules = _modules(doc["modules"])
    return MergeConfig(
        text=text,
        merge_method=method,
        models=models,
        slices=slices,
        base_model=base,
        parameters=_parameters(doc.get("parameters"), "parameters"),
        dtype=_dtype(doc.get("dtype"), "dtype"),
        out_dtype=_dtype(doc.get("out_dtype"), "out_dtype"),
        tokenizer_source=_tokenizer_source(doc.get("tokenizer_source")),
        tokenizer=_tokenizer_section(doc.get("tokenizer")),
        chat_template=_optional_str(doc.get("chat_template"), "chat_template"),
        name=_optional_str(doc.get("name"), "name"),
        warnings=warnings,
        modules=modules,
    )


def _model(value: Any, path: str) -> ModelRef:
    if isinstance(value, str):
        try:
            return parse_model_ref(value)
        except ValueError as exc:
            raise ConfigError(str(exc), yaml_path=path) from None
    if isinstance(value, dict):
        allowed = {"model", "lora", "override_architecture"}
        extra = sorted(set(value) - allowed)
        if extra:
            raise unknown_key_error(extra[0], f"{path}.{extra[0]}", where=" in model reference", allowed=allowed,
                                    given=value)
        inner = _model_path(value.get("model"), f"{path}.model")
        lora = _model_path(value["lora"], f"{path}.lora") if value.get("lora") is not None else None
        arch = _optional_str(value.get("override_architecture"), f"{path}.override_architecture")
        return ModelRef(inner.path, inner.revision, lora=lora, override_architecture=arch)
    raise ConfigError("a model must be a string or a mapping with 'model'", yaml_path=path)


def _model_path(value: Any, path: str) -> ModelRef:
    if isinstance(value, str):
        return _model(value, path)
    if isinstance(value, dict) and isinstance(value.get("path"), str):
        rev = _optional_str(value.get("revision"), f"{path}.revision")
        return ModelRef(value["path"], rev)
    raise ConfigError("expected a path string or {path, revision}", yaml_path=path)


def _modules(value: Any) -> tuple[ModuleConfig, ...]:
    # Unlike mergekit (which ignores them), an unknown key inside a module is an error: a merge_method or
    # base_model written there would otherwise silently do nothing.
    if not isinstance(value, dict) or not value:
        raise ConfigError("modules must be a non-empty mapping of module name to module", yaml_path="modules")
    out = []
    for name, item in value.items():
        path = f"modules.{name}"
        if not isinstance(item, dict):
            raise ConfigError("a module must be a mapping with 'models' or 'slices'", yaml_path=path)
        extra = sorted(str(k) for k in set(item) - {"models", "slices", "parameters"})
        if extra:
            raise unknown_key_error(extra[0], f"{path}.{extra[0]}", where=" in a module",
                                    hint="a module takes models or slices, and parameters; merge_method, base_model "
                                         "and dtype are set at the top level",
                                    allowed=("models", "slices", "parameters"), given=item)
        if (item.get("models") is None) == (item.get("slices") is None):
            raise ConfigError("Must specify either output slices or models to merge", yaml_path=path,
                              hint="give the module exactly one of models: or slices:")
        models = _models(item["models"], f"{path}.models") if item.get("models") is not None else None
        slices = _slices(item["slices"], f"{path}.slices") if item.get("slices") is not None else None
        out.append(ModuleConfig(str(name), models, slices, _parameters(item.get("parameters"), f"{path}.parameters"),
                                path))
    return tuple(out)


def _listed(value: Any, where: str, what: str, entry: Callable[[Any, str], _E]) -> tuple[_E, ...]:
    """The entries of the list ``what`` at ``where``, each parsed by ``entry`` at its own path (``where[i]``);
    anything but a non-empty list is refused."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{what} must be a non-empty list", yaml_path=where)
    return tuple(entry(item, f"{where}[{i}]") for i, item in enumerate(value))


def _models(value: Any, where: str = "models") -> tuple[SourceConfig, ...]:
    return _listed(value, where, "models", _listed_model)


def _listed_model(item: Any, path: str) -> SourceConfig:
    if isinstance(item, str):
        item = {"model": item}
    if not isinstance(item, dict) or "model" not in item:
        raise ConfigError("each entry needs a 'model'", yaml_path=path)
    extra = sorted(set(item) - {"model", "parameters"})
    if extra:
        raise unknown_key_error(extra[0], f"{path}.{extra[0]}", allowed=("model", "parameters"), given=item)
    return SourceConfig(model=_model(item["model"], f"{path}.model"), layer_range=None,
                        parameters=_parameters(item.get("parameters"), f"{path}.parameters"), yaml_path=path)


def _slices(value: Any, where: str = "slices") -> tuple[SliceConfig, ...]:
    return _listed(value, where, "slices", _slice)


def _slice(item: Any, path: str) -> SliceConfig:
    if not isinstance(item, dict):
        raise ConfigError("each slice must be a mapping with 'sources'", yaml_path=path)
    allowed = ("sources", "base_model", "parameters", "residual_weight")
    extra = sorted(set(item) - set(allowed))
    if extra:
        raise unknown_key_error(extra[0], f"{path}.{extra[0]}", allowed=allowed, given=item)
    sources = item.get("sources")
    if not isinstance(sources, list) or not sources:
        raise ConfigError("a slice needs a non-empty 'sources' list", yaml_path=f"{path}.sources")
    parsed = tuple(_source(s, f"{path}.sources[{j}]") for j, s in enumerate(sources))
    base = _model(item["base_model"], f"{path}.base_model") if item.get("base_model") is not None else None
    return SliceConfig(parsed, base, _parameters(item.get("parameters"), f"{path}.parameters"), path)


def _source(item: Any, path: str) -> SourceConfig:
    if not isinstance(item, dict) or "model" not in item:
        raise ConfigError("each source needs 'model' and 'layer_range'", yaml_path=path)
    extra = sorted(set(item) - {"model", "layer_range", "parameters"})
    if extra:
        raise unknown_key_error(extra[0], f"{path}.{extra[0]}", allowed=("model", "layer_range", "parameters"),
                                given=item)
    lr = item.get("layer_range")
    if (
        not isinstance(lr, list)
        or len(lr) != 2
        or not all(type(x) is int for x in lr)
        or lr[0] < 0
        or lr[1] < lr[0]
    ):
        raise ConfigError(
            f"layer_range must be [start, end] with 0 <= start <= end (end exclusive), got {lr!r}",
            yaml_path=f"{path}.layer_range",
        )
    return SourceConfig(
        model=_model(item["model"], f"{path}.model"),
        layer_range=(lr[0], lr[1]),
        parameters=_parameters(item.get("parameters"), f"{path}.parameters"),
        yaml_path=path,
    )


def _parameters(value: Any, path: str) -> Mapping[str, Setting]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError("parameters must be a mapping of name to value", yaml_path=path)
    out: dict[str, Setting] = {}
    for name, setting in value.items():
        where = f"{path}.{name}"
        if not isinstance(name, str):
            raise ConfigError("parameter names must be strings", yaml_path=where)
        problem = check_setting(setting)
        if problem:
            raise ConfigError(problem, yaml_path=where)
        out[name] = setting
    return out


def _dtype(value: Any, path: str) -> str | None:
    if value is None:
        return None
    return check_dtype(str(value).removeprefix("torch."), path)


def check_dtype(name: str, yaml_path: str, *, unknown: str = "Unimplemented dtype") -> str:
    """``name`` if it is one of :data:`FLOAT_DTYPES`; else a :class:`ConfigError` listing them, which says so
    when ``name`` is an integer or bool type (a merge in one cuts every weight to an integer) and else begins
    with ``unknown`` (mergekit's words for a merge config)."""
    if name in DTYPES:
        return name
    integer = name.startswith(("int", "uint", "bool", "long", "short"))
    problem = (f"{name!r} is not a float type: merging in it cuts every weight to an integer" if integer
               else f"{unknown} {name!r}")
    raise ConfigError(problem, yaml_path=yaml_path, hint=f"use one of {', '.join(FLOAT_DTYPES)}")


def _optional_str(value: Any, path: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"expected a string, got {type(value).__name__}", yaml_path=path)
    return value


def _tokenizer_source(value: Any) -> str | None:
    text = _optional_str(value, "tokenizer_source")
    if text is not None and text != "base":
        try:
            parse_model_ref(text)
        except ValueError as exc:
            raise ConfigError(str(exc), yaml_path="tokenizer_source") from None
    return text


def _tokenizer_section(value: Any) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError("tokenizer must be a mapping", yaml_path="tokenizer")
    extra = sorted(set(value) - {"source", "tokens", "pad_to_multiple_of"})
    if extra:
        raise unknown_key_error(extra[0], f"tokenizer.{extra[0]}", allowed=("source", "tokens", "pad_to_multiple_of"),
                                given=value)
    pad = value.get("pad_to_multiple_of")
    if pad is not None and (type(pad) is not int or pad <= 0):
        raise ConfigError("pad_to_multiple_of must be a positive integer", yaml_path="tokenizer.pad_to_multiple_of")
    return dict(value)


def read_config_file(path: str | os.PathLike[str]) -> str:
    """The text of the config file at ``path`` (UTF-8, or UTF-16/32 with a byte-order mark); raises
    :class:`UsageError` when it cannot be read or decoded. Here, not with the engine: ``run`` reads the config
    before anything imports torch, so a mergekit-moe config's prompt pass starts its process about a second and a
    half sooner."""
    try:
        return decode_config(Path(path).read_bytes())
    except FileNotFoundError:
        raise UsageError(f"config file {path} not found") from None
    except IsADirectoryError:  # most often a model's folder given as CONFIG
        raise UsageError(f"config file {path} is a directory, not a YAML file",
                         hint="CONFIG is a mergekit YAML file (merge_method, and models, slices or modules); a "
                              "model's folder goes under models: in it") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"config file {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                         f"{exc.start})", hint="save it as UTF-8 (or UTF-16 with its byte-order mark)") from None
    except OSError as exc:
        raise UsageError(f"cannot read config file {path}: {exc}") from None

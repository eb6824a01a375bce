"""The token sequences a pass runs (``check``'s prompts, ``measure``'s texts): built-in texts (a short chat, code,
maths, several languages), in the model's chat template where its tokenizer has one, or the user's file (one text
per line, tokenized as the tokenizer does by default, no template); the one tokenizer loader
(:func:`tokenizer_at`) and the context rule (:func:`bounded`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.config.yamltext import decode_config
from resumerge.errors import UsageError

# (user turn, assistant turn): short, so that a check of a large model stays a few thousand tokens.
BUILT_IN: tuple[tuple[str, str], ...] = (
    ("What is the capital of France?", "The capital of France is Paris, which is also its largest city."),
    ("Write a Python function that returns the square of a number.",
     "def square(x):\n    return x * x\n\nprint(square(4))  # 16"),
    ("What is 12 times 7, and what is its square root?",
     "12 times 7 is 84. The square root of 84 is about 9.17, because 9.17 * 9.17 is close to 84."),
    ("Translate 'good morning, my friend' into French, Spanish and German.",
     "French: bonjour, mon ami. Spanish: buenos días, mi amigo. German: guten Morgen, mein Freund."),
)


BUILT_IN_TEXT = "built-in text"
_NO_LIMIT = 1 << 62  # transformers' own "no limit" is about 1e30; any length a text has is below this


def tokenizer_at(transformers: Any, directory: Path) -> Any:
    """The tokenizer of the model folder ``directory``, as ``transformers`` (the module) loads it: the one loader
    of every pass's tokenizer (``check``'s, ``measure``'s, the MoE gates'); raises what transformers raises."""
    return transformers.AutoTokenizer.from_pretrained(str(directory), **_named_class_config(transformers, directory))


def _named_class_config(transformers: Any, directory: Path) -> dict[str, Any]:
    """``{"config": ...}``, the folder's config.json read as transformers' plain config class, where its
    tokenizer_config.json names the tokenizer's class and neither file maps to code of the repository's own
    (``auto_map``); else {} (AutoTokenizer reads the config itself). AutoTokenizer reads the model's config for
    its ``model_type`` and name, which the plain class keeps; its own model-specific config class would import that
    family's modeling stack (transformers 5: torch.distributed.tensor and sympy among it, about 1 CPU s of a
    search's tokenizer), and the class it looks up by that config's type is only asked for where the tokenizer's
    config names none."""
    from resumerge.forward.text.plaintok import json_object

    tokenizer = json_object(directory / "tokenizer_config.json") or {}
    config = json_object(directory / "config.json") or {}
    if not tokenizer.get("tokenizer_class") or "auto_map" in tokenizer or "auto_map" in config \
            or not config.get("model_type"):
        return {}
    import logging

    plain = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
    # It says (a warning) that the plain class is not the model's own, which is what is meant here.
    said = logging.getLogger(plain.__module__)
    level = said.level
    said.setLevel(logging.ERROR)
    try:
        return {"config": plain.from_pretrained(str(directory))}
    finally:
        said.setLevel(level)


def load_tokenizer(directories: Sequence[Path], *, what: str = "resumerge check", plain: bool = False) -> Any:
    """The first of ``directories`` (the merge's, then its base's and parents') that holds a tokenizer; ``what``
    names the command in the error of a missing transformers. ``plain``: read without transformers where it would
    load the same tokenizer (:mod:`.plaintok`; a caller that only encodes texts and renders the chat template)."""
    from resumerge.forward.engine.requires import Needs, require_transformers

    transformers = None
    for directory in directories:
        if (directory / "tokenizer_config.json").is_file() or (directory / "tokenizer.json").is_file():
            if plain:
                from resumerge.forward.text.plaintok import plain_tokenizer

                found = plain_tokenizer(directory)
                if found is not None:  # its ids are transformers'; it knows no length limit to warn of
                    return found
            transformers = transformers or require_transformers(Needs(what))
            try:
                tokenizer = tokenizer_at(transformers, directory)
            except (OSError, ValueError):
                continue
            # The texts' length against the context is :func:`bounded`'s to judge, in one line naming the text:
            # the tokenizer's own warning ("... will result in indexing errors") would only come before it.
            tokenizer.model_max_length = _NO_LIMIT
            return tokenizer
    if transformers is None:  # as before: a missing transformers is said first
        require_transformers(Needs(what))
    raise UsageError("none of the checked models has a tokenizer to read the prompts with"
                     + "".join(f" ({reason})" for reason in _gguf_reasons(directories)),
                     hint="copy the tokenizer files into MODEL's folder")


def _gguf_reasons(directories: Sequence[Path]) -> list[str]:
    """Why a GGUF model's folder (its files rebuilt from its metadata) has no tokenizer, for each that has none."""
    from resumerge.inputs.gguf.folder import tokenizer_error

    return [reason for reason in map(tokenizer_error, directories) if reason]


@dataclass(frozen=True)
class Text:
    """One token sequence and where its text is, as a refusal names it (``line 3 of --prompts FILE``)."""

    ids: list[int]
    where: str


@dataclass(frozen=True)
class Context:
    """The longest sequence the models take (``limit`` tokens; the config key that says so, the model that
    says least) and whether a longer text is cut to it (``cut``) rather than refused."""

    limit: int
    key: str
    model: str
    cut: bool = False


def sequences(tokenizer: Any, prompts_file: Path | None, context: Context | None = None, *,
              option: str = "--prompts") -> list[list[int]]:
    """The token ids of each sequence, at least two tokens each, each within ``context`` (:func:`named`)."""
    return [text.ids for text in named(tokenizer, prompts_file, context, option=option)]


def named(tokenizer: Any, prompts_file: Path | None, context: Context | None = None, *,
          option: str = "--prompts", chat: bool = True) -> list[Text]:
    """The token ids of each sequence, at least two tokens each, and where each text is; each within the models'
    ``context`` (:func:`bounded`). ``option``: how the command names the file (``--prompts``, ``--texts``).
    ``chat``: the built-in texts in the tokenizer's chat template where it has one; False: as plain text (models
    of different tokenizers: a template's special tokens are one family's)."""
    if prompts_file is not None:
        lines = [(n, line) for n, line in enumerate(read_texts(prompts_file, option).splitlines(), 1)
                 if line.strip()]
        if not lines:
            raise UsageError(f"{option} {prompts_file} holds no text", hint="one text per line")
        found = [Text(list(tokenizer(line)["input_ids"]), f"line {n} of {option} {prompts_file}")
                 for n, line in lines]
    else:
        found = [Text(_chat(tokenizer, user, answer, chat), f"{BUILT_IN_TEXT} {n}")
                 for n, (user, answer) in enumerate(BUILT_IN, 1)]
    found = [text for text in found if len(text.ids) >= 2]
    if not found:
        raise UsageError("every prompt is shorter than two tokens: there is nothing to predict")
    return bounded(found, context, option)


def bounded(texts: list[Text], context: Context | None, option: str = "--prompts") -> list[Text]:
    """``texts`` within the models' ``context``: the one rule of ``check`` and ``measure`` (before any layer runs).
    A text longer than the limit is refused (exit 2), naming its line and the limit, or cut to its first
    ``limit`` tokens where ``context.cut``: a model given more positions than it was made for computes figures
    that say nothing of it, and the time and memory of attention grow with the square of a text's length (a
    1 MB line held one layer's attention for minutes, past Ctrl-C). The built-in texts, which no one can shorten,
    are cut (they are a few dozen tokens; only a toy model's context is shorter)."""
    if context is None:
        return texts
    over = [t for t in texts if len(t.ids) > context.limit]
    if not over:
        return texts
    if context.cut or over[0].where.startswith(BUILT_IN_TEXT):  # the built-in texts: no one to shorten them
        return [Text(t.ids[:context.limit], t.where) for t in texts]
    first = over[0]
    raise UsageError(f"{first.where} is {len(first.ids):,} tokens, past the {context.limit:,} of {context.model}'s "
                     f"context ({context.key})" + (f", as are {len(over) - 1} more" if len(over) > 1 else ""),
                     hint=f"shorten the texts in {option}, or rerun with --truncate-texts to cut each to its first "
                          f"{context.limit:,} tokens")


# The config keys that say how many positions a family's model takes, in the order they are looked for.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def context_of(configs: Sequence[tuple[str, Mapping[str, Any]]], cut: bool = False) -> Context | None:
    """The context the models of ``configs`` ((name, config.json) each) all take: the least any says (of its own
    or its text model's config), None where none says."""
    found = []
    for name, config in configs:
        for doc in (config, config.get("text_config") or {}):
            key = next((k for k in CONTEXT_KEYS if isinstance(doc, dict) and isinstance(doc.get(k), int)
                        and doc[k] > 0), None)
            if key is not None:
                found.append(Context(int(doc[key]), key, name, cut))
                break
    return min(found, key=lambda c: c.limit) if found else None


def read_texts(path: Path, option: str) -> str:
    """The text of the texts file ``path`` (the flag ``option`` gave it), decoded as a config is: UTF-16/32 by its
    byte-order mark (what Windows editors and PowerShell's ``>`` write), else UTF-8, a UTF-8 byte-order mark
    dropped (it would start the first text)."""
    try:
        return decode_config(path.read_bytes()).removeprefix("\ufeff")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {option} {path}: {exc}",
                         hint="save it as UTF-8 (or UTF-16 with its byte-order mark)"
                         if isinstance(exc, UnicodeDecodeError) else None) from None


def describe(prompts_file: Path | None) -> str:
    """The prompts a check ran, as its report and the model card name them: the built-in texts, or the file's
    name and the sha256 of its bytes (the same texts give the same line wherever the file is)."""
    if prompts_file is None:
        return (f"built-in ({len(BUILT_IN)} texts: a short chat, code, maths and several languages, in the chat "
                "template where the tokenizer has one)")
    import hashlib

    try:
        digest = hashlib.sha256(prompts_file.read_bytes()).hexdigest()
    except OSError as exc:
        raise UsageError(f"cannot read --prompts {prompts_file}: {exc}") from None
    return f"{prompts_file.name} (sha256 {digest})"


def _chat(tokenizer: Any, user: str, answer: str, chat: bool = True) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user},
                                              {"role": "assistant", "content": answer}], tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(f"{user}\n{answer}")["input_ids"])

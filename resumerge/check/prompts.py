"""The token sequences a check runs: built-in texts (a short chat, code, maths, several languages), in the
model's chat template where its tokenizer has one, or the user's file (one text per line, tokenized as the
tokenizer does by default, no template)."""

from __future__ import annotations

from collections.abc import Sequence
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


def load_tokenizer(directories: Sequence[Path], *, what: str = "resumerge check") -> Any:
    """The first of ``directories`` (the merge's, then its base's and parents') that holds a tokenizer; ``what``
    names the command in the error of a missing transformers."""
    from resumerge.forward.stream import import_transformers

    transformers = import_transformers(what)

    for directory in directories:
        if (directory / "tokenizer_config.json").is_file() or (directory / "tokenizer.json").is_file():
            try:
                return transformers.AutoTokenizer.from_pretrained(str(directory))
            except (OSError, ValueError):
                continue
    raise UsageError("none of the checked models has a tokenizer to read the prompts with"
                     + "".join(f" ({reason})" for reason in _gguf_reasons(directories)),
                     hint="copy the tokenizer files into MODEL's folder")


def _gguf_reasons(directories: Sequence[Path]) -> list[str]:
    """Why a GGUF model's folder (its files rebuilt from its metadata) has no tokenizer, for each that has none."""
    from resumerge.inputs.gguf.folder import tokenizer_error

    return [reason for reason in map(tokenizer_error, directories) if reason]


def sequences(tokenizer: Any, prompts_file: Path | None, *, option: str = "--prompts") -> list[list[int]]:
    """The token ids of each sequence, at least two tokens each; ``option`` names the file's flag in errors
    (``measure`` calls it ``--texts``)."""
    if prompts_file is not None:
        lines = [line for line in read_texts(prompts_file, option).splitlines() if line.strip()]
        if not lines:
            raise UsageError(f"{option} {prompts_file} holds no text", hint="one text per line")
        found = [list(tokenizer(line)["input_ids"]) for line in lines]
    else:
        found = [_chat(tokenizer, user, answer) for user, answer in BUILT_IN]
    found = [ids for ids in found if len(ids) >= 2]
    if not found:
        raise UsageError("every prompt is shorter than two tokens: there is nothing to predict")
    return found


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


def _chat(tokenizer: Any, user: str, answer: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user},
                                              {"role": "assistant", "content": answer}], tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(f"{user}\n{answer}")["input_ids"])

"""The model's tokenizer for an evaluation without a chat template, read without transformers where transformers
would give the same tokens and texts: the ``tokenizers`` library over tokenizer.json
(:func:`~resumerge.forward.text.plaintok.plain_tokenizer`, the check's reader, and its rules), with what lm-eval and
:class:`~.lm.ResumergeLM` ask of a tokenizer besides (decoding, the named special tokens and their ids, its name and
length limit). transformers' import and ``AutoTokenizer`` cost an evaluation's process about 2 CPU s; lm-eval
itself never imports transformers.

Where :func:`eval_tokenizer` answers None (a tokenizer the check's reader leaves to transformers, or one whose
decoding transformers rewrites: ``clean_up_tokenization_spaces``), and wherever a chat template is applied (its
rendering is transformers', with lm-eval's arguments), the evaluation loads transformers' ``AutoTokenizer``, as
lm-eval's ``hf`` model does.

May import: forward (plaintok).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from resumerge.forward.text.plaintok import PlainTokenizer, json_object, plain_tokenizer

# transformers' length limit of a tokenizer whose config names none (its VERY_LARGE_INTEGER)
NO_LIMIT = int(1e30)


class EvalTokenizer:
    """A tokenizer.json's tokenizer as an evaluation calls transformers' (``encode``, ``decode``, ``bos_token`` /
    ``eos_token`` / ``pad_token`` and their ids, ``name_or_path``, ``model_max_length``)."""

    def __init__(self, plain: PlainTokenizer, name_or_path: str, model_max_length: int) -> None:
        self._backend = plain.backend
        self._specials = plain.specials
        self.name_or_path = name_or_path
        self.model_max_length = model_max_length

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s ids, the post-processor's special tokens added unless ``add_special_tokens`` is False."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (one id, or several), special tokens left out with ``skip_special_tokens``."""
        return str(self._backend.decode([ids] if isinstance(ids, int) else list(ids),
                                        skip_special_tokens=skip_special_tokens))

    def _id(self, name: str) -> int | None:
        token = self._specials.get(name)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self._specials.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._specials.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self._specials.get("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")


def eval_tokenizer(directory: Path) -> EvalTokenizer | None:
    """The tokenizer of the model folder ``directory`` without transformers, where transformers' ``AutoTokenizer``
    gives the same ids, texts and special tokens (see the module); None where it might not."""
    config = json_object(directory / "tokenizer_config.json")
    if config is None or config.get("clean_up_tokenization_spaces"):
        return None
    limit = config.get("model_max_length", NO_LIMIT)
    if isinstance(limit, bool) or not isinstance(limit, int):  # a float (1e30 written as such): transformers'
        return None
    plain = plain_tokenizer(directory)
    if plain is None:
        return None
    return EvalTokenizer(plain, str(directory), limit)

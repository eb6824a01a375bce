"""What the output's tokenizer adds around a text: what MODEL's adds (the BOS it was trained to see, an EOS where it
adds one), each as DONOR's token that holds MODEL's row, whatever DONOR's own tokenizer adds.

A transplant copies MODEL's weights, and MODEL reads every text after the tokens its tokenizer adds: Gemma-3-270M
given SmolLM2's tokenizer (which adds none) read texts without its ``<bos>`` and wrote "The The The…" (issue 97).
MODEL's added tokens are found by what its tokenizer does (a text encoded with and without its special tokens),
and each is given DONOR's token of the same special role (MODEL's ``<bos>`` is DONOR's ``<|im_start|>`` when both
are ``bos_token``, the rule of the match), else DONOR's token whose row is MODEL's row of it. Where that differs
from what DONOR's tokenizer adds, the output's tokenizer files say it: tokenizer.json's post-processor (DONOR's
own kept ahead of it where it is not a template), tokenizer_config.json's ``add_bos_token`` / ``add_eos_token`` and
the tokens they name (transformers rebuilds the post-processor from those), special_tokens_map.json, config.json's
``bos_token_id``; a GGUF output's ``tokenizer.ggml.add_bos_token`` and ``bos_token_id`` (:meth:`Adds.gguf_keys`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from resumerge.runs.transplant.tokens import MatrixMatch, Vocabulary

# A text every tokenizer cuts into some tokens of its own: what is added around it is what the tokenizer adds.
_PROBE = "Hello world"
# A token added by MODEL's tokenizer: (its string in DONOR, DONOR's id); None where DONOR holds no such token.
Token = tuple[str, int]


@dataclass(frozen=True)
class Adds:
    """The tokens a tokenizer adds before (``prefix``) and after (``suffix``) a text, as (token, id) each;
    ``lacking``: MODEL's added tokens DONOR has no token for (the output cannot add them)."""

    prefix: tuple[Token, ...] = ()
    suffix: tuple[Token, ...] = ()
    lacking: tuple[str, ...] = ()

    @property
    def bos(self) -> Token | None:
        """The one token added before a text (a BOS), None where none or several are."""
        return self.prefix[0] if len(self.prefix) == 1 else None

    @property
    def eos(self) -> Token | None:
        return self.suffix[0] if len(self.suffix) == 1 else None

    def same(self, other: Adds) -> bool:
        return (self.prefix, self.suffix) == (other.prefix, other.suffix)

    def gguf_keys(self) -> dict[str, bool | int]:
        """The GGUF tokenizer keys that say it: whether a BOS and an EOS are added, and which."""
        keys: dict[str, bool | int] = {"tokenizer.ggml.add_bos_token": self.bos is not None,
                                       "tokenizer.ggml.add_eos_token": self.eos is not None}
        if self.bos is not None:
            keys["tokenizer.ggml.bos_token_id"] = self.bos[1]
        if self.eos is not None:
            keys["tokenizer.ggml.eos_token_id"] = self.eos[1]
        return keys


@dataclass(frozen=True)
class OutputAdds:
    """What the output's tokenizer adds (``wanted``: MODEL's, in DONOR's tokens) against what DONOR's does
    (``donor``); ``model``: MODEL's tokens as its own tokenizer names them (the card's words)."""

    wanted: Adds
    donor: Adds
    model: Adds

    @property
    def changed(self) -> bool:
        """Whether the output's tokenizer must add otherwise than DONOR's (its files are then rewritten)."""
        return not self.wanted.same(self.donor)

    def note(self) -> str | None:
        """The card's, the log's and ``status``'s line on it, None where DONOR's tokenizer already adds MODEL's."""
        if not self.changed and not self.wanted.lacking:
            return None
        theirs = _words(self.donor)
        if self.wanted.lacking:
            lacks = ", ".join(repr(t) for t in self.wanted.lacking)
            return (f"MODEL's tokenizer adds {lacks}, which DONOR's vocabulary has no token for: the output's "
                    f"tokenizer adds {_words(self.wanted)} (DONOR's adds {theirs}); prepend MODEL's token's "
                    "counterpart by hand")
        return (f"the output's tokenizer adds {_words(self.wanted)}, the tokens MODEL's tokenizer adds "
                f"({_words(self.model)}) as DONOR's tokens of MODEL's rows; DONOR's own adds {theirs}")


def _words(adds: Adds) -> str:
    parts = [f"{token!r} (id {i}) before a text" for token, i in adds.prefix]
    parts += [f"{token!r} (id {i}) after it" for token, i in adds.suffix]
    return ", ".join(parts) if parts else "nothing"


def added_by(vocabulary: Vocabulary) -> Adds:
    """What ``vocabulary``'s tokenizer adds around a text, as its own (token, id)."""
    tokenizer = vocabulary.tokenizer
    whole = list(tokenizer(_PROBE)["input_ids"])
    body = list(tokenizer(_PROBE, add_special_tokens=False)["input_ids"])
    at = next((i for i in range(len(whole) - len(body) + 1) if whole[i:i + len(body)] == body), None)
    if at is None:  # the text is cut otherwise with special tokens: nothing is said of what is added
        return Adds()
    strings = vocabulary.spelled.strings

    def named(ids: list[int]) -> tuple[Token, ...]:
        return tuple((strings.get(i, str(i)), i) for i in ids)

    return Adds(named(whole[:at]), named(whole[at + len(body):]))


def output_adds(model: Vocabulary, donor: Vocabulary, embed: MatrixMatch) -> OutputAdds:
    """What the output's tokenizer must add: MODEL's added tokens, each as DONOR's token of the same normalized
    form (a special role: the match's rule), else DONOR's token whose embedding row is MODEL's row of it."""
    mine, theirs = added_by(model), added_by(donor)
    added = {i for _, i in (*mine.prefix, *mine.suffix)}
    by_id = {i: t for t, i in model.ids.items() if i in added} if added else {}
    copied: dict[int, int] = {}
    for donor_id, row in embed.copies:
        copied.setdefault(row, donor_id)
    lacking: list[str] = []

    def counterpart(tokens: tuple[Token, ...]) -> tuple[Token, ...]:
        found = []
        for token, i in tokens:
            normal = by_id.get(i)
            j = donor.ids.get(normal) if normal is not None else None
            if j is None or j >= embed.rows:
                j = copied.get(i)
            if j is None:
                lacking.append(token)
            else:
                found.append((donor.spelled.strings.get(j, token), j))
        return tuple(found)

    wanted = Adds(counterpart(mine.prefix), counterpart(mine.suffix))
    return OutputAdds(Adds(wanted.prefix, wanted.suffix, tuple(lacking)), theirs, mine)


def rewritten(files: Mapping[str, bytes], adds: Adds) -> dict[str, bytes]:
    """DONOR's tokenizer ``files`` (name -> bytes) adding ``adds`` around every text: tokenizer.json's
    post-processor, tokenizer_config.json's ``add_bos_token``/``add_eos_token`` with the tokens they name, and
    special_tokens_map.json's bos and eos; every other file as it is."""
    out = dict(files)
    if "tokenizer.json" in files:
        doc = json.loads(files["tokenizer.json"])
        doc["post_processor"] = _processor(doc.get("post_processor"), adds)
        out["tokenizer.json"] = _dumped(doc)
    named = {"bos_token": adds.bos, "eos_token": adds.eos}
    if "tokenizer_config.json" in files:
        config = json.loads(files["tokenizer_config.json"])
        config["add_bos_token"] = adds.bos is not None
        config["add_eos_token"] = adds.eos is not None
        config.update({role: token[0] for role, token in named.items() if token is not None})
        out["tokenizer_config.json"] = _dumped(config)
    if "special_tokens_map.json" in files:
        specials = json.loads(files["special_tokens_map.json"])
        for role, token in named.items():
            if token is not None:
                specials[role] = _as_entry(specials.get(role), token[0])
        out["special_tokens_map.json"] = _dumped(specials)
    return out


def out_config_ids(config: Mapping[str, Any], adds: Adds) -> dict[str, Any]:
    """The output's config.json with the ids of the BOS and EOS its tokenizer adds."""
    out = dict(config)
    if adds.bos is not None:
        out["bos_token_id"] = adds.bos[1]
    return out


def _processor(old: Any, adds: Adds) -> Any:
    """A post-processor adding ``adds`` (a ``TemplateProcessing``), after DONOR's own where that is not a
    template (a ``ByteLevel`` one trims offsets: kept); DONOR's own template is replaced."""
    def part(tokens: tuple[Token, ...], type_id: int) -> list[dict[str, Any]]:
        return [{"SpecialToken": {"id": token, "type_id": type_id}} for token, _ in tokens]

    def sequence(name: str, type_id: int) -> list[dict[str, Any]]:
        return [*part(adds.prefix, type_id), {"Sequence": {"id": name, "type_id": type_id}},
                *part(adds.suffix, type_id)]

    template = {"type": "TemplateProcessing", "single": sequence("A", 0), "pair": sequence("A", 0) +
                sequence("B", 1), "special_tokens": {token: {"id": token, "ids": [i], "tokens": [token]}
                                                     for token, i in (*adds.prefix, *adds.suffix)}}
    kept = [] if old is None else [p for p in (old.get("processors") if old.get("type") == "Sequence" else [old])
                                   if p.get("type") != "TemplateProcessing"]
    return {"type": "Sequence", "processors": [*kept, template]} if kept else template


def _as_entry(old: Any, token: str) -> Any:
    """``token`` written as special_tokens_map.json wrote the role (a string, or an AddedToken's mapping)."""
    if isinstance(old, dict):
        return {**old, "content": token}
    return token


def _dumped(doc: Any) -> bytes:
    return (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode("utf-8")

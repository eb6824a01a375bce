"""What the model's ``generation_config.json`` does to the tokens generated, as transformers' ``generate`` (which
lm-eval's ``hf`` model calls) applies it whether it samples or not: the logits processors it builds from that file,
in its order (``repetition_penalty``, ``no_repeat_ngram_size``, ``min_length``, ``min_new_tokens``,
``suppress_tokens``, ``begin_suppress_tokens``), applied to each step's next-token logits before the argmax or the
draw (:meth:`~.genrequests.Wanted.choose`), and its ``eos_token_id`` (one or several) ending a continuation. One
home for the whole model held and one layer at a time: both choose through it, so they give the same answers.

The end tokens are those ``generate`` stops on (:func:`end_tokens`): the file's ``eos_token_id`` where there is a file
(none where it names none: transformers then stops on nothing of its own), else the ``config.json``'s, as
transformers makes a generation config from the model's config when the file is missing (its top-level
``eos_token_id``, else its decoder's: ``decoder``, ``generator`` or ``text_config``). The tokenizer's end token ends
a continuation besides, always (:class:`~.genrequests.Wanted`'s ``eot``): lm-eval's ``hf`` model puts its text among
the stop sequences of every request.

Any other setting of that file that changes ``generate``'s output (beams, ``bad_words_ids``, ``forced_eos_token_id``,
``max_new_tokens``, ``stop_strings``, a sampling warper such as ``min_p``, ...) is refused in one line naming it and
the file (exit 2), before any weight is read: never ignored. Settings lm-eval's ``hf`` model overrides on every
call (``do_sample``, ``temperature``, ``max_length``, ``pad_token_id``, ``use_cache``) and the ``top_k``/``top_p``
:mod:`.genrequests` reads are not this module's. :meth:`Processors.key` is in a generation's journal key: a changed
file generates anew."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from resumerge.errors import UsageError
from resumerge.machine.torch_import import torch

NAME = "generation_config.json"
# settings that change generate()'s output, each with the values that leave it unchanged (transformers' defaults)
_NOT_HONOURED: Mapping[str, tuple[Any, ...]] = MappingProxyType({
    "num_beams": (None, 1), "num_beam_groups": (None, 1), "penalty_alpha": (None,), "diversity_penalty": (None, 0.0),
    "sequence_bias": (None,), "bad_words_ids": (None,), "force_words_ids": (None,), "constraints": (None,),
    "forced_bos_token_id": (None,), "forced_eos_token_id": (None,), "remove_invalid_values": (None, False),
    "exponential_decay_length_penalty": (None,), "forced_decoder_ids": (None,),
    "encoder_repetition_penalty": (None, 1.0), "encoder_no_repeat_ngram_size": (None, 0),
    "guidance_scale": (None, 1.0), "watermarking_config": (None,), "stop_strings": (None,),
    "num_return_sequences": (None, 1), "dola_layers": (None,), "max_new_tokens": (None,),
    "token_healing": (None, False), "min_p": (None,), "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "top_h": (None,), "renormalize_logits": (None, False), "prompt_lookup_num_tokens": (None,),
})


@dataclass(frozen=True)
class Processors:
    """The model's generation settings resumerge honours (their no-op values where the file sets none): a
    ``repetition_penalty`` on every token of the context and the continuation, no ``no_repeat_ngram_size``-gram
    made twice, the end tokens ``eos`` held back while the sequence is shorter than ``min_length`` or fewer than
    ``min_new_tokens`` are made, ``suppress_tokens`` never and ``begin_suppress_tokens`` not first."""

    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    min_length: int = 0
    min_new_tokens: int = 0
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    eos: tuple[int, ...] = ()

    def __call__(self, logits: torch.Tensor, context: Sequence[int], made: Sequence[int]) -> torch.Tensor:
        """``logits`` (one position's, float32) after every processor, in transformers' order, for the token after
        ``context`` and ``made``; ``logits`` itself where none applies."""
        if self.is_default():
            return logits
        scores = logits.detach().to("cpu", torch.float32).clone()
        seen = [*context, *made]
        if self.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(seen)), dtype=torch.long)
            picked = scores[ids]
            scores[ids] = torch.where(picked < 0, picked * self.repetition_penalty, picked / self.repetition_penalty)
        size = self.no_repeat_ngram_size
        if size > 0 and len(seen) + 1 >= size:
            prefix = tuple(seen[len(seen) + 1 - size:])
            banned = {seen[i + size - 1] for i in range(len(seen) - size + 1) if tuple(seen[i:i + size - 1]) == prefix}
            scores[sorted(banned)] = float("-inf")
        if self.eos and (len(seen) < self.min_length or len(made) < self.min_new_tokens):
            scores[list(self.eos)] = float("-inf")
        if self.suppress_tokens:
            scores[list(self.suppress_tokens)] = float("-inf")
        if self.begin_suppress_tokens and not made:
            scores[list(self.begin_suppress_tokens)] = float("-inf")
        return scores

    def is_default(self) -> bool:
        """Whether no processor changes a token (the end tokens aside)."""
        return replace(self, eos=()) == NONE

    def key(self) -> dict[str, Any]:
        """What a generation's journal key holds of these (nothing where they change no token and name no end
        token: a model without the file keeps the key it had)."""
        return {} if self == NONE else asdict(self)


NONE = Processors()  # a model without the file, or whose file changes no token


def _ids(value: Any) -> tuple[int, ...]:
    """A token id or list of them (as the file gives ``eos_token_id``, ``suppress_tokens``) as a tuple."""
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def processors_of(directory: Any) -> Processors:
    """The processors the model's ``generation_config.json`` in ``directory`` asks for (none where it has no such
    file); :class:`UsageError` (exit 2) naming the first setting there that changes ``generate``'s output and that
    resumerge does not honour."""
    path = Path(directory) / NAME
    if not path.is_file():
        return replace(NONE, eos=end_tokens(directory))
    found = json.loads(path.read_text(encoding="utf-8"))
    for name, unchanged in _NOT_HONOURED.items():
        if name in found and found[name] not in unchanged:
            raise UsageError(f"{path}: {name}={json.dumps(found[name])} changes what transformers' generate answers "
                             "and resumerge does not honour it",
                             hint=f"remove {name} from {NAME} (or set it to its default) to evaluate the generation "
                                  "tasks, or leave them out")
    return replace(over(NONE, found, str(path)), eos=_ids(found.get("eos_token_id")))


def end_tokens(directory: Any) -> tuple[int, ...]:
    """The token ids transformers' ``generate`` ends a continuation on, for the model in ``directory`` (see the
    module): its ``generation_config.json``'s ``eos_token_id``, or where it has no such file its ``config.json``'s
    (the top level's, else the first of its ``decoder``, ``generator``, ``text_config`` that has one); none where
    neither names one."""
    folder = Path(directory)
    if (folder / NAME).is_file():
        return _ids(json.loads((folder / NAME).read_text(encoding="utf-8")).get("eos_token_id"))
    config = folder / "config.json"
    if not config.is_file():
        return ()
    found = json.loads(config.read_text(encoding="utf-8"))
    if found.get("eos_token_id") is None:
        # transformers' from_model_config: a value the top level leaves unset is taken from the decoder's config
        inner: dict[str, Any] = next((found[name] for name in ("decoder", "generator", "text_config")
                                      if isinstance(found.get(name), dict)), {})
        return _ids(inner.get("eos_token_id"))
    return _ids(found.get("eos_token_id"))


def over(processors: Processors, given: Mapping[str, Any], where: str) -> Processors:
    """``processors`` with each honoured setting ``given`` sets (a ``generation_config.json``'s, or a request's
    generation kwargs over the file's, as ``generate(**kwargs)`` takes them) in its place; :class:`UsageError`
    (exit 2) for a ``repetition_penalty`` not above 0, which transformers refuses (``where`` names the source)."""
    changed: dict[str, Any] = {}
    penalty = given.get("repetition_penalty")
    if penalty is not None:
        if not float(penalty) > 0:
            raise UsageError(f"{where}: repetition_penalty={penalty} is not above 0 (transformers refuses it)",
                             hint="give a repetition_penalty above 0 (1 changes nothing)")
        changed["repetition_penalty"] = float(penalty)
    for name in ("no_repeat_ngram_size", "min_length", "min_new_tokens"):
        if given.get(name) is not None:
            changed[name] = int(given[name])
    for name in ("suppress_tokens", "begin_suppress_tokens"):
        if given.get(name) is not None:
            changed[name] = _ids(given[name])
    return replace(processors, **changed)

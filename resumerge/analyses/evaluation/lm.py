"""resumerge as an lm-eval model: :class:`ResumergeLM`, an ``lm_eval.api.model.TemplateLM`` whose requests are
scored by a pass on the forward engine (:mod:`.scorer`), all requests of a call together.

Its tokenisation is lm-eval's own (``TemplateLM.loglikelihood`` and ``_encode_pair``: trailing spaces of the context
moved to the continuation, an empty context replaced by the prefix token) over :meth:`tok_encode`, which encodes as
lm-eval's ``hf`` model does (the tokenizer's own special tokens, none added to a string that starts with the BOS
text); the rolling windows of a perplexity task are lm-eval's (``get_rolling_token_windows``, ``make_disjoint_window``)
and every window of every document is scored in one pass. The chat template is applied as the ``hf`` model applies
it. Generation (``generate_until``) runs only where the caller gives a generator (:mod:`.generate`: the whole model
fits the budget); the evaluation refuses such tasks before any weight is read otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import has_bos_prefix
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from resumerge.analyses.evaluation.requests import Scoring, scoring
from resumerge.errors import UsageError

Answer = tuple[float, bool]
# Scores a pass's requests: the forward engine's scorer, journaled under the state dir (see .run).
Scorer = Callable[[Scoring, str], list[Answer]]
Generator = Callable[[list[tuple[str, dict[str, Any]]]], list[str]]


class ResumergeLM(TemplateLM):  # type: ignore[misc]
    """lm-eval's model interface over resumerge's layer-streamed forward pass.

    ``tokenizer``: the model's (transformers'); ``max_length``: its context, as the ``hf`` model resolves it;
    ``scorer(work, kind)`` scores a pass (``kind``: ``loglikelihood`` or ``loglikelihood_rolling``);
    ``generator``: greedy generation, where the whole model is held (None: generation tasks are refused);
    ``add_bos_token``: as the ``hf`` model's argument (None: the tokenizer's default)."""

    def __init__(self, tokenizer: Any, max_length: int, scorer: Scorer, *, generator: Generator | None = None,
                 add_bos_token: bool | None = None, chat_template_args: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self._max_length = max_length
        self._scorer = scorer
        self._generator = generator
        self.add_bos_token = add_bos_token
        self.chat_template_args = dict(chat_template_args or {})

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        found = self.tokenizer.bos_token_id
        return int(found if found is not None else self.tokenizer.eos_token_id)

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """``string``'s tokens as the ``hf`` model encodes them: ``add_special_tokens`` given wins, else
        ``add_bos_token``, else the tokenizer's default; none added where the string starts with the prefix
        token's text."""
        special: dict[str, bool] = {}
        if add_special_tokens is not None:
            special["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            special["add_special_tokens"] = self.add_bos_token
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        encoding: list[int] = list(self.tokenizer.encode(string, **special))
        return encoding[-left_truncate_len:] if left_truncate_len else encoding

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[Answer]:
        answers = self._scored([(ctx, cont) for _, ctx, cont in requests], "loglikelihood")
        for (request, _, _), answer in zip(requests, answers):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood over lm-eval's disjoint rolling windows of the model's context; every
        window of every document in one pass."""
        windows: list[list[tuple[list[int], list[int]]]] = []
        for (string,) in (r.args for r in requests):
            tokens = self.tok_encode(string)
            windows.append([make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)])
        answers = self._scored([w for doc in windows for w in doc], "loglikelihood_rolling")
        totals, at = [], 0
        for request, doc in zip(requests, windows):
            total = sum(value for value, _ in answers[at:at + len(doc)])
            at += len(doc)
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), total)
        return totals

    def _scored(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], kind: str) -> list[Answer]:
        if not pairs:
            return []
        return self._scorer(scoring(pairs, self.max_length), kind)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        if self._generator is None:  # the evaluation refuses generation tasks before this is reached
            raise UsageError("generation tasks need the whole model held in the memory budget",
                             hint="raise --max-memory, or leave out the generate_until tasks")
        return self._generator([tuple(r.args) for r in requests])

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template applied as the ``hf`` model applies it (the system turn dropped where the template
        refuses one)."""
        import jinja2

        def templated(history: list[dict[str, str]]) -> str:
            return str(self.tokenizer.apply_chat_template(
                history, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt, **self.chat_template_args))

        try:
            return templated(chat_history)
        except jinja2.exceptions.TemplateError:
            return templated([m for m in chat_history if m["role"] != "system"])

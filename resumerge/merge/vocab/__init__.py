"""Tokenizer merge: build an output tokenizer from the inputs' tokenizers and align their vocabulary tensors.

The planner calls :func:`parse_tokenizer_spec` on the config's tokenizer keys, then :func:`build_tokenizer` on the
inputs' tokenizer directories (small JSON files only) and records the :class:`BuiltTokenizer`'s ``digest`` in the
plan. The engine calls :func:`align_rows` on each vocabulary-axis tensor group (``embed_tokens``, ``lm_head``)
before the merge method and writes ``BuiltTokenizer.files`` as they are. When the donor's tokenizer is only
copied, :func:`resolve_chat_template` and :func:`apply_chat_template_files` set ``chat_template:`` on its files.

May import: errors, config, machine.
"""

from resumerge.merge.vocab.alignment import MissingToken, TokenOverride, VocabAlignment, check_keys, missing_rows_report
from resumerge.merge.vocab.build import BuiltTokenizer, VocabInput, build_tokenizer, source_rows
from resumerge.merge.vocab.builtin_templates import BUILTIN_TEMPLATES
from resumerge.merge.vocab.chat import (
    apply_chat_template,
    apply_chat_template_files,
    check_chat_template,
    read_chat_template,
    resolve_chat_template,
)
from resumerge.merge.vocab.permute import align_rows
from resumerge.merge.vocab.spec import TokenizerSpec, TokenSource, TokenSpec, parse_tokenizer_spec

__all__ = [
    "BUILTIN_TEMPLATES",
    "BuiltTokenizer",
    "MissingToken",
    "TokenOverride",
    "TokenSource",
    "TokenSpec",
    "TokenizerSpec",
    "VocabAlignment",
    "VocabInput",
    "align_rows",
    "apply_chat_template",
    "apply_chat_template_files",
    "build_tokenizer",
    "check_chat_template",
    "check_keys",
    "missing_rows_report",
    "parse_tokenizer_spec",
    "read_chat_template",
    "resolve_chat_template",
    "source_rows",
]

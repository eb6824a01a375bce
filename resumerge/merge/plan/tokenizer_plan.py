"""The output tokenizer in the plan: built from the inputs' tokenizers (``tokenizer_source`` / ``tokenizer:``), or
copied from the donor, with the chat template applied; the plan holds every byte it makes."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path

from resumerge.config.merge_config import MergeConfig
from resumerge.errors import ModelInputError
from resumerge.inputs.files import tokenizer_files
from resumerge.inputs.model import ModelInput
from resumerge.merge.plan.architecture import is_input_embedding
from resumerge.merge.plan.merge_plan import PlanOptions
from resumerge.merge.plan.truncation import cut_tokenizer_files
from resumerge.merge.vocab import (
    BuiltTokenizer,
    TokenizerSpec,
    VocabInput,
    apply_chat_template_files,
    build_tokenizer,
    resolve_chat_template,
)
from resumerge.merge.vocab.sameness import TokenTable, first_difference, table_of_gguf, table_of_tokenizer_json


def build_output_tokenizer(
    config: MergeConfig, spec: TokenizerSpec, models: Mapping[str, ModelInput]
) -> BuiltTokenizer:
    """The output tokenizer of ``spec`` from the inputs' tokenizer files, inputs in config order."""
    inputs = {}
    for ref in config.referenced_models():
        model = models[ref.key]
        if model.gguf is not None:
            raise ModelInputError(f"tokenizer_source cannot yet build a tokenizer from a GGUF model ({ref.key})",
                                  path=str(model.directory / model.gguf),
                                  hint="merge GGUF models whose vocabularies are the same, without tokenizer_source")
        inputs[ref.key] = VocabInput(ref.key, tokenizer_dir(model), _embed_rows(model))
    return build_tokenizer(spec, inputs, config.base_model.key if config.base_model else None)


def _embed_rows(model: ModelInput) -> int:
    """Rows of the model's token embedding (its vocabulary as the weights see it)."""
    for name, found in sorted(model.tensors.items()):
        if is_input_embedding(name) and found.entry.shape:
            return found.entry.shape[0]
    vocab = model.config.get("vocab_size")
    if isinstance(vocab, int) and vocab > 0:
        return vocab
    raise ModelInputError(f"{model.ref.key} has no token embedding and no vocab_size in config.json",
                          path=str(model.directory), hint="a tokenizer can only be built for language models")

def tokenizer_output(
    config: MergeConfig,
    spec: TokenizerSpec,
    built: BuiltTokenizer | None,
    donor: str,
    options: PlanOptions,
    models: Mapping[str, ModelInput],
    cut_rows: int | None = None,
) -> tuple[str | None, dict[str, bytes]]:
    """(model whose tokenizer files are copied, files whose bytes the plan makes). ``cut_rows``: the output's
    vocabulary rows after --unsafe-truncate-embeddings; a donor tokenizer with ids past them is cut to match."""
    if built is not None:
        return None, dict(built.files)
    tokenizer_donor = _tokenizer_donor(donor, options)
    if tokenizer_donor is None:
        return None, {}
    model = models[tokenizer_donor]
    directory = tokenizer_dir(model)
    template = None
    if spec.chat_template is not None:
        template = resolve_chat_template(spec.chat_template, [tokenizer_dir(models[r.key])
                                                              for r in config.referenced_models()])
    if model.gguf is not None and model.adapter is None:  # rebuilt from the file's metadata, held by the plan
        from resumerge.inputs.gguf.tokenizer import gguf_tokenizer_files

        if cut_rows is not None:
            raise ModelInputError("--unsafe-truncate-embeddings cannot cut a GGUF model's tokenizer",
                                  path=str(model.directory / model.gguf),
                                  hint="take the tokenizer from a safetensors model (base_model), or pass "
                                       "--no-copy-tokenizer")
        rebuilt = gguf_tokenizer_files(model.directory / model.gguf, model.gguf_header)
        return tokenizer_donor, dict(apply_chat_template_files(list(rebuilt.items()), template)
                                     if template else rebuilt)
    names = [name for name, _ in tokenizer_files(directory)]
    cut = cut_tokenizer_files(tokenizer_donor, directory, cut_rows, names) if cut_rows is not None else None
    if template is None and cut is None and directory == model.directory:
        return tokenizer_donor, {}  # copied from the donor's folder when written
    # An adapter's tokenizer (its folder is not a model dir of the plan), a changed template or a cut
    # tokenizer: the plan holds the bytes. These are small files, read once here.
    files = list(cut.items()) if cut is not None else [(name, (directory / name).read_bytes()) for name in names]
    return tokenizer_donor, dict(apply_chat_template_files(files, template) if template else files)


def tokenizer_dir(model: ModelInput) -> Path:
    """Where ``model``'s tokenizer files are: its LoRA adapter's folder when that ships a tokenizer (a fine-tune's
    chat template and added tokens live there; mergekit's defect 5 dropped them), else the model's own."""
    if model.adapter is not None and model.adapter.has_tokenizer:
        return model.adapter.directory
    return model.directory

def tokenizer_hashes(models: Mapping[str, ModelInput], donor: str | None,
                      blobs: Mapping[str, bytes]) -> tuple[tuple[str, str], ...]:
    if blobs:
        return tuple((name, hashlib.sha256(data).hexdigest()) for name, data in sorted(blobs.items()))
    return tokenizer_files(tokenizer_dir(models[donor])) if donor else ()

def _tokenizer_donor(donor: str, options: PlanOptions) -> str | None:
    """Whose tokenizer files are copied when none is built: the config donor's, unless --no-copy-tokenizer."""
    return donor if options.copy_tokenizer else None



def refuse_other_tokenizers(config: MergeConfig, models: Mapping[str, ModelInput]) -> None:
    """Refuse a merge that builds no tokenizer (no ``tokenizer_source``) over models of one vocabulary size whose
    rows mean other tokens (:mod:`resumerge.merge.vocab.sameness` says what the same tokenizer is), as a merge of
    vocabularies of other sizes is refused by its tables' shapes: one line naming the command that gives one model
    the other's tokenizer. Tokenizers of equal bytes
    (equal token lists, for GGUFs) are not parsed; a model whose tokens cannot be read is not compared."""
    first: tuple[str, object, Callable[[], TokenTable | None]] | None = None
    rows: int | None = None
    for ref in config.referenced_models():
        found = _tokens_of(models[ref.key])
        if found is None:
            continue
        if first is None:
            first, rows = (ref.key, *found), _rows_of(models[ref.key])
            continue
        if found[0] == first[1] or _rows_of(models[ref.key]) != rows:  # other sizes: the shapes' refusal says it
            continue
        mine, theirs = first[2](), found[1]()
        difference = first_difference(mine, theirs) if mine is not None and theirs is not None else None
        if difference is not None:
            raise ModelInputError(
                f"{first[0]} and {ref.key} have different tokenizers: token id {difference.id} is "
                f"{difference.first!r} in one and {difference.second!r} in the other",
                path=str(tokenizer_dir(models[ref.key])),
                hint="give one model the other's tokenizer first with resumerge tokensurgeon MODEL DONOR OUT, or "
                "align them with tokenizer_source: base (or union)",
            )


def _rows_of(model: ModelInput) -> int | None:
    """Rows of ``model``'s token embedding (None: it has none)."""
    return next((found.entry.shape[0] for name, found in sorted(model.tensors.items())
                 if is_input_embedding(name) and found.entry.shape), None)


def _tokens_of(model: ModelInput) -> tuple[object, Callable[[], TokenTable | None]] | None:
    """(what its tokens are read from, compared for equality first; its token table, parsed when asked) of
    ``model``'s tokenizer: its tokenizer.json's bytes, a GGUF's token list; None where it has neither."""
    if model.gguf is not None:
        metadata = model.gguf_header.metadata if model.gguf_header is not None else {}
        tokens = metadata.get("tokenizer.ggml.tokens")
        return (tokens, lambda: table_of_gguf(metadata)) if tokens is not None else None
    path = tokenizer_dir(model) / "tokenizer.json"
    if not path.is_file():
        return None
    raw = path.read_bytes()
    return raw, lambda: table_of_tokenizer_json(raw)

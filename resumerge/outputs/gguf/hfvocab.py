"""The ``tokenizer.*`` keys of a GGUF output built from a Hugging Face tokenizer folder (tokenizer.json,
tokenizer_config.json, chat_template.jinja), as llama.cpp's ``convert_hf_to_gguf.py`` builds them for byte-level
BPE vocabularies (``tokenizer.ggml.model = gpt2``: Llama 3, SmolLM, Qwen 2/3, Mistral's tekken).

The token list and types follow the converter's ``get_vocab_base`` (ids with no token become ``[PAD{i}]``,
unused; added tokens control when special or ``<|…|>``-shaped, else user-defined), the pre-tokenizer name its
``get_vocab_base_pre`` (the sha256 of the ids of one fixed probe text, looked up in llama.cpp's table: llama.cpp
refuses a name it does not know, and runs a missing one with the wrong splits), and merges, special ids, add_bos/
add_eos and the chat template gguf-py's own ``SpecialVocab``. ``tokenizers`` (a transformers dependency) encodes
the probe; without it, or for a vocabulary this does not cover, the output is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from types import MappingProxyType
from typing import Any

from resumerge.errors import ModelInputError
from resumerge.inputs.gguf.model import gguf_module
from resumerge.outputs.gguf.layout import ARRAY, BOOL, I32, STRING, U32, Value

# llama.cpp's probe text for the pre-tokenizer (convert_hf_to_gguf.py's ``chktxt``).
_PROBE = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ '
          '🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
          '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
          '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
# sha256(str(ids of _PROBE)) -> tokenizer.ggml.pre, the entries of llama.cpp's table for the families resumerge
# writes (llama, mistral, qwen2, qwen3); another vocabulary is refused rather than guessed.
_PRE = MappingProxyType({
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM, SmolLM2
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5 / 2 / 2.5 / 3
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3-Embedding
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral-Nemo
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
})
_NORMAL, _USER_DEFINED, _CONTROL, _UNUSED = 1, 4, 3, 5
_HINT = "write safetensors and convert them with llama.cpp's convert_hf_to_gguf.py, or merge with a GGUF parent"


# The keys built within :func:`built_once`, by what they were built from (the folder's files as they were then): a
# release plans one file per type from the same tokenizer, and building its keys (the tokenizer loaded, its
# vocabulary and merges read) once per file was a third of the run's one-thread start (SmolLM2's 49,152 tokens).
# Only while a release is planned: the lists are not held through the run (its memory baseline counts none).
_BUILT: ContextVar[dict[tuple[object, ...], list[tuple[str, Value]]] | None] = ContextVar("_BUILT", default=None)


@contextmanager
def built_once() -> Iterator[None]:
    """Within it, :func:`tokenizer_keys` builds the keys of one folder's files once and gives each caller its own
    list of them (a release's files); after it, nothing built is kept."""
    if _BUILT.get() is not None:  # within an outer one already
        yield
        return
    token = _BUILT.set({})
    try:
        yield
    finally:
        _BUILT.reset(token)


def tokenizer_keys(directory: Path, vocab_size: int, template: str | None) -> list[tuple[str, Value]]:
    """The ``tokenizer.*`` key-values of the tokenizer in ``directory`` for a model of ``vocab_size`` embedding
    rows, with the config's chat ``template`` (None: the folder's); within :func:`built_once`, built once for the
    folder's files as they are (a file changed, added or removed since: built again)."""
    kept = _BUILT.get()
    try:
        files = tuple(sorted((entry.name, entry.stat().st_size, entry.stat().st_mtime_ns)
                             for entry in directory.iterdir() if entry.is_file()))
    except OSError:
        kept = None
    if kept is None:
        return _built(directory, vocab_size, template)
    key = (str(directory.resolve()), vocab_size, template, files)
    if key not in kept:
        kept[key] = _built(directory, vocab_size, template)
    return list(kept[key])


def _built(directory: Path, vocab_size: int, template: str | None) -> list[tuple[str, Value]]:
    """:func:`tokenizer_keys`, built from the folder's files."""
    where = str(directory / "tokenizer.json")
    try:
        data = json.loads((directory / "tokenizer.json").read_bytes())
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_str(json.dumps(data))
    except FileNotFoundError:
        raise ModelInputError("a GGUF output needs the model's tokenizer.json to build its tokenizer, and there is "
                              "none", path=str(directory), hint=_HINT) from None
    except ImportError:
        raise ModelInputError("building a GGUF's tokenizer needs the tokenizers package", path=where,
                              hint="pip install tokenizers") from None
    except Exception as exc:  # a tokenizer.json the tokenizers library cannot load: the file is bad
        raise ModelInputError(f"tokenizer.json does not load ({exc})", path=where, hint=_HINT) from None
    model = data.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(data.get("pre_tokenizer")):
        raise ModelInputError(f"a GGUF output with a {model.get('type')} tokenizer that is not byte-level BPE, whose "
                              "GGUF vocabulary resumerge cannot build yet (it builds Llama 3, SmolLM, Qwen and "
                              "tekken vocabularies)", path=where, hint=_HINT)
    probe = hashlib.sha256(str(tokenizer.encode(_PROBE).ids).encode()).hexdigest()
    pre = _PRE.get(probe)
    if pre is None:
        raise ModelInputError(f"a tokenizer whose pre-tokenizer llama.cpp's table does not name (probe hash "
                              f"{probe[:16]}…), so a GGUF of it would split text wrongly", path=where, hint=_HINT)
    tokens, types = _tokens(tokenizer, data, vocab_size)
    gguf = gguf_module()
    # SpecialVocab logs each key it finds at INFO and warns about what it skips: that is not ours to print. Its
    # logger is the process's, so its level is put back after the call (a notebook may want those lines later).
    log = logging.getLogger("gguf.vocab")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        special = gguf.SpecialVocab(directory, load_merges=True, n_vocab=len(tokens))
    finally:
        log.setLevel(level)
    if not special.merges:
        raise ModelInputError("tokenizer.json has no merges, which a byte-level BPE GGUF needs", path=where,
                              hint=_HINT)
    kv = [("tokenizer.ggml.model", Value(STRING, "gpt2")), ("tokenizer.ggml.pre", Value(STRING, pre)),
          ("tokenizer.ggml.tokens", Value(ARRAY, tokens, STRING)),
          ("tokenizer.ggml.token_type", Value(ARRAY, types, I32)),
          ("tokenizer.ggml.merges", Value(ARRAY, list(special.merges), STRING))]
    keys = gguf.Keys.Tokenizer
    # the kinds gguf-py's writer has a key for (it skips the rest, cls among them)
    ids = {"bos": keys.BOS_ID, "eos": keys.EOS_ID, "unk": keys.UNK_ID, "sep": keys.SEP_ID, "pad": keys.PAD_ID,
           "mask": keys.MASK_ID}
    adds = {"bos": keys.ADD_BOS, "eos": keys.ADD_EOS, "sep": keys.ADD_SEP}
    kv += [(ids[kind], Value(U32, int(i))) for kind, i in special.special_token_ids.items() if kind in ids]
    add = dict(special.add_special_token)
    # Neither tokenizer_config.json nor a post-processor gguf-py parses says whether BOS/EOS are added: what the
    # tokenizer does says it, written out so llama.cpp does not fall back on its own default for the vocabulary.
    probe_ids = tokenizer.encode("a").ids
    for kind, at in (("bos", 0), ("eos", -1)):
        if kind not in add and kind in special.special_token_ids and probe_ids:
            add[kind] = probe_ids[at] == special.special_token_ids[kind]
    kv += [(adds[kind], Value(BOOL, bool(a))) for kind, a in sorted(add.items()) if kind in adds]
    chat = template if template is not None else special.chat_template
    if isinstance(chat, list):  # named templates: the default one as tokenizer.chat_template, the rest by name
        for entry in chat:
            name = entry["name"]
            kv.append(("tokenizer.chat_template" if name == "default" else f"tokenizer.chat_template.{name}",
                       Value(STRING, entry["template"])))
    elif chat:
        kv.append(("tokenizer.chat_template", Value(STRING, chat)))
    return kv


def _tokens(tokenizer: Any, data: dict[str, Any], vocab_size: int) -> tuple[list[str], list[int]]:
    """The token of every id below ``vocab_size`` and its llama.cpp type, as the converter's ``get_vocab_base``."""
    by_id = {int(i): t for t, i in data["model"]["vocab"].items()}
    added = {int(a["id"]): a for a in data.get("added_tokens", [])}
    for i, entry in added.items():
        by_id[i] = entry["content"]
    if by_id and max(by_id) >= vocab_size:
        raise ModelInputError(f"the tokenizer has token id {max(by_id)}, past the model's {vocab_size} embedding "
                              "rows", hint="merge models whose tokenizer fits their embeddings")
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(_UNUSED)
            continue
        entry = added.get(i)
        if entry is None:
            types.append(_NORMAL)
        else:
            if not entry.get("normalized", False):  # llama.cpp expects added tokens pre-normalized
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False).ids,
                                         skip_special_tokens=False)
            if entry.get("special") or _looks_special(token):
                types.append(_CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(_USER_DEFINED)
        tokens.append(token)
    return tokens, types


def _looks_special(token: str) -> bool:
    """Added tokens some models leave unmarked that llama.cpp treats as control (the converter's rule)."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))

"""Real PEFT LoRA adapters for tests, made with ``peft`` on a transformers model, and PEFT's own merge as oracle.

PEFT initialises ``lora_B`` to zero, which would make every delta vanish; :func:`make_adapter` overwrites both
factors (and any ``modules_to_save`` copy or trained bias) with seeded random values before saving, so the
adapter really changes the model. Generation imports transformers and peft (a few seconds, once per process).
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from resumerge.inputs.adapters import Adapter
from resumerge.inputs.files import TOKENIZER_FILES, TensorSource
from resumerge.inputs.tensorio import TensorReader


@contextmanager
def _quiet() -> Iterator[None]:
    """transformers and peft warn about many things that do not matter here; pytest turns warnings into errors."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def make_adapter(
    base_dir: Path,
    adapter_dir: Path,
    *,
    r: int,
    alpha: float,
    targets: Sequence[str],
    rslora: bool = False,
    seed: int = 0,
    tokenizer_from: Path | None = None,
    chat_template: str | None = None,
    rank_pattern: Mapping[str, int] | None = None,
    alpha_pattern: Mapping[str, float] | None = None,
    modules_to_save: Sequence[str] | None = None,
    bias: str = "none",
    factor_dtype: torch.dtype | None = None,
    use_dora: bool = False,
) -> None:
    """Save a PEFT LoRA adapter for the transformers model in ``base_dir`` into ``adapter_dir``.

    ``targets`` are PEFT ``target_modules`` (e.g. ``["q_proj", "v_proj", "embed_tokens"]``); the factors get
    seeded random values (B is not zero). ``tokenizer_from`` copies that folder's tokenizer files into the
    adapter; ``chat_template`` is then set in its ``tokenizer_config.json`` (or written as
    ``chat_template.jinja`` when no tokenizer was copied). ``factor_dtype`` re-saves the factors in that dtype
    (PEFT saves float32). ``rank_pattern``, ``alpha_pattern``, ``modules_to_save``, ``bias`` and ``use_dora``
    are passed to ``LoraConfig``.
    """
    import transformers
    from peft import LoraConfig, get_peft_model

    with _quiet():
        model = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
        config = LoraConfig(
            r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
            rank_pattern=dict(rank_pattern or {}), alpha_pattern=dict(alpha_pattern or {}),
            modules_to_save=list(modules_to_save) if modules_to_save else None, bias=bias, use_dora=use_dora,
        )
        peft_model = get_peft_model(model, config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
                if "lora_" in name:
                    param.copy_(0.1 * noise)
                elif param.requires_grad:  # modules_to_save copies and trained biases
                    param.add_((0.02 * noise).to(param.dtype))
        peft_model.save_pretrained(str(adapter_dir))
    if factor_dtype is not None:
        _recast_factors(adapter_dir / "adapter_model.safetensors", factor_dtype)
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).is_file():
                shutil.copyfile(tokenizer_from / name, adapter_dir / name)
    if chat_template is not None:
        tok_config = adapter_dir / "tokenizer_config.json"
        if tok_config.is_file():
            doc = json.loads(tok_config.read_text())
            doc["chat_template"] = chat_template
            tok_config.write_text(json.dumps(doc, indent=2))
        else:
            (adapter_dir / "chat_template.jinja").write_text(chat_template)


def _recast_factors(path: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    save_file({k: v.to(dtype) if "lora_" in k else v for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def make_gpt2(directory: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """A tiny GPT-2 (``Conv1D`` layers, weights stored ``(in, out)``) saved with ``save_pretrained``."""
    import transformers

    with _quiet():
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64,
                                         bos_token_id=1, eos_token_id=2)
        torch.manual_seed(seed)
        model = transformers.GPT2LMHeadModel(config).to(dtype)
        model.save_pretrained(directory)
    return directory


def peft_merged(base_dir: Path, adapter_dir: Path) -> dict[str, torch.Tensor]:
    """The state dict mergekit's LoRA path produces: base loaded as stored, ``PeftModel``, ``merge_and_unload``."""
    import transformers
    from peft import PeftModel

    with _quiet():
        model = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
        merged: Any = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False).merge_and_unload()
        return {k: v.detach().clone() for k, v in merged.state_dict().items()}


def merge_with_adapter(base_dir: Path, adapter: Adapter) -> dict[str, torch.Tensor]:
    """Every tensor of the base in ``base_dir`` after the adapter, computed with resumerge's functions.

    Checks the adapter against the base's headers, reads factors and replacements through their recorded byte
    ranges, casts replacements to the base dtype and merges each target whole with :func:`apply_lora`.
    """
    from safetensors.torch import load_file

    from resumerge.inputs.adapters import apply_lora, check_adapter
    from resumerge.inputs.tensorio import TensorReader

    base: dict[str, torch.Tensor] = {}
    for path in sorted(base_dir.glob("*.safetensors")):
        base.update(load_file(str(path)))
    check_adapter(adapter, {k: (_CODES[v.dtype], tuple(v.shape)) for k, v in base.items()}, yaml_path="models[0]")
    reader = TensorReader()
    try:
        merged = {}
        for name, weight in base.items():
            if name in adapter.replacements:
                weight = read_source(reader, adapter.directory, adapter.replacements[name]).to(weight.dtype)
            target = adapter.targets.get(name)
            if target is not None:
                a = read_source(reader, adapter.directory, target.a)
                b = read_source(reader, adapter.directory, target.b)
                weight = apply_lora(weight, a, b, target.scale, target.fan_in_fan_out, embedding=target.embedding)
            merged[name] = weight
        return merged
    finally:
        reader.close()


def read_source(reader: TensorReader, directory: Path, source: TensorSource) -> torch.Tensor:
    """Read the tensor ``source`` locates in ``directory`` by its byte range."""
    e = source.entry
    return reader.read(directory / source.file, e.start, e.end, e.dtype, e.shape)


_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}

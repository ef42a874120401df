"""Hugging Face tokenizer files rebuilt from the tokenizer a GGUF file describes.

Only llama.cpp's "gpt2" tokenizer model (byte-level BPE) is supported. The GGUF stores its vocabulary
already spelled in the byte-level alphabet, so tokens and merges go into a `tokenizers` BPE verbatim.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from srt.configs.model_config import ModelLoadError

logger = logging.getLogger("srt.model_loader")

# llama.cpp's token types (gguf.TokenType).
CONTROL = 3
USER_DEFINED = 4

_SPECIAL_ID_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _pre_tokenizer(meta: dict[str, Any]) -> pre_tokenizers.PreTokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre == "smollm":
        # SmolLM's merges were learned on text split into single digits first.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre not in ("gpt2", "default"):
        logger.warning("GGUF pre-tokenizer %r is not known; using GPT-2 byte-level splitting", pre)
    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)


def _post_processor(meta: dict[str, Any]) -> processors.PostProcessor:
    byte_level = processors.ByteLevel(trim_offsets=False)
    ids = special_token_ids(meta)
    tokens = meta["tokenizer.ggml.tokens"]
    bos = tokens[ids["bos_token"]] if meta.get("tokenizer.ggml.add_bos_token") and "bos_token" in ids else None
    eos = tokens[ids["eos_token"]] if meta.get("tokenizer.ggml.add_eos_token") and "eos_token" in ids else None
    if bos is None and eos is None:
        return byte_level
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    specials = {t: ids[name] for t, name in ((bos, "bos_token"), (eos, "eos_token")) if t is not None}
    template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(specials.items()))
    return processors.Sequence([byte_level, template])


def special_token_ids(meta: dict[str, Any]) -> dict[str, int]:
    """bos/eos/unk/pad token ids named by the GGUF metadata (those that are in range)."""
    n_tokens = len(meta["tokenizer.ggml.tokens"])
    out = {}
    for name, key in _SPECIAL_ID_KEYS.items():
        token_id = meta.get(key)
        if token_id is not None and 0 <= int(token_id) < n_tokens:
            out[name] = int(token_id)
    return out


def special_token_strings(meta: dict[str, Any]) -> dict[str, str]:
    tokens = meta["tokenizer.ggml.tokens"]
    return {name: tokens[i] for name, i in special_token_ids(meta).items()}


def build_tokenizer(meta: dict[str, Any], source: str) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        raise ModelLoadError(f"{source}: the GGUF file has no tokenizer (tokenizer.ggml.model/tokens missing)")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{source}: GGUF tokenizer model {kind!r} is not supported; only 'gpt2' (byte-level BPE) is supported"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta)
    tok.decoder = decoders.ByteLevel()

    types = list(meta.get("tokenizer.ggml.token_type", []))
    control = [t for t, ty in zip(tokens, types) if ty == CONTROL]
    user = [t for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    tok.post_processor = _post_processor(meta)
    return tok


def write_tokenizer_files(meta: dict[str, Any], out_dir: str, source: str, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir."""
    tok = build_tokenizer(meta, source)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    specials = special_token_strings(meta)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model_max_length),
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(specials, f, indent=2, ensure_ascii=False)

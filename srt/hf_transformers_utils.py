"""Tokenizer loading (offline: nothing is fetched from a hub)."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from srt.configs.model_config import ModelLoadError


def get_tokenizer(path: str) -> PreTrainedTokenizerBase:
    if not os.path.isdir(path):
        raise ModelLoadError(f"tokenizer path not found: {path}")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e

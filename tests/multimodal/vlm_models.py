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


def save_random(model_class, cfg, path: str, seed: int = 0, extras=()) -> str:
    """An HF model of `cfg` with random weights (scaled up), saved at path with `extras` (a
    tokenizer, an image processor: anything with save_pretrained)."""
    model = model_class(cfg)
    _randomize(model, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    for extra in extras:
        extra.save_pretrained(path)
    return path


def _tokenizer(tokens: list[str], template: str):
    from srt.model_loader.default_model import resolve_default_model

    # the folder's own tokenizer class, named directly: AutoTokenizer takes seconds longer to the same one
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(resolve_default_model(progress=False, weights=False))
    tok.add_special_tokens({"additional_special_tokens": tokens})
    tok.chat_template = template
    return tok


def idefics3_config(vocab_size: int, image_token_id: int, eos_token_id: int | None = None):
    """SmolVLM's shape at toy size: 64 px tiles of 8 px patches, pixel shuffle 2 (16 tokens a tile)."""
    return transformers.Idefics3Config(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=64,
            patch_size=8,
        ),
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            eos_token_id=eos_token_id,
        ),
        scale_factor=2,
        image_token_id=image_token_id,
        tie_word_embeddings=False,
    )


def build_idefics3(path: str, seed: int = 0) -> str:
    """idefics3_config with SmolVLM's tokens and template; images split into up to 2 x 2 tiles plus
    the global one."""
    tok = _tokenizer(IDEFICS3_TOKENS, IDEFICS3_TEMPLATE)
    ids = tok.convert_tokens_to_ids
    cfg = idefics3_config(len(tok), ids("<image>"), ids("<end_of_utterance>"))
    pixels = transformers.Idefics3ImageProcessorPil(size={"longest_edge": 128}, max_image_size={"longest_edge": 64})
    return save_random(transformers.Idefics3ForConditionalGeneration, cfg, path, seed, (tok, pixels))


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


# LLaVA-1.5's conversation format, in short
LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>\n{% endif %}{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def llava_config(vocab_size: int, image_token_id: int, **overrides):
    """LLaVA-1.5's shape at toy size: a 32 px CLIP tower of 8 px patches (16 tokens an image, the
    class token dropped), its second-to-last layer, a two-layer projector, a Llama."""
    return transformers.LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        ),
        text_config=dict(
            model_type="llama",
            vocab_size=vocab_size,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
        ),
        image_token_index=image_token_id,
        **{"vision_feature_layer": -2, **overrides},
    )


def build_llava(path: str, seed: int = 0) -> str:
    tok = _tokenizer(["<image>"], LLAVA_TEMPLATE)
    cfg = llava_config(len(tok), tok.convert_tokens_to_ids("<image>"))
    pixels = transformers.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return save_random(transformers.LlavaForConditionalGeneration, cfg, path, seed, (tok, pixels))


def hf_llava_processor(path: str):
    tok = transformers.AutoTokenizer.from_pretrained(path)
    pixels = transformers.CLIPImageProcessorPil.from_pretrained(path)
    return transformers.LlavaProcessor(
        pixels, tok, patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1
    )


# Qwen2-VL's chat format, in short: an image part is <|vision_start|><|image_pad|><|vision_end|>
QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen2_vl_pixels():
    """Small images: 4 px patches merged 2 x 2, between 4 and 36 merge windows an image."""
    return transformers.Qwen2VLImageProcessorPil(
        min_pixels=8 * 8 * 4, max_pixels=8 * 8 * 36, patch_size=4, temporal_patch_size=2, merge_size=2
    )


def qwen2_vl_config(vocab_size: int, image: int, video: int, start: int, end: int, eos: int | None = None):
    """Qwen2-VL's shape at toy size: a 2-block vision tower over 4 px patches, merged 2 x 2, and a
    Qwen2 text model with M-RoPE sections [2, 2, 2] of its 12-dim heads (token ids as given)."""
    return transformers.Qwen2VLConfig(
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=48,
            num_heads=4,
            mlp_ratio=2,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", mrope_section=[2, 2, 2], rope_theta=10000.0),
            bos_token_id=None,
            eos_token_id=eos,
        ),
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=True,
    )


def build_qwen2_vl(path: str, seed: int = 0) -> str:
    tok = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"], QWEN2_VL_TEMPLATE)
    ids = tok.convert_tokens_to_ids
    pads = ids("<|image_pad|>"), ids("<|video_pad|>"), ids("<|vision_start|>"), ids("<|vision_end|>")
    cfg = qwen2_vl_config(len(tok), *pads, eos=ids("<|im_end|>"))
    return save_random(transformers.Qwen2VLForConditionalGeneration, cfg, path, seed, (tok, qwen2_vl_pixels()))


def hf_qwen2_vl_processor(path: str):
    """HF's Qwen2VLProcessor wants a video processor (torchvision, not installed here): the same
    call over HF's image processor, with its expansion (each <|image_pad|> repeated once per merge
    window of its image)."""
    tok = transformers.AutoTokenizer.from_pretrained(path)

    def process(text: str, images: list, return_tensors: str = "pt") -> dict:
        inputs = dict(qwen2_vl_pixels()(images=images, return_tensors=return_tensors)) if images else {}
        for t, h, w in inputs.get("image_grid_thw", torch.zeros(0, 3)).tolist():
            text = text.replace("<|image_pad|>", "<|placeholder|>" * (t * h * w // 4), 1)
        ids = tok(text.replace("<|placeholder|>", "<|image_pad|>"), return_tensors=return_tensors)
        kinds = (ids["input_ids"] == tok.convert_tokens_to_ids("<|image_pad|>")).int()  # 1: an image row
        return {**ids, **inputs, "mm_token_type_ids": kinds}

    return process

"""LLaVA-1.5's image encoder (CLIP tower + projector) against HF transformers on a tiny random model:
the selected hidden state(s), with and without the class token, give HF's image features (float32,
1e-4); the checkpoint loads under the names transformers 4.x and 5.x write."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")


def tiny_llava(path: str, **overrides) -> str:
    from multimodal.vlm_models import llava_config, save_random

    return save_random(transformers.LlavaForConditionalGeneration, llava_config(300, 299, **overrides), path)


@pytest.mark.parametrize(
    "overrides, tokens",
    [
        ({}, 16),  # llava-1.5: hidden_states[-2], the class token dropped: 4 x 4 patches
        ({"vision_feature_select_strategy": "full"}, 17),
        ({"vision_feature_layer": [0, -1]}, 16),  # the embeddings' and the last layer's output side by side
    ],
)
def test_image_features_match_hf(tmp_path, overrides, tokens):
    from safetensors.torch import load_file

    from srt.models.llava_vision import LlavaImageEncoder, tokens_per_image

    path = tiny_llava(str(tmp_path / "llava"), **overrides)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ours = LlavaImageEncoder(hf.config).eval()
    ours.load_weights(load_file(os.path.join(path, "model.safetensors")).items())
    torch.manual_seed(1)
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = torch.stack(hf.model.get_image_features(pixel_values=pixels).pooler_output)
    got = ours(pixels)
    assert tokens_per_image(hf.config) == tokens
    assert got.shape == (2, tokens, 48)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_checkpoint_names(tmp_path):
    from safetensors.torch import load_file

    from srt.models.llava_vision import LlavaImageEncoder

    path = tiny_llava(str(tmp_path / "llava"))
    cfg = transformers.LlavaConfig.from_pretrained(path)
    saved = load_file(os.path.join(path, "model.safetensors"))
    pixels = torch.randn(1, 3, 32, 32)

    def features(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        model = LlavaImageEncoder(cfg)
        model.load_weights(weights.items())
        return model(pixels)

    want = features(saved)
    llava_hf = {k.replace("vision_tower.", "vision_tower.vision_model."): t for k, t in saved.items()}
    prefixed = {"model." + k: t for k, t in saved.items()}  # transformers 5.x in memory
    torch.testing.assert_close(features(llava_hf), want, atol=0, rtol=0)
    torch.testing.assert_close(features(prefixed), want, atol=0, rtol=0)
    # hidden_states[-2] of 3 layers: the last layer is neither built nor loaded
    assert len(LlavaImageEncoder(cfg).vision_tower.encoder.layers) == 2
    with pytest.raises(KeyError, match="qkv"):
        features({**saved, "vision_tower.encoder.layers.0.self_attn.qkv.weight": torch.zeros(96, 32)})
    with pytest.raises(KeyError, match="linear_2.bias"):
        features({k: t for k, t in saved.items() if k != "multi_modal_projector.linear_2.bias"})

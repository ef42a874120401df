"""Idefics3 / SmolVLM's image encoder (SigLIP tower + pixel-shuffle connector) against HF
transformers on a tiny random model: tiles of the full size and a smaller, zero-padded image in one
batch give HF's image features (float32, 1e-4)."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")


def test_image_features_match_hf(tmp_path):
    from multimodal.vlm_models import idefics3_config, save_random
    from safetensors.torch import load_file

    from srt.models.idefics3_vision import Idefics3ImageEncoder

    cfg = idefics3_config(vocab_size=300, image_token_id=299)
    path = save_random(transformers.Idefics3ForConditionalGeneration, cfg, str(tmp_path / "idefics3"))
    hf = transformers.Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ours = Idefics3ImageEncoder(hf.config).eval()
    ours.load_weights(load_file(os.path.join(path, "model.safetensors")).items())
    torch.manual_seed(1)
    pixels = torch.randn(3, 3, 64, 64)
    mask = torch.ones(3, 64, 64, dtype=torch.bool)
    pixels[2, :, 48:, :] = 0  # the third image is 48 x 40, padded to the batch's shape
    pixels[2, :, :, 40:] = 0
    mask[2, 48:, :] = False
    mask[2, :, 40:] = False
    with torch.no_grad():
        want = hf.model.get_image_features(pixels[None], mask[None]).pooler_output[0]
    got = ours(pixels, mask)
    assert got.shape == (3, 16, 48)  # 8 x 8 patches, shuffled by 2: 16 tokens of the text width
    torch.testing.assert_close(got.reshape(-1, 48), want, atol=1e-4, rtol=1e-4)
    # the tokens of the padded image's own patches (2 x 2 blocks inside its 6 x 5 patches) do not
    # depend on what its padding holds: its patches attend to its own patches only
    pixels[2, :, 50:, :] = 5.0
    own = [0, 1, 4, 5, 8, 9]
    torch.testing.assert_close(ours(pixels, mask)[2, own], got[2, own], atol=1e-5, rtol=1e-5)

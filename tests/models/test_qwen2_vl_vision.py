"""Qwen2-VL's image encoder (2D-rotary vision tower + patch merger) and M-RoPE positions against
HF transformers on a tiny random model: two images of different sizes, patched by HF's processor and
encoded in one call, give HF's image features (float32, 1e-4); prompts with none, one and two images
give HF's `get_rope_index` (srt/models/multimodal.py's `mrope_positions`)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

IMAGE, START, END = 297, 295, 296


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from multimodal.vlm_models import qwen2_vl_config, save_random
    from safetensors.torch import load_file

    from srt.models.qwen2_vl_vision import Qwen2VLImageEncoder

    cfg = qwen2_vl_config(300, image=IMAGE, video=298, start=START, end=END)
    path = save_random(transformers.Qwen2VLForConditionalGeneration, cfg, str(tmp_path_factory.mktemp("qwen2_vl")))
    hf = transformers.Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ours = Qwen2VLImageEncoder(hf.config).eval()
    ours.load_weights(load_file(os.path.join(path, "model.safetensors")).items())
    return hf, ours


def test_image_features_match_hf(models):
    hf, ours = models
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(40, 24), (30, 50)]]
    from multimodal.vlm_models import qwen2_vl_pixels

    processor = qwen2_vl_pixels()
    inputs = processor(images=images, return_tensors="pt")
    pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    assert grid.tolist() == [[1, 10, 6], [1, 8, 12]]  # 40 x 24 and 32 x 48 pixels, in 4 x 4 patches
    with torch.no_grad():
        want = torch.cat(hf.model.get_image_features(pixels, grid).pooler_output)
    got = ours(pixels, grid)
    assert got.shape == (15 + 24, 48)  # merged 2 x 2: 60 / 4 and 96 / 4 tokens of the text width
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the second image alone gives its tokens of the pair: a patch attends to its own image only
    torch.testing.assert_close(ours(pixels[60:], grid[1:]), got[15:], atol=1e-5, rtol=1e-5)


def test_load_weights_rejects_unknown_and_missing(models):
    from srt.models.qwen2_vl_vision import Qwen2VLImageEncoder

    hf, ours = models
    state = [(f"model.visual.{k}", v) for k, v in ours.state_dict().items()]  # the newer layout loads too
    fresh = Qwen2VLImageEncoder(hf.config)
    text = [("model.language_model.norm.weight", torch.ones(48)), ("lm_head.weight", torch.ones(300, 48))]
    fresh.load_weights(text + state)  # the text model's tensors are skipped
    assert all(torch.equal(p, ours.state_dict()[k]) for k, p in fresh.state_dict().items())
    with pytest.raises(KeyError, match="visual.blocks.9"):
        fresh.load_weights(state + [("visual.blocks.9.norm1.weight", torch.ones(32))])
    with pytest.raises(KeyError, match="merger"):
        fresh.load_weights([(k, v) for k, v in state if "merger" not in k])


@pytest.mark.parametrize(
    "grids,prompt",
    [
        ([], [5, 6, 7, 8]),
        ([(1, 10, 6)], [5, START, *[IMAGE] * 15, END, 6, 7]),
        ([(1, 10, 6), (1, 8, 12)], [5, 6, START, *[IMAGE] * 15, END, 7, 8, 9, START, *[IMAGE] * 24, END, 10]),
    ],
    ids=["text", "one_image", "two_images"],
)
def test_rope_index_matches_hf(models, grids, prompt):
    """srt/models/multimodal.py's M-RoPE positions of the whole prompt, and the decode delta."""
    from srt.models.multimodal import MultimodalItem, mrope_positions
    from srt.models.qwen2_vl_vision import tokens_for_grid

    hf, _ = models
    assert sum(tokens_for_grid(g, hf.config) for g in grids) == prompt.count(IMAGE)
    ids = torch.tensor([prompt])
    want, want_delta = hf.model.get_rope_index(
        ids, mm_token_type_ids=(ids == IMAGE).int(), image_grid_thw=torch.tensor(grids) if grids else None
    )
    items, start = [], 0
    for t, h, w in grids:
        first = prompt.index(IMAGE, start)
        n = tokens_for_grid((t, h, w), hf.config)
        items.append(MultimodalItem(key=first, token_id=IMAGE, spans=[(first, n)], grid=(t, h // 2, w // 2)))
        start = first + n
    assert torch.equal(mrope_positions(items, 0, len(prompt)), want[:, 0])
    assert sum(it.position_delta for it in items) == int(want_delta)
    # any window of the sequence (a prefill chunk, decode steps past the prompt) is the same slice
    whole = mrope_positions(items, 0, len(prompt) + 4)
    for lo, hi in [(0, 3), (3, len(prompt)), (len(prompt) - 2, len(prompt) + 4)]:
        assert torch.equal(mrope_positions(items, lo, hi), whole[:, lo:hi])
    assert torch.equal(
        whole[:, len(prompt) :], torch.arange(len(prompt), len(prompt) + 4).repeat(3, 1) + int(want_delta)
    )

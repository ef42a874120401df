"""Qwen2-VL: the dynamic-resolution vision tower and patch merger (qwen2_vl_vision.py) over a
Qwen2 text model with M-RoPE. An image is resized to a multiple of the merge window and becomes
t*h*w / merge^2 placeholder rows; those rows take 3-D (frame, row, column) positions and the text
after them resumes max(h, w) / merge positions on (`MultimodalItem.grid`, the batch's
`mrope_positions`). Checkpoint names: the text model under `model.*` (or `model.language_model.*`),
`lm_head.weight`, the image side under `visual.*` (or `model.visual.*`)."""

from __future__ import annotations

import torch

from srt.models.multimodal import MultimodalItem
from srt.models.qwen2_vl_vision import Qwen2VLImageEncoder
from srt.models.vision_language import VisionLanguageForCausalLM


class Qwen2VLForConditionalGeneration(VisionLanguageForCausalLM):
    visual: Qwen2VLImageEncoder
    vision_prefixes = ("visual.", "model.visual.")
    text_renames = (("model.language_model.", "model."),)

    def __init__(self, config, quant_config=None):
        super().__init__(config, quant_config=quant_config)
        self.visual = Qwen2VLImageEncoder(config)

    @classmethod
    def attention_bias(cls, config) -> tuple[bool, bool]:
        return True, False  # Qwen2's: biased Q, K, V projections

    def encode_images(self, items: list[MultimodalItem]) -> list[torch.Tensor]:
        """Every item's patches through the tower in one call (each patch attends to its own image)."""
        pixels = self.to_encoder(torch.cat([it.data["pixel_values"] for it in items]))
        grids = torch.cat([it.data["image_grid_thw"] for it in items])
        return list(self.visual(pixels, grids).split([it.num_rows for it in items]))


EntryClass = Qwen2VLForConditionalGeneration

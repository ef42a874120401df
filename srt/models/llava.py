"""LLaVA (1.5): a CLIP image tower and a two-layer projector (llava_vision.py) over a Llama text
model. An image is one fixed-size crop; its placeholder is repeated once per patch feature and
those rows take the projector's outputs. Checkpoint names: the text model under
`language_model.model.*` / `language_model.lm_head.*` (llava-hf, transformers 4.x) or
`model.language_model.*` / `lm_head.*` (transformers 5.x); the image side under `vision_tower.*`
and `multi_modal_projector.*`, with or without `model.`."""

from __future__ import annotations

import torch

from srt.configs.model_config import ModelLoadError
from srt.models.llava_vision import LlavaImageEncoder
from srt.models.multimodal import MultimodalItem
from srt.models.vision_language import VisionLanguageForCausalLM


class LlavaForConditionalGeneration(VisionLanguageForCausalLM):
    visual: LlavaImageEncoder
    vision_prefixes = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
    text_renames = (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    )

    def __init__(self, config, quant_config=None):
        text = config.get_text_config()
        if text.model_type not in ("llama", "mistral"):
            raise ModelLoadError(f"LLaVA over a {text.model_type!r} text model is not supported (llama, mistral are)")
        super().__init__(config, quant_config=quant_config)
        self.visual = LlavaImageEncoder(config)

    def encode_images(self, items: list[MultimodalItem]) -> list[torch.Tensor]:
        pixels = self.to_encoder(torch.cat([it.data["pixel_values"] for it in items]))
        return list(self.visual(pixels))


EntryClass = LlavaForConditionalGeneration

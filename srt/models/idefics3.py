"""Idefics3 / SmolVLM: the SigLIP image encoder and pixel-shuffle connector (idefics3_vision.py)
over a Llama text model. Checkpoint names: `model.text_model.*` (the Llama), `lm_head.weight`,
`model.vision_model.*` and `model.connector.*`.

A prompt's image is a run of tiles (the image split into a grid, then the whole image shrunk), each
tile `image_seq_len` placeholder tokens between tile markers; the placeholders' embeddings are the
tiles' connector outputs, in order. The encoder runs once per prefill batch over every tile of the
images it has not seen (srt/models/multimodal.py's cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from srt.models.idefics3_vision import Idefics3ImageEncoder
from srt.models.multimodal import MultimodalItem
from srt.models.vision_language import VisionLanguageForCausalLM


class Idefics3ForConditionalGeneration(VisionLanguageForCausalLM):
    visual: Idefics3ImageEncoder
    vision_prefixes = ("model.vision_model.", "model.connector.")
    text_renames = (("model.text_model.", "model."),)

    def __init__(self, config, quant_config=None):
        super().__init__(config, quant_config=quant_config)
        self.visual = Idefics3ImageEncoder(config)

    def encode_images(self, items: list[MultimodalItem]) -> list[torch.Tensor]:
        """Every tile of `items` through the encoder in one batch (tiles zero padded to the largest
        tile, with their pixel masks); each item's rows are its tiles' tokens in order."""
        tiles = [it.data["pixel_values"] for it in items]
        masks = [it.data["pixel_attention_mask"] for it in items]
        height = max(t.shape[-2] for t in tiles)
        width = max(t.shape[-1] for t in tiles)
        pixels = torch.cat([F.pad(t, (0, width - t.shape[-1], 0, height - t.shape[-2])) for t in tiles])
        mask = torch.cat([F.pad(m, (0, width - m.shape[-1], 0, height - m.shape[-2])) for m in masks])
        pixels = self.to_encoder(pixels)
        out = self.visual(pixels, mask.to(pixels.device))
        return [o.reshape(-1, o.shape[-1]) for o in out.split([t.shape[0] for t in tiles])]


EntryClass = Idefics3ForConditionalGeneration

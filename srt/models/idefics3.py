"""Idefics3 / SmolVLM: the SigLIP image encoder and pixel-shuffle connector (idefics3_vision.py)
over a Llama text model. Checkpoint names: `model.text_model.*` (the Llama), `lm_head.weight`,
`model.vision_model.*` and `model.connector.*`.

A prompt's image is a run of tiles (the image split into a grid, then the whole image shrunk), each
tile `image_seq_len` placeholder tokens between tile markers; the placeholders' embeddings are the
tiles' connector outputs, in order. The encoder runs once per prefill batch over every tile of the
images it has not seen (srt/models/multimodal.py's cache).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from srt.layers.logits_processor import LogitsProcessorOutput
from srt.models.idefics3_vision import Idefics3ImageEncoder
from srt.models.llama import LlamaForCausalLM
from srt.models.multimodal import EncoderCache, MultimodalItem, merge_image_embeddings


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    modalities = ("text", "image")
    loaded_apart = ("visual",)

    def __init__(self, config, quant_config=None):
        text_config = config.get_text_config()
        super().__init__(text_config, quant_config=quant_config)
        self.vl_config = config
        self.image_token_id = config.image_token_id
        self.visual = Idefics3ImageEncoder(config)
        self.encoder_cache = EncoderCache()

    def encode_images(self, items: list[MultimodalItem]) -> list[torch.Tensor]:
        """Every tile of `items` through the encoder in one batch (tiles zero padded to the largest
        tile, with their pixel masks); each item's rows are its tiles' tokens in order."""
        tiles = [it.data["pixel_values"] for it in items]
        masks = [it.data["pixel_attention_mask"] for it in items]
        height = max(t.shape[-2] for t in tiles)
        width = max(t.shape[-1] for t in tiles)
        dtype = self.visual.connector.modality_projection.proj.weight.dtype
        device = self.visual.connector.modality_projection.proj.weight.device
        pixels = torch.cat([F.pad(t, (0, width - t.shape[-1], 0, height - t.shape[-2])) for t in tiles])
        mask = torch.cat([F.pad(m, (0, width - m.shape[-1], 0, height - m.shape[-2])) for m in masks])
        out = self.visual(pixels.to(device, dtype), mask.to(device).bool())
        counts = [t.shape[0] for t in tiles]
        return [o.reshape(-1, o.shape[-1]) for o in out.split(counts)]

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch) -> LogitsProcessorOutput:
        runs = forward_batch.mm_inputs
        embeds = None
        if runs:
            embeds = self.model.embed_tokens(input_ids)
            embeds = merge_image_embeddings(embeds, runs, self.encode_images, self.encoder_cache)
        hidden_states = self.model(input_ids, positions, forward_batch, input_embeds=embeds)
        return self.logits_processor(hidden_states, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision: list[tuple[str, torch.Tensor]] = []

        def text():
            for name, tensor in weights:
                if name.startswith(("model.vision_model.", "model.connector.")):
                    vision.append((name, tensor))
                else:
                    yield name.replace("model.text_model.", "model.", 1), tensor

        super().load_weights(text())
        self.visual.load_weights(vision)


EntryClass = Idefics3ForConditionalGeneration

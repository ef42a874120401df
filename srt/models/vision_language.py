"""The shared part of the image-in, text-out models over a Llama-family text model: the forward
that merges encoder rows into the token embeddings, and a checkpoint split between the text model
(renamed to our names) and the image encoder (which loads its own tensors)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from srt.layers.logits_processor import LogitsProcessorOutput
from srt.models.llama import LlamaForCausalLM
from srt.models.multimodal import EncoderCache, MultimodalItem, merge_image_embeddings


class VisionLanguageForCausalLM(LlamaForCausalLM):
    """Subclasses build `self.visual` (with `load_weights`) and `encode_images`, and name the
    checkpoint prefixes of the image side and the text model's renames."""

    modalities = ("text", "image")
    loaded_apart = ("visual",)
    vision_prefixes: tuple[str, ...] = ()
    # checkpoint prefix -> ours, first match wins
    text_renames: tuple[tuple[str, str], ...] = ()
    visual: Any  # the image encoder: an nn.Module with load_weights (each subclass names its type)

    def __init__(self, config, quant_config=None):
        tie = bool(getattr(config, "tie_word_embeddings", False))
        super().__init__(config.get_text_config(), quant_config=quant_config, tie_word_embeddings=tie)
        self.vl_config = config
        self.encoder_cache = EncoderCache()

    def encode_images(self, items: list[MultimodalItem]) -> list[torch.Tensor]:
        """Each item's encoder rows ([num_rows, text hidden]), all items in one batch where they fit."""
        raise NotImplementedError

    def to_encoder(self, t: torch.Tensor) -> torch.Tensor:
        """Processor output (float32, on the CPU) onto the encoder's device and dtype."""
        p = next(self.visual.parameters())
        return t.to(p.device, p.dtype)

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch) -> LogitsProcessorOutput:
        embeds = None
        if runs := forward_batch.mm_inputs:
            embeds = merge_image_embeddings(
                self.model.embed_tokens(input_ids), runs, self.encode_images, self.encoder_cache
            )
        if forward_batch.mrope_positions is not None:  # M-RoPE: [3, T] where images are in the batch
            positions = forward_batch.mrope_positions
        hidden_states = self.model(input_ids, positions, forward_batch, input_embeds=embeds)
        return self.logits_processor(hidden_states, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision: list[tuple[str, torch.Tensor]] = []

        def text():
            for name, tensor in weights:
                if name.startswith(self.vision_prefixes):
                    vision.append((name, tensor))
                    continue
                for old, new in self.text_renames:
                    if name.startswith(old):
                        name = new + name.removeprefix(old)
                        break
                yield name, tensor

        super().load_weights(text())
        self.visual.load_weights(vision)

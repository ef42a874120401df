"""Idefics3 / SmolVLM's image side: a SigLIP vision transformer over patches of variable-size images
(NaViT-style position buckets), then the connector (pixel shuffle, a linear projection into the text
model's embedding space). Issue 40's first piece: the image features one image's placeholder tokens
are replaced by; the serving path (inputs, the radix keys of images, the scheduler) builds on it.

Weights keep the HF names under `model.vision_model.*` and `model.connector.*`.

- **Embeddings.** A patch_size x patch_size convolution (stride patch_size) gives one vector per
  patch. An image smaller than the padded batch shape has a patch mask; its patches' positions are
  bucketed fractions of its own height and width onto the `image_size / patch_size` square grid of
  position embeddings, so every image, whatever its size, spans the whole grid.
- **Encoder.** Pre-norm layers (LayerNorm, bidirectional attention with biases, a tanh-GELU MLP),
  where a patch attends to the real patches of its image only; `post_layernorm` at the end.
- **Connector.** Pixel shuffle by `scale_factor` s: each s x s block of patches becomes one vector
  s^2 times as wide (an image of n patches gives n / s^2 tokens); then `modality_projection.proj`
  (no bias) into the text model's hidden size.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn


class VisionEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.patch_size = config.patch_size
        self.grid = config.image_size // config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, self.patch_size, self.patch_size)
        self.position_embedding = nn.Embedding(self.grid * self.grid, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """pixel_values [B, C, H, W]; patch_mask [B, H / p, W / p] (the image's own patches)."""
        b = pixel_values.shape[0]
        x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        rows, cols = patch_mask.shape[1:]
        boundaries = torch.arange(1 / self.grid, 1.0, 1 / self.grid, device=x.device)
        h = patch_mask[:, :, 0].sum(1)  # each image's patches down and across
        w = patch_mask[:, 0, :].sum(1)
        frac_h = (torch.arange(rows, device=x.device, dtype=torch.float32)[None] / h[:, None]).clamp(max=1 - 1e-6)
        frac_w = (torch.arange(cols, device=x.device, dtype=torch.float32)[None] / w[:, None]).clamp(max=1 - 1e-6)
        bucket_h = torch.bucketize(frac_h, boundaries, right=True)
        bucket_w = torch.bucketize(frac_w, boundaries, right=True)
        ids = (bucket_h[:, :, None] * self.grid + bucket_w[:, None, :]).reshape(b, -1)
        ids = torch.where(patch_mask.reshape(b, -1), ids, torch.zeros_like(ids))
        return x + self.position_embedding(ids)


class VisionAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.heads = config.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, d = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)), mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class VisionMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        eps = config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_hidden_layers))


class VisionTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values, patch_mask)
        flat = patch_mask.reshape(x.shape[0], -1)
        # a patch attends to its image's real patches (every image has some)
        mask = None if bool(flat.all()) else flat[:, None, None, :]
        for layer in self.encoder.layers:
            x = layer(x, mask)
        return self.post_layernorm(x)


class ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)


class Connector(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.scale = config.scale_factor
        width = config.vision_config.hidden_size * self.scale**2
        self.modality_projection = ModalityProjection(width, config.text_config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, n, d] patch vectors (n a square) -> [B, n / s^2, text hidden]: each s x s block of
        patches side by side (its rows in order, each row's s patches in order), then projected."""
        b, n, d = x.shape
        side, s = int(round(n**0.5)), self.scale
        x = x.view(b, side // s, s, side // s, s, d)  # block row, row in block, block column, column in block
        x = x.permute(0, 1, 3, 2, 4, 5).reshape(b, n // (s * s), s * s * d)
        return self.modality_projection.proj(x)


class Idefics3ImageEncoder(nn.Module):
    """The vision transformer and the connector: pixel values to the text model's image embeddings."""

    def __init__(self, config):
        super().__init__()
        self.patch_size = config.vision_config.patch_size
        self.vision_model = VisionTransformer(config.vision_config)
        self.connector = Connector(config)

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor | None = None) -> torch.Tensor:
        """pixel_values [N, C, H, W] (N image tiles, zero padded to one shape); pixel_mask [N, H, W]
        (True on an image's own pixels; default all). Returns [N, tokens per tile, text hidden]."""
        n, _, height, width = pixel_values.shape
        if pixel_mask is None:
            pixel_mask = torch.ones(n, height, width, dtype=torch.bool, device=pixel_values.device)
        p = self.patch_size
        patch_mask = pixel_mask.unfold(1, p, p).unfold(2, p, p).sum((-1, -2)) > 0
        return self.connector(self.vision_model(pixel_values, patch_mask))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's `model.vision_model.*` and `model.connector.*` tensors (others are skipped)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if not name.startswith(("vision_model.", "connector.")):
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        if missing := sorted(set(params) - loaded):
            raise KeyError(f"checkpoint has no tensors for {missing[:6]}")

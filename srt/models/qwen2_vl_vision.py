"""Qwen2-VL's image side: a vision transformer over the patches of variable-size images with 2D
rotary positions, then the patch merger into the text model's embedding space. (The text side's
M-RoPE positions are srt/models/multimodal.py's `mrope_positions`.)

Weights keep the HF names under `visual.*` (what `save_pretrained` writes; `model.visual.*` of the
newer layout is accepted too): `patch_embed.proj`, `blocks.{i}.{norm1,attn.qkv,attn.proj,norm2,
mlp.fc1,mlp.fc2}`, `merger.{ln_q,mlp.0,mlp.2}`.

- **Patches.** The processor resizes an image to a multiple of patch_size * merge_size, cuts it
  into t x h x w patches of C x temporal_patch x patch x patch values (a still image is its frame
  twice over, t = 1), and orders them window by window: each merge x merge window's patches are
  consecutive, windows row by row. The patch embedding is a Conv3d whose kernel is one patch, so
  on these rows it is one matmul with the flattened kernel.
- **Blocks.** Pre-norm (LayerNorm) layers: attention with a fused, biased qkv where a patch
  attends to the patches of its own image (frame) only, then an MLP with `hidden_act`
  (quick_gelu). Rotary positions are 2D: the first half of each head's rotated pairs turns with
  the patch's row, the second half with its column, both with frequencies
  theta^(-4i / head_dim).
- **Merger.** `ln_q`, then each window's merge^2 consecutive patches side by side through
  Linear, GELU, Linear into the text hidden size: an image gives t*h*w / merge^2 tokens.
- **M-RoPE.** Text tokens count up on all three axes alike. An image's tokens sit at the next
  position p plus (frame, window row, window column), and the text after it resumes at
  p + max(h, w) / merge; decode tokens at sequence index i take position i + delta.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu, "silu": F.silu}


def tokens_for_grid(grid_thw: tuple[int, int, int], config) -> int:
    """Placeholder tokens of one image whose patch grid is (t, h, w)."""
    t, h, w = grid_thw
    return t * h * w // config.vision_config.spatial_merge_size**2


class Segments(NamedTuple):
    """Packed patches laid out as a padded [count, max_len] batch: one attention call covers every
    image while each patch sees only its own segment (image frame). Padding costs count * max_len^2
    scores where a block-diagonal mask over all patches would cost n^2, and segments of one length
    (the usual batch of same-size images) need no mask at all, so SDPA keeps its fused kernels."""

    index: torch.Tensor  # packed row -> row of the flattened padded batch
    count: int
    max_len: int
    key_mask: torch.Tensor | None  # [count, 1, 1, max_len]; None when all segments are as long

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v [n, heads, head_dim] packed -> attention output of the same shape."""
        _, heads, dim = q.shape

        def pad(x: torch.Tensor) -> torch.Tensor:
            out = x.new_zeros(self.count * self.max_len, heads, dim).index_copy_(0, self.index, x)
            return out.view(self.count, self.max_len, heads, dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), self.key_mask)
        return out.transpose(1, 2).reshape(-1, heads, dim)[self.index]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotation of x [n, heads, head_dim] by angles [n, head_dim], in float32."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, vc):
        super().__init__()
        kernel = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.proj = nn.Conv3d(vc.in_channels, vc.embed_dim, kernel, kernel, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.proj.weight.dtype), self.proj.weight.flatten(1))


class VisionAttention(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.heads = vc.num_heads
        self.qkv = nn.Linear(vc.embed_dim, 3 * vc.embed_dim)
        self.proj = nn.Linear(vc.embed_dim, vc.embed_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        n, d = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.heads, d // self.heads).unbind(1)
        out = segments.attend(rotate(q, cos, sin), rotate(k, cos, sin), v)
        return self.proj(out.reshape(n, d))


class VisionMlp(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.fc1 = nn.Linear(vc.embed_dim, vc.embed_dim * vc.mlp_ratio)
        self.fc2 = nn.Linear(vc.embed_dim * vc.mlp_ratio, vc.embed_dim)
        if vc.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_act {vc.hidden_act!r} is not one of {sorted(ACTIVATIONS)}")
        self.act = ACTIVATIONS[vc.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.norm1 = nn.LayerNorm(vc.embed_dim, eps=1e-6)
        self.attn = VisionAttention(vc)
        self.norm2 = nn.LayerNorm(vc.embed_dim, eps=1e-6)
        self.mlp = VisionMlp(vc)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, vc):
        super().__init__()
        width = vc.embed_dim * vc.spatial_merge_size**2
        self.ln_q = nn.LayerNorm(vc.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, vc.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.mlp[0].in_features))


class Qwen2VLImageEncoder(nn.Module):
    """The vision tower and the merger: processor patches to the text model's image embeddings."""

    def __init__(self, config):
        super().__init__()
        vc = config.vision_config
        self.merge = vc.spatial_merge_size
        self.head_dim = vc.embed_dim // vc.num_heads
        self.rope_theta = (getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.patch_embed = PatchEmbed(vc)
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc.depth))
        self.merger = PatchMerger(vc)

    def rotary(self, grid: torch.Tensor, offset: torch.Tensor, seg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, head_dim] of each patch's (row, column) in its frame, undoing the window order."""
        m = self.merge
        windows_across = (torch.repeat_interleave(grid[:, 2], grid[:, 0]) // m)[seg]
        window = offset // (m * m)
        row = window // windows_across * m + offset // m % m
        col = window % windows_across * m + offset % m
        # computed here in float32 rather than kept as a buffer, which a cast of the model would round
        quarter = torch.arange(0, self.head_dim // 2, 2, device=grid.device, dtype=torch.float32)
        inv_freq = self.rope_theta ** (-quarter / (self.head_dim // 2))
        angles = (torch.stack([row, col], dim=1)[..., None] * inv_freq).flatten(1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [sum t*h*w, C * temporal_patch * patch^2] (the processor's rows, images in
        order); grid_thw [images, 3]. Returns [sum t*h*w / merge^2, text hidden], images in order."""
        device = pixel_values.device
        grid = grid_thw.to(device=device, dtype=torch.long)
        frame_len = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
        n = pixel_values.shape[0]
        assert int(frame_len.sum()) == n, f"grid_thw {grid_thw.tolist()} does not cover {n} patches"
        seg = torch.repeat_interleave(torch.arange(len(frame_len), device=device), frame_len)
        offset = torch.arange(n, device=device) - (frame_len.cumsum(0) - frame_len)[seg]
        max_len = int(frame_len.max())
        uneven = bool((frame_len != max_len).any())
        key_mask = (torch.arange(max_len, device=device) < frame_len[:, None])[:, None, None] if uneven else None
        segments = Segments(seg * max_len + offset, len(frame_len), max_len, key_mask)
        cos, sin = self.rotary(grid, offset, seg)
        x = self.patch_embed(pixel_values)
        for block in self.blocks:
            x = block(x, cos, sin, segments)
        return self.merger(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's `visual.*` (or `model.visual.*`) tensors; the text model's are skipped."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if not name.startswith("visual."):
                continue
            name = name.removeprefix("visual.")
            if name not in params:
                raise KeyError(f"checkpoint tensor 'visual.{name}' has no parameter in {type(self).__name__}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        if missing := sorted(set(params) - loaded):
            raise KeyError(f"checkpoint has no tensors for {missing[:6]}")

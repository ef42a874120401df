"""LLaVA-1.5's image side (HF `LlavaForConditionalGeneration`): a CLIP vision transformer over a
fixed-size image, one of its hidden states, then a two-layer projector into the text model's
embedding space. These are the features an image's placeholder tokens are replaced by.

Weights keep the HF names under `vision_tower.*` and `multi_modal_projector.*`. transformers 4.x
(and the llava-hf checkpoints) write the tower as `vision_tower.vision_model.*`, 5.x as
`vision_tower.*`; either may carry a `model.` prefix. The text model's tensors are skipped.

- **Embeddings.** A patch_size x patch_size convolution (stride patch_size, no bias) gives one
  vector per patch; a learned class embedding goes first, and a learned position embedding is added
  to each of the 1 + (image_size / patch_size)^2 tokens; then `pre_layrnorm`.
- **Encoder.** Pre-norm layers (LayerNorm, bidirectional attention with biases, an MLP with the
  config's `hidden_act`, quick_gelu for CLIP).
- **Feature selection.** `vision_feature_layer` indexes the hidden states, where 0 is the embeddings
  (after `pre_layrnorm`) and i the i-th layer's output: llava-1.5's -2 is the second-to-last layer's
  output, so the last layer and `post_layernorm` are never run (nor built). A list of indices
  concatenates those states on the feature dim. Strategy "default" drops the class token, "full"
  keeps it.
- **Projector.** `linear_1`, `projector_hidden_act` (GELU), `linear_2` to the text hidden size.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str, field: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"{field}={name!r} is not supported; expected one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def feature_layers(config) -> list[int]:
    """`vision_feature_layer` as non-negative indices into the hidden states (0 is the embeddings)."""
    layers = config.vision_feature_layer
    layers = [layers] if isinstance(layers, int) else list(layers)
    n = config.vision_config.num_hidden_layers
    if bad := [i for i in layers if not -(n + 1) <= i <= n]:
        raise ValueError(f"vision_feature_layer {bad} is out of range for {n} vision layers")
    return [i % (n + 1) for i in layers]


def tokens_per_image(config) -> int:
    """The image features' length, i.e. how many placeholder tokens one image takes."""
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 + (config.vision_feature_select_strategy == "full")


class VisionEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.image_size = config.image_size
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, config.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding((config.image_size // config.patch_size) ** 2 + 1, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        b, _, h, w = pixel_values.shape
        s = self.image_size
        if (h, w) != (s, s):
            raise ValueError(f"pixel_values are {h} x {w}; this vision tower takes {s} x {s}")
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_embedding.expand(b, 1, -1), patches], dim=1)
        return x + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.heads = config.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class VisionMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.act = activation(config.hidden_act, "vision_config.hidden_act")
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        eps = config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(num_layers))


class VisionTransformer(nn.Module):
    """CLIP's vision transformer up to its last layer whose output is a selected feature."""

    def __init__(self, config, num_layers: int):
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = VisionEncoder(config, num_layers)

    def forward(self, pixel_values: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """The hidden states `layers` (0 is the embeddings), each [B, 1 + patches, vision hidden]."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers, 1):
            x = layer(x)
            if i in layers:
                states[i] = x
        return [states[i] for i in layers]


class MultiModalProjector(nn.Module):
    def __init__(self, config, num_feature_layers: int):
        super().__init__()
        bias, d_text = config.multimodal_projector_bias, config.text_config.hidden_size
        self.linear_1 = nn.Linear(config.vision_config.hidden_size * num_feature_layers, d_text, bias=bias)
        self.act = activation(config.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = nn.Linear(d_text, d_text, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaImageEncoder(nn.Module):
    """The vision tower and the projector: pixel values to the text model's image embeddings."""

    def __init__(self, config):
        super().__init__()
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(
                f"vision_feature_select_strategy={config.vision_feature_select_strategy!r}; "
                "expected 'default' or 'full'"
            )
        self.drop_cls = config.vision_feature_select_strategy == "default"
        self.feature_layers = feature_layers(config)
        self.num_vision_layers = config.vision_config.num_hidden_layers
        self.vision_tower = VisionTransformer(config.vision_config, max(self.feature_layers))
        self.multi_modal_projector = MultiModalProjector(config, len(self.feature_layers))

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, image_size, image_size] -> [N, tokens_per_image, text hidden]."""
        states = self.vision_tower(pixel_values, self.feature_layers)
        if self.drop_cls:
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    def unused(self, name: str) -> bool:
        """A tower tensor the selected features never depend on: a later layer or `post_layernorm`."""
        if name.startswith("vision_tower.post_layernorm."):
            return True
        m = re.match(r"vision_tower\.encoder\.layers\.(\d+)\.", name)
        return m is not None and len(self.vision_tower.encoder.layers) <= int(m[1]) < self.num_vision_layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's `vision_tower.*` and `multi_modal_projector.*` tensors (others are skipped)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("vision_tower.vision_model."):
                name = "vision_tower." + name.removeprefix("vision_tower.vision_model.")
            if not name.startswith(("vision_tower.", "multi_modal_projector.")) or self.unused(name):
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        if missing := sorted(set(params) - loaded):
            raise KeyError(f"checkpoint has no tensors for {missing[:6]}")

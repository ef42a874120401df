"""Sentence embeddings from a model's last hidden states over a packed batch, pooled as the model
folder's sentence-transformers config says.

- **Config.** `modules.json` lists the pipeline: a `Transformer`, a `Pooling` whose `config.json`
  switches modes on (`pooling_mode_cls_token`, `_mean_tokens`, ...; an absent key takes the default
  of sentence-transformers' `Pooling`, where mean is on), and optionally `Normalize`. Several modes
  concatenate, in sentence-transformers' order. Any other module (a `Dense` projection, ...) would
  change the embeddings and is refused. `include_prompt` is not applied: the prompt here is part of
  the client's text.
- **Defaults** for a folder without `modules.json`: a decoder's last token (it alone has seen the
  whole input), normalized, as Qwen3-Embedding; an encoder's [CLS] row, normalized.
- **Matryoshka.** `truncate_dims` keeps the first `dims` dimensions and normalizes again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch
import torch.nn.functional as F


class PoolingMode(str, Enum):
    # in the order sentence-transformers concatenates them
    CLS = "cls"
    MAX = "max"
    MEAN = "mean"
    MEAN_SQRT_LEN = "mean_sqrt_len_tokens"
    WEIGHTED_MEAN = "weightedmean"
    LAST_TOKEN = "lasttoken"


# Pooling's config.json key for each mode, and its value when the key is absent
MODE_KEYS = {
    "pooling_mode_cls_token": (PoolingMode.CLS, False),
    "pooling_mode_max_tokens": (PoolingMode.MAX, False),
    "pooling_mode_mean_tokens": (PoolingMode.MEAN, True),
    "pooling_mode_mean_sqrt_len_tokens": (PoolingMode.MEAN_SQRT_LEN, False),
    "pooling_mode_weightedmean_tokens": (PoolingMode.WEIGHTED_MEAN, False),
    "pooling_mode_lasttoken": (PoolingMode.LAST_TOKEN, False),
}

SUPPORTED_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolingConfig:
    modes: tuple[PoolingMode, ...]
    normalize: bool

    def __post_init__(self):
        if not self.modes:
            raise ValueError("a pooling config needs at least one pooling mode")
        order = list(PoolingMode)
        object.__setattr__(self, "modes", tuple(sorted(set(self.modes), key=order.index)))

    def output_dim(self, hidden_size: int) -> int:
        return len(self.modes) * hidden_size


def default_pooling(causal: bool) -> PoolingConfig:
    """A folder without a sentence-transformers config: last token for a decoder, [CLS] for an encoder."""
    return PoolingConfig((PoolingMode.LAST_TOKEN if causal else PoolingMode.CLS,), normalize=True)


def load_pooling_config(model_path: str, causal: bool) -> PoolingConfig:
    """The pooling `model_path`'s modules.json and its Pooling module's config.json say; the
    default (see `default_pooling`) without modules.json. Raises ValueError on a module or a
    pooling mode this runtime does not implement."""
    modules_file = os.path.join(model_path, "modules.json")
    if not os.path.exists(modules_file):
        return default_pooling(causal)
    with open(modules_file) as f:
        modules = json.load(f)
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    if bad := [m["type"] for m, kind in zip(modules, kinds) if kind not in SUPPORTED_MODULES]:
        raise ValueError(f"{modules_file}: modules {bad} are not supported; expected only {list(SUPPORTED_MODULES)}")
    if "Pooling" not in kinds:
        raise ValueError(f"{modules_file} has no Pooling module; the model's output is not a sentence embedding")
    pooling_index = kinds.index("Pooling")
    with open(os.path.join(model_path, modules[pooling_index]["path"], "config.json")) as f:
        fields = json.load(f)
    if unknown := sorted(k for k in fields if k.startswith("pooling_mode") and k not in MODE_KEYS):
        raise ValueError(f"pooling modes {unknown} are not supported; expected among {sorted(MODE_KEYS)}")
    modes = tuple(mode for key, (mode, default) in MODE_KEYS.items() if fields.get(key, default))
    return PoolingConfig(modes, normalize="Normalize" in kinds[pooling_index + 1 :])


class Segments(NamedTuple):
    """The packed batch's sequences: rows starts[i] to ends[i] - 1 are sequence i, and seq[t] is row t's."""

    starts: torch.Tensor  # [B]
    ends: torch.Tensor  # [B]
    lens: torch.Tensor  # [B]
    seq: torch.Tensor  # [T]

    @classmethod
    def of(cls, seq_lens: list[int], device: torch.device) -> Segments:
        assert seq_lens and min(seq_lens) > 0, f"every sequence needs a token: seq_lens={seq_lens}"
        lens = torch.tensor(seq_lens, device=device)
        ends = torch.cumsum(lens, 0)
        return cls(ends - lens, ends, lens, torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lens))


def segment_sum(hidden: torch.Tensor, segs: Segments) -> torch.Tensor:
    return hidden.new_zeros(len(segs.lens), hidden.shape[1]).index_add_(0, segs.seq, hidden)


def segment_max(hidden: torch.Tensor, segs: Segments) -> torch.Tensor:
    index = segs.seq[:, None].expand_as(hidden)
    return hidden.new_full((len(segs.lens), hidden.shape[1]), float("-inf")).scatter_reduce_(0, index, hidden, "amax")


def weighted_mean(hidden: torch.Tensor, segs: Segments) -> torch.Tensor:
    """Weights 1, 2, ..., len by position in the sequence."""
    weights = (torch.arange(hidden.shape[0], device=hidden.device) - segs.starts[segs.seq] + 1).to(hidden.dtype)
    lens = segs.lens.to(hidden.dtype)
    return segment_sum(hidden * weights[:, None], segs) / (lens * (lens + 1) / 2)[:, None]


# mode -> (hidden [T, H], segments) -> [B, H]
POOLERS: dict[PoolingMode, Callable[[torch.Tensor, Segments], torch.Tensor]] = {
    PoolingMode.CLS: lambda hidden, segs: hidden[segs.starts],
    PoolingMode.MAX: segment_max,
    PoolingMode.MEAN: lambda hidden, segs: segment_sum(hidden, segs) / segs.lens.to(hidden.dtype)[:, None],
    PoolingMode.MEAN_SQRT_LEN: lambda hidden, segs: (
        segment_sum(hidden, segs) / segs.lens.to(hidden.dtype).sqrt()[:, None]
    ),
    PoolingMode.WEIGHTED_MEAN: weighted_mean,
    PoolingMode.LAST_TOKEN: lambda hidden, segs: hidden[segs.ends - 1],
}


def pool(hidden: torch.Tensor, seq_lens: list[int], config: PoolingConfig) -> torch.Tensor:
    """Last hidden states [T, H] of sequences packed one after another -> embeddings [B, modes * H]
    in float32, normalized when the config says."""
    hidden = hidden.float()
    segs = Segments.of(seq_lens, hidden.device)
    emb = torch.cat([POOLERS[mode](hidden, segs) for mode in config.modes], dim=-1)
    return F.normalize(emb, dim=-1) if config.normalize else emb


def truncate_dims(emb: torch.Tensor, dims: int) -> torch.Tensor:
    """Matryoshka: the first `dims` dimensions of each embedding [B, D], normalized again."""
    if not 0 < dims <= emb.shape[-1]:
        raise ValueError(f"dimensions={dims} is out of range; these embeddings have {emb.shape[-1]} dimensions")
    return F.normalize(emb[..., :dims], dim=-1)

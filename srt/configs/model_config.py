"""What the runtime needs to know about a model, read from its HF `config.json`."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from transformers import AutoConfig, PretrainedConfig

from srt.configs.errors import ModelLoadError as ModelLoadError  # raised here; its home is the leaf module

logger = logging.getLogger(__name__)


def rope_parameters(hf_config: PretrainedConfig) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either transformers' v5 `rope_parameters` or the older keys."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        rope_type = params.get("rope_type", params.get("type", "default"))
        scaling = None if rope_type == "default" else {**params, "rope_type": rope_type}
        return theta, scaling
    theta = float(getattr(hf_config, "rope_theta", 10000.0))
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling is not None:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return theta, scaling


def load_hf_config(path: str) -> PretrainedConfig:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"no config.json in model folder {path}")
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"cannot read {os.path.join(path, 'config.json')}: {e}") from e


@dataclass
class ModelConfig:
    path: str
    hf_config: PretrainedConfig
    architecture: str
    context_len: int
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    eos_token_ids: set[int] = field(default_factory=set)
    # MLA (DeepSeek-V2/V3): the KV cache holds one latent of kv_lora_rank + qk_rope_head_dim values
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @classmethod
    def from_path(cls, path: str, context_length: int | None = None) -> ModelConfig:
        cfg = load_hf_config(path)
        archs = getattr(cfg, "architectures", None) or []
        if not archs:
            raise ModelLoadError(f"{path}/config.json names no `architectures`")
        # a vision-language model's runtime shape is its text model's (the image encoder has no KV)
        text = cfg.get_text_config()
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        derived = derive_context_len(text)
        if context_length is not None:
            if context_length > derived:
                raise ValueError(
                    f"--context-length {context_length} exceeds the model's maximum of {derived} "
                    f"(max_position_embeddings / sliding window in {path}/config.json)"
                )
            derived = context_length
        return cls(
            path=path,
            hf_config=cfg,
            architecture=archs[0],
            context_len=derived,
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            num_hidden_layers=text.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            eos_token_ids=read_eos_token_ids(path, cfg) | read_eos_token_ids(path, text),
            kv_lora_rank=getattr(text, "kv_lora_rank", None),
            qk_rope_head_dim=int(getattr(text, "qk_rope_head_dim", 0) or 0),
        )

    def num_kv_heads_per_rank(self, tp_size: int, tp_rank: int = 0) -> int:
        """KV heads this rank holds (split whole groups at a time, or replicated; see head_shard)."""
        return head_shard(self.num_attention_heads, self.num_key_value_heads, tp_size, tp_rank).kv_count


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds: query heads [q_start, q_start + q_count) and KV heads
    [kv_start, kv_start + kv_count)."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    """Split heads across ranks whole KV groups at a time (a query head stays with its KV head).

    With at least as many KV heads as ranks the groups are dealt out as evenly as they go, so 3 KV
    heads over 2 ranks is 2 + 1 (uneven, but exact). With fewer, each KV head is replicated on
    tp_size / num_kv_heads ranks, which share its query heads."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv_start, kv_end = tp_rank * num_kv_heads // tp_size, (tp_rank + 1) * num_kv_heads // tp_size
        return HeadShard(kv_start * group, (kv_end - kv_start) * group, kv_start, kv_end - kv_start)
    if tp_size % num_kv_heads or group < tp_size // num_kv_heads:
        raise ValueError(
            f"cannot split {num_heads} attention heads with {num_kv_heads} KV heads over tp_size "
            f"{tp_size}: use a tp_size that divides the KV heads, or a multiple of them no larger "
            f"than the attention heads"
        )
    replicas = tp_size // num_kv_heads
    kv, j = divmod(tp_rank, replicas)
    q_start, q_end = kv * group + j * group // replicas, kv * group + (j + 1) * group // replicas
    return HeadShard(q_start, q_end - q_start, kv, 1)


def derive_context_len(cfg: PretrainedConfig) -> int:
    n = int(getattr(cfg, "max_position_embeddings", 2048))
    # Sliding-window attention is not implemented: cap the context so full attention is exact.
    window = getattr(cfg, "sliding_window", None)
    uses_window = getattr(cfg, "use_sliding_window", True)
    if window and uses_window and window < n:
        logger.warning("model uses sliding-window attention (%d); capping the context length to it", window)
        n = int(window)
    return n


def read_eos_token_ids(path: str, cfg: PretrainedConfig) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(cfg, "eos_token_id", None), _generation_config_eos(path)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return ids


def _generation_config_eos(path: str):
    p = os.path.join(path, "generation_config.json")
    if not os.path.isfile(p):
        return None
    with open(p) as f:
        return json.load(f).get("eos_token_id")

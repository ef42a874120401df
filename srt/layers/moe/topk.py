"""Expert selection: router logits -> (weights, expert ids) per token, as each model family's config
says. Computed in float32 on every rank alike (the router is replicated), so all ranks agree.

- `softmax` scoring (Mixtral, Qwen2/3-MoE, DeepSeek-V2): probabilities over all experts, the top k,
  renormalized to sum to one when the config asks (`norm_topk_prob`; Mixtral always).
- `sigmoid` scoring (DeepSeek-V3): independent scores; the choice adds a per-expert correction bias
  (`e_score_correction_bias`), the weights are the unbiased scores of the chosen experts.
- Groups (DeepSeek): experts form `num_groups` groups; only the `topk_groups` best groups (by their
  best score, or for V3 the sum of their two best biased scores) are eligible.
- `routed_scaling_factor` multiplies the final weights (DeepSeek).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TopKConfig:
    top_k: int
    scoring: str = "softmax"  # or "sigmoid"
    renormalize: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"  # "max": a group's best score; "top2_sum": the sum of its best two (V3)
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported MoE scoring function {self.scoring!r}; supported: softmax, sigmoid")
        if self.num_groups < 1 or self.topk_groups < 1 or self.topk_groups > self.num_groups:
            raise ValueError(f"MoE expert groups: topk_group {self.topk_groups} of n_group {self.num_groups}")


def select_experts(
    router_logits: torch.Tensor, config: TopKConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, ids [T, k] int32)."""
    logits = router_logits.float()
    num_tokens, num_experts = logits.shape
    scores = logits.softmax(dim=-1) if config.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if config.num_groups > 1:
        grouped = choice.view(num_tokens, config.num_groups, num_experts // config.num_groups)
        if config.group_score == "top2_sum":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        groups = group_scores.topk(config.topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        # softmax scores of dropped groups count as 0 (as DeepSeek-V2), biased sigmoid ones as -inf
        choice = choice.masked_fill(~keep, 0.0 if correction_bias is None else float("-inf"))
    ids = choice.topk(config.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if config.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if config.scoring == "sigmoid" else 0.0))
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return weights, ids.to(torch.int32)

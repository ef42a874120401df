from srt.distributed.parallel_state import (
    get_ep_rank,
    get_ep_size,
    get_tp_rank,
    get_tp_size,
    init_tp_group,
    local_rank_only,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

__all__ = [
    "get_ep_rank",
    "get_ep_size",
    "get_tp_rank",
    "get_tp_size",
    "init_tp_group",
    "local_rank_only",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]

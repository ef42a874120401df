"""`--attention-backend triton`: the Triton kernels of kernels/triton_attention.py read K and V in
place from the paged pool through `req_to_token`. The GPU default when triton imports; on a CPU
device only under TRITON_INTERPRET=1 (tests run the kernels through triton's interpreter).

Decode splits each request's KV into `num_kv_splits` parts computed in parallel and merged
(flash-decoding), so that a few long requests still fill the GPU. The split count and the longest
extend are launch parameters: they come from the batch's host-side lengths once per forward pass,
never from a device read per layer. A captured CUDA graph fixes the split count for its batch size
instead: any count is correct for any length, only the speed differs.

An 8-bit KV cache (--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2) is read in place too: the pool's
`kernel_args` hand the kernels its stored buffers, format code and scales, and the kernels decode
in registers. Writes quantize in the pool's `set_kv_buffer`.
"""

from __future__ import annotations

import torch

from srt.configs.runtime_choices import triton_unavailable_reason
from srt.layers.attention.base_attn_backend import AttentionBackend
from srt.layers.attention.registry import register_attention_backend

DEFAULT_NUM_SMS = 132  # H100 / H200; also under the interpreter, so CPU tests split long contexts too


def decode_kv_splits(batch_size: int, max_len: int, num_sms: int = DEFAULT_NUM_SMS) -> int:
    """The kernels' own choice (`choose_num_kv_splits`), rounded down to a power of two: the count
    is a compile-time constant of the kernel, so this bounds the variants compiled while serving."""
    from kernels.triton_attention import choose_num_kv_splits

    n = choose_num_kv_splits(batch_size, max_len, num_sms)
    return 1 << (n.bit_length() - 1)


@register_attention_backend("triton")
class TritonAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, model_runner=None):
        device = model_runner.device if model_runner is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(reason)
        try:
            from kernels import triton_attention
        except ImportError as e:
            raise RuntimeError(f"the Triton attention kernels cannot be imported: {e}") from e
        self.kernels = triton_attention
        self.num_sms = (
            torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            if device == "cuda"
            else DEFAULT_NUM_SMS
        )
        # A captured graph must serve every length up to the context length.
        self.graph_max_len = model_runner.model_config.context_len if model_runner is not None else 1 << 20
        self.num_kv_splits = 1
        self.max_extend_len = 1

    def init_forward_metadata(self, fb) -> None:
        if fb.forward_mode.is_decode():
            self.num_kv_splits = decode_kv_splits(fb.batch_size, max(fb.seq_lens_cpu), self.num_sms)
        else:
            self.max_extend_len = max(fb.extend_seq_lens_cpu)

    def init_forward_metadata_cuda_graph(self, fb) -> None:
        assert fb.forward_mode.is_decode(), "only decode batches are captured"
        self.num_kv_splits = decode_kv_splits(fb.batch_size, self.graph_max_len, self.num_sms)

    def _prepare(self, q, k, v, layer, fb, save_kv_cache: bool):
        """Store the new K/V; returns the layer's pool buffers, the keyword arguments that describe
        their stored format, q as [T, heads, dim] and its output."""
        if save_kv_cache:
            self.save_kv(layer, fb, k, v)
        k_buf, v_buf, k_scales, v_scales, kv_format, k_scale, v_scale = fb.token_to_kv_pool.kernel_args(layer.layer_id)
        fmt = dict(k_scales=k_scales, v_scales=v_scales, kv_format=kv_format, k_scale=k_scale, v_scale=v_scale)
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.head_dim)
        return k_buf, v_buf, fmt, q3, q3.new_empty(q3.shape[0], layer.tp_q_head_num, layer.head_dim)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache: bool = True) -> torch.Tensor:
        k_buf, v_buf, fmt, q3, out = self._prepare(q, k, v, layer, fb, save_kv_cache)
        self.kernels.decode_attention_fwd(
            q3,
            k_buf,
            v_buf,
            out,
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            layer.scaling,
            num_kv_splits=self.num_kv_splits,
            **fmt,
        )
        return out.view(q.shape[0], -1)

    def init_target_verify_metadata(self, fb) -> None:
        """Draft trees: the extend kernel with each request's tree mask (flattened, concatenated)."""
        assert fb.tree_masks is not None, "TARGET_VERIFY batches carry their tree masks"
        self.max_extend_len = max(fb.extend_seq_lens_cpu)
        self.tree_mask = torch.cat([m.reshape(-1) for m in fb.tree_masks]).to(torch.uint8)
        starts, offset = [], 0
        for n in fb.extend_seq_lens_cpu:
            starts.append(offset)
            offset += n * n
        self.tree_mask_starts = torch.tensor(starts, dtype=torch.int64).to(fb.seq_lens.device, non_blocking=True)

    def forward_target_verify(self, q, k, v, layer, fb, save_kv_cache: bool = True) -> torch.Tensor:
        return self.forward_extend(q, k, v, layer, fb, save_kv_cache, tree=True)

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache: bool = True, tree: bool = False) -> torch.Tensor:
        k_buf, v_buf, fmt, q3, out = self._prepare(q, k, v, layer, fb, save_kv_cache)
        if tree:
            fmt.update(tree_mask=self.tree_mask, tree_mask_starts=self.tree_mask_starts)
        self.kernels.extend_attention_fwd(
            q3,
            k_buf,
            v_buf,
            out,
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            fb.extend_prefix_lens,
            fb.extend_start_loc,
            layer.scaling,
            max_extend_len=self.max_extend_len,
            **fmt,
        )
        return out.view(q.shape[0], -1)

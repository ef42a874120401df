"""Triton MLA (multi-head latent attention, absorbed form) over the paged pool: the contracts of
kernels/reference.py `mla_decode_attention` and `mla_extend_attention`.

The pool keeps ONE row per token, shared by every query head (MQA with a single KV head):
`kv_buffer [S, 1, Dk]`, the key is the whole row and the value its first Dv values (Dv = the output's
head dim; DeepSeek: Dk = 576 = kv_lora_rank 512 + rope 64, Dv = 512). Rows are read through
`req_to_token[req_pool_indices[b], position]`, like kernels/triton_attention.py.

The kernels split the row in two: the value part [0, Dv) and the rest [Dv, Dk), each padded to a power
of two (512 and 64 for DeepSeek: no padding). A block of positions is loaded once: its value part feeds
both QK^T (transposed) and PV, its rest only QK^T. Programs take a block of heads, so every row loaded
serves BLOCK_H heads.

Decode is split-KV (flash-decoding): stage 1 runs one program per (request, head block, split) over a
contiguous range of whole BLOCK_N blocks of the request's positions and writes the split's normalized
output and log-sum-exp (float32); stage 2 merges the splits of each (request, head). Extend runs one
program per (head block, token block, request) whose BLOCK_M query rows are BLOCK_T consecutive new
tokens x BLOCK_H heads, flash-attention style over positions 0 up to its last token, causally masked.
No host syncs: grids depend only on shapes (and, for extend, `max_extend_len`).

Numerics: softmax statistics and accumulators are float32, the output is cast once at the store. On the
GPU the dots take the 16-bit storage dtype (probabilities rounded to it for PV, as in flash attention);
float32 inputs use 3xTF32 dots. The interpreter computes everything in float32. (Compiled for sm_90 by
Triton 3.9, the 16-bit kernels of DeepSeek's 576 / 512 rows use no local memory; float32 ones that wide
spill registers under 3xTF32: correct, but slower.)
"""

from __future__ import annotations

import functools

import torch

from kernels.triton_attention import LOG2E, choose_num_kv_splits, decode_merge_kernel
from kernels.triton_ops import check_device, dot_config, interpreting, jit, tl, triton

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# -- shared attention step --------------------------------------------------------------------------


@jit
def _mla_block(
    q_v,
    q_r,
    KV,
    table_row,
    offs_n,
    mask_n,
    allowed,
    offs_dv,
    mask_dv,
    offs_dr,
    mask_dr,
    stride_kvn,
    scale_log2,
    m,
    denom,
    acc,
    HEAD_DIM_V: tl.constexpr,
    HAS_REST: tl.constexpr,
    MMA_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step of the query rows (q_v [rows, BLOCK_DV], q_r [rows, BLOCK_DR]) over the
    positions offs_n; `allowed` [rows, BLOCK_N] masks what each row may see. Returns (m, denom, acc)."""
    slots = tl.load(table_row + offs_n, mask=mask_n, other=0).to(tl.int64)
    rows = KV + slots[:, None] * stride_kvn
    kv = tl.load(rows + offs_dv[None, :], mask=mask_n[:, None] & mask_dv[None, :], other=0.0).to(MMA_DTYPE)
    qk = tl.dot(q_v, tl.trans(kv), input_precision=DOT_PRECISION)  # pyright: ignore[reportArgumentType]
    if HAS_REST:
        kr = tl.load(rows + HEAD_DIM_V + offs_dr[None, :], mask=mask_n[:, None] & mask_dr[None, :], other=0.0).to(
            MMA_DTYPE
        )
        qk = tl.dot(q_r, tl.trans(kr), qk, input_precision=DOT_PRECISION)  # pyright: ignore[reportArgumentType]
    qk = tl.where(allowed, qk * scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(qk - m_new[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(MMA_DTYPE), kv, input_precision=DOT_PRECISION)  # pyright: ignore[reportArgumentType]
    return m_new, denom, acc


@jit
def _load_q(
    Q,
    row_offsets,
    mask_m,
    offs_dv,
    mask_dv,
    offs_dr,
    mask_dr,
    HEAD_DIM_V: tl.constexpr,
    MMA_DTYPE: tl.constexpr,
):
    """The value part and the rest of the query rows at Q + row_offsets."""
    q_ptrs = Q + row_offsets[:, None]
    q_v = tl.load(q_ptrs + offs_dv[None, :], mask=mask_m[:, None] & mask_dv[None, :], other=0.0).to(MMA_DTYPE)
    q_r = tl.load(q_ptrs + HEAD_DIM_V + offs_dr[None, :], mask=mask_m[:, None] & mask_dr[None, :], other=0.0).to(
        MMA_DTYPE
    )
    return q_v, q_r


# -- decode -----------------------------------------------------------------------------------------


@jit
def _mla_decode_split_kernel(
    Q,
    KV,
    req_to_token,
    req_pool_indices,
    seq_lens,
    MidO,
    MidLse,
    scale_log2,
    num_heads,
    stride_qb,
    stride_qh,
    stride_kvn,
    stride_table,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    MMA_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head_block = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_KV_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if end > start:
        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = heads < num_heads
        offs_dv = tl.arange(0, BLOCK_DV)
        offs_dr = tl.arange(0, BLOCK_DR)
        mask_dv = offs_dv < HEAD_DIM_V
        mask_dr = offs_dr < HEAD_DIM_R
        q_v, q_r = _load_q(
            Q,
            b.to(tl.int64) * stride_qb + heads * stride_qh,
            mask_h,
            offs_dv,
            mask_dv,
            offs_dr,
            mask_dr,
            HEAD_DIM_V,
            MMA_DTYPE,
        )
        table_row = req_to_token + tl.load(req_pool_indices + b).to(tl.int64) * stride_table
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            m, denom, acc = _mla_block(
                q_v,
                q_r,
                KV,
                table_row,
                offs_n,
                mask_n,
                mask_n[None, :],
                offs_dv,
                mask_dv,
                offs_dr,
                mask_dr,
                stride_kvn,
                scale_log2,
                m,
                denom,
                acc,
                HEAD_DIM_V,
                HEAD_DIM_R > 0,
                MMA_DTYPE,
                DOT_PRECISION,
            )
        mid = MidO + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_dv[None, :]
        tl.store(mid, acc / denom[:, None], mask=mask_h[:, None] & mask_dv[None, :])
        tl.store(MidLse + b * stride_lb + heads * stride_lh + split, m + tl.log2(denom), mask=mask_h)


# -- extend -----------------------------------------------------------------------------------------


@jit
def _mla_extend_kernel(
    Q,
    KV,
    Out,
    req_to_token,
    req_pool_indices,
    seq_lens,
    prefix_lens,
    start_loc,
    scale_log2,
    num_heads,
    stride_qt,
    stride_qh,
    stride_kvn,
    stride_ot,
    stride_oh,
    stride_table,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    MMA_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head_block = tl.program_id(0)
    t_start = tl.program_id(1) * BLOCK_T
    b = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    prefix = tl.load(prefix_lens + b)
    if t_start < seq_len - prefix:
        # query row r: new token t_start + r // BLOCK_H, head head_block * BLOCK_H + r % BLOCK_H
        r = tl.arange(0, BLOCK_T * BLOCK_H)
        offs_t = t_start + r // BLOCK_H
        heads = head_block * BLOCK_H + r % BLOCK_H
        mask_m = (offs_t < seq_len - prefix) & (heads < num_heads)
        q_pos = prefix + offs_t
        tokens = tl.load(start_loc + b).to(tl.int64) + offs_t
        offs_dv = tl.arange(0, BLOCK_DV)
        offs_dr = tl.arange(0, BLOCK_DR)
        mask_dv = offs_dv < HEAD_DIM_V
        mask_dr = offs_dr < HEAD_DIM_R
        q_v, q_r = _load_q(
            Q,
            tokens * stride_qt + heads * stride_qh,
            mask_m,
            offs_dv,
            mask_dv,
            offs_dr,
            mask_dr,
            HEAD_DIM_V,
            MMA_DTYPE,
        )
        table_row = req_to_token + tl.load(req_pool_indices + b).to(tl.int64) * stride_table
        m = tl.full([BLOCK_T * BLOCK_H], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_T * BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_DV], tl.float32)
        # The loop stops at the block's last token. Position 0, in the first iteration, is visible to
        # every row (padding rows included), so no row's running maximum stays -inf.
        end = tl.minimum(seq_len, prefix + t_start + BLOCK_T)
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            m, denom, acc = _mla_block(
                q_v,
                q_r,
                KV,
                table_row,
                offs_n,
                mask_n,
                mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None]),
                offs_dv,
                mask_dv,
                offs_dr,
                mask_dr,
                stride_kvn,
                scale_log2,
                m,
                denom,
                acc,
                HEAD_DIM_V,
                HEAD_DIM_R > 0,
                MMA_DTYPE,
                DOT_PRECISION,
            )
        out = (acc / denom[:, None]).to(Out.dtype.element_ty)
        tl.store(
            Out + (tokens * stride_ot + heads * stride_oh)[:, None] + offs_dv[None, :],
            out,
            mask=mask_m[:, None] & mask_dv[None, :],
        )


# -- launch --------------------------------------------------------------------------------------------


def _check(name: str, q, kv_buffer, o, req_to_token, tokens_dim: str) -> tuple[int, int]:
    """Shapes, dtypes, strides and devices common to both entry points; returns (Dv, Dk - Dv)."""
    if q.dim() != 3 or kv_buffer.dim() != 3 or o.dim() != 3 or req_to_token.dim() != 2:
        raise ValueError(
            f"{name}: q, kv_buffer and o must be 3-D and req_to_token 2-D, got {tuple(q.shape)}, "
            f"{tuple(kv_buffer.shape)}, {tuple(o.shape)}, {tuple(req_to_token.shape)}"
        )
    head_dim = q.shape[2]
    if kv_buffer.shape[1:] != (1, head_dim):
        raise ValueError(f"{name}: kv_buffer has shape {tuple(kv_buffer.shape)}, expected [S, 1, Dk={head_dim}]")
    head_dim_v = o.shape[2]
    if o.shape[:2] != q.shape[:2] or not 0 < head_dim_v <= head_dim:
        raise ValueError(
            f"{name}: o has shape {tuple(o.shape)}, expected [{tokens_dim}={q.shape[0]}, H={q.shape[1]}, Dv] "
            f"with 0 < Dv <= Dk={head_dim}"
        )
    if q.dtype not in _FLOAT_DTYPES or kv_buffer.dtype != q.dtype or o.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{name}: q and kv_buffer must share a float32/bfloat16/float16 dtype and o be a float, got "
            f"{q.dtype}, {kv_buffer.dtype}, {o.dtype}"
        )
    tensors = {"q": q, "kv_buffer": kv_buffer, "o": o, "req_to_token": req_to_token}
    for t_name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {t_name} must be contiguous in its last dim, got strides {t.stride()}")
    check_device(*tensors.values())
    return head_dim_v, head_dim - head_dim_v


def _dim_blocks(head_dim_v: int, head_dim_r: int) -> tuple[int, int]:
    # tl.dot needs every dim >= 16 on the GPU
    return max(16, triton.next_power_of_2(head_dim_v)), max(16, triton.next_power_of_2(max(head_dim_r, 1)))


def _decode_tiles(heads: int, width: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages) of decode stage 1; width: BLOCK_DV + BLOCK_DR."""
    if interpreting():
        return min(triton.next_power_of_2(heads), 16), 16, 4, 1
    # 16 heads: the smallest tensor-core tile (fewer heads are padded to it)
    if dtype == torch.float32:  # twice the bytes a row, and 3xTF32 splits every operand in two
        return 16, 32 if width <= 256 else 16, 4, 1
    return 16, 64 if width <= 256 else 32, 4, 2


def _extend_tiles(heads: int, width: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_N, num_warps, num_stages): BLOCK_T * BLOCK_H query rows a program;
    width: BLOCK_DV + BLOCK_DR. Wider rows take fewer query rows: a [rows, BLOCK_DV] float32 accumulator
    and [rows | BLOCK_N, width] operand tiles must fit the registers and shared memory."""
    block_h = min(triton.next_power_of_2(heads), 16)
    if interpreting():
        return max(1, 16 // block_h), block_h, 16, 4, 1
    if dtype == torch.float32:
        rows, block_n, warps, stages = (
            (64, 16, 4, 1) if width <= 192 else (32, 16, 4, 1) if width <= 320 else (16, 16, 4, 1)
        )
    elif width <= 192:
        rows, block_n, warps, stages = 64, 64, 4, 2
    elif width <= 320:
        rows, block_n, warps, stages = 64, 32, 8, 2
    else:  # DeepSeek's 512 + 64
        rows, block_n, warps, stages = 32, 64, 8, 1
    return max(1, rows // block_h), block_h, block_n, warps, stages


def mla_decode_fwd(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """One query token per request, at position seq_lens[b] - 1, attending to positions
    0..seq_lens[b] - 1 of request slot req_pool_indices[b] (kernels.reference.mla_decode_attention).
    q [B, H, Dk]; kv_buffer [S, 1, Dk] in q's dtype (key: the whole row, value: its first Dv values);
    o [B, H, Dv] (Dv <= Dk) is written in place and returned; req_to_token [R, L] int32;
    req_pool_indices and seq_lens [B] (int64 or int32), seq_lens >= 1.

    num_kv_splits None chooses with triton_attention's `choose_num_kv_splits`, counting each (request,
    head block) as a program, from the batch's longest context when seq_lens is on the host, else the
    request table's width (a bound known without a device sync)."""
    head_dim_v, head_dim_r = _check("mla_decode_fwd", q, kv_buffer, o, req_to_token, "B")
    batch, heads = q.shape[0], q.shape[1]
    if req_pool_indices.shape != (batch,) or seq_lens.shape != (batch,):
        raise ValueError(
            f"mla_decode_fwd: req_pool_indices {tuple(req_pool_indices.shape)} and seq_lens "
            f"{tuple(seq_lens.shape)} must both be [B={batch}]"
        )
    if batch == 0 or heads == 0:
        return o
    block_dv, block_dr = _dim_blocks(head_dim_v, head_dim_r)
    block_h, block_n, warps, stages = _decode_tiles(heads, block_dv + block_dr, q.dtype)
    head_blocks = triton.cdiv(heads, block_h)
    if num_kv_splits is None:
        max_seq_len = int(seq_lens.max()) if not seq_lens.is_cuda else req_to_token.shape[1]
        num_sms = _num_sms(q.device) if q.is_cuda else 1
        num_kv_splits = choose_num_kv_splits(batch * head_blocks, max(max_seq_len, 1), num_sms)
    if not 1 <= num_kv_splits <= 256:
        raise ValueError(f"mla_decode_fwd: num_kv_splits={num_kv_splits} must be in 1..256")

    mid_o = torch.empty(batch, heads, num_kv_splits, head_dim_v, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, heads, num_kv_splits, dtype=torch.float32, device=q.device)
    # Head blocks vary fastest in the grid: a request's head blocks run together and share its rows in L2.
    _mla_decode_split_kernel[(head_blocks, batch, num_kv_splits)](
        q,
        kv_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        mid_o,
        mid_lse,
        sm_scale * LOG2E,
        heads,
        q.stride(0),
        q.stride(1),
        kv_buffer.stride(0),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        HEAD_DIM_V=head_dim_v,
        HEAD_DIM_R=head_dim_r,
        BLOCK_H=block_h,
        BLOCK_DV=block_dv,
        BLOCK_DR=block_dr,
        BLOCK_N=block_n,
        NUM_KV_SPLITS=num_kv_splits,
        **dot_config(q.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    decode_merge_kernel[(batch, heads)](  # the same log-sum-exp merge as paged attention
        mid_o,
        mid_lse,
        o,
        seq_lens,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        o.stride(0),
        o.stride(1),
        HEAD_DIM_V=head_dim_v,
        BLOCK_DV=block_dv,
        BLOCK_N=block_n,
        NUM_KV_SPLITS=num_kv_splits,
        num_warps=4,
    )
    return o


def mla_extend_fwd(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    sm_scale: float,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """Causal attention for the new tokens of each request, whose rows are already in the pool
    (kernels.reference.mla_extend_attention).

    q [T, H, Dk] packs the new tokens in batch order: request b's seq_lens[b] - extend_prefix_lens[b]
    tokens start at row extend_start_loc[b] and sit at positions extend_prefix_lens[b]..seq_lens[b] - 1;
    the token at position p attends to positions 0..p. kv_buffer [S, 1, Dk] in q's dtype; o [T, H, Dv]
    is written in place (and returned); rows of q that belong to no request are left untouched.
    req_to_token [R, L] int32; req_pool_indices, seq_lens, extend_prefix_lens, extend_start_loc [B]
    (int64 or int32). max_extend_len: the longest extend in the batch, from host data; None computes
    it (one sync)."""
    head_dim_v, head_dim_r = _check("mla_extend_fwd", q, kv_buffer, o, req_to_token, "T")
    batch = seq_lens.shape[0]
    for t_name, t in (
        ("req_pool_indices", req_pool_indices),
        ("seq_lens", seq_lens),
        ("extend_prefix_lens", extend_prefix_lens),
        ("extend_start_loc", extend_start_loc),
    ):
        if t.shape != (batch,):
            raise ValueError(f"mla_extend_fwd: {t_name} has shape {tuple(t.shape)}, expected [B={batch}]")
    if max_extend_len is None:
        max_extend_len = int((seq_lens - extend_prefix_lens).max()) if batch else 0
    heads = q.shape[1]
    if batch == 0 or max_extend_len <= 0 or q.shape[0] == 0 or heads == 0:
        return o
    block_dv, block_dr = _dim_blocks(head_dim_v, head_dim_r)
    block_t, block_h, block_n, warps, stages = _extend_tiles(heads, block_dv + block_dr, q.dtype)
    # Head blocks vary fastest in the grid: a token block's head blocks run together and share its rows in L2.
    grid = (triton.cdiv(heads, block_h), triton.cdiv(max_extend_len, block_t), batch)
    _mla_extend_kernel[grid](
        q,
        kv_buffer,
        o,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_prefix_lens,
        extend_start_loc,
        sm_scale * LOG2E,
        heads,
        q.stride(0),
        q.stride(1),
        kv_buffer.stride(0),
        o.stride(0),
        o.stride(1),
        req_to_token.stride(0),
        HEAD_DIM_V=head_dim_v,
        HEAD_DIM_R=head_dim_r,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_DV=block_dv,
        BLOCK_DR=block_dr,
        **dot_config(q.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return o

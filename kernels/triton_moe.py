"""Fused mixture-of-experts MLP as Triton grouped GEMMs: the contract of kernels/reference.py `fused_moe`.

Each token goes to `topk` experts; the T * topk (token, slot) pairs are numbered pair = t * topk + j.
1. `moe_align_block_size` (torch ops on the device, no host sync) sorts the pairs by expert into groups
   padded to whole BLOCK_M blocks: `sorted_ids` lists the pair of every row of every block (the pad
   value T * topk marks padding rows), `expert_ids` the expert of every block, `num_tokens_post_padded`
   how many rows are in use. Pairs whose expert id is outside [0, E) (experts held by other ranks under
   expert parallelism) are in no block.
2. `_moe_gemm1_kernel`, one program per (block of intermediate columns, row block): gathers the block's
   token rows of x, multiplies them by the gate and the up rows of w13[e] (two float32 accumulators) and
   writes silu(gate) * up, the activation, into act [T * topk, N] at the pair's row (SiLU-and-mul fused
   into the epilogue, computed from the float32 accumulators).
3. `_moe_gemm2_kernel`, one program per (block of output columns, row block): act rows @ w2[e].T, times
   the pair's routing weight, into a float32 [T * topk, K] buffer at the pair's row.
4. `_moe_sum_kernel` adds each token's slots in slot order (deterministic, no atomics), skipping pairs
   with an expert id outside [0, E), and rounds once into the output dtype.

Grids depend only on shapes: the row-block axis covers the largest padded total the routing allows, and
programs past `num_tokens_post_padded` exit at once.

Numerics: float32 accumulation. On the GPU the dots take the 16-bit storage dtype (products exact in the
float32 accumulator), float32 inputs use 3xTF32 (float32 accuracy); the activation is stored in x's
dtype (the second GEMM's operand dtype), the weighted expert outputs in float32. The interpreter
computes everything in float32.
"""

from __future__ import annotations

import torch

from kernels.triton_ops import check_device, dot_config, interpreting, jit, tl, triton

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PARTS_BUDGET_BYTES = 512 << 20  # the float32 weighted expert outputs of one chunk of tokens


# -- align ---------------------------------------------------------------------------------------------


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, expert_ids, num_tokens_post_padded) for topk_ids [T, topk] (any integer dtype).

    sorted_ids [num_blocks * block_m] int32: the pairs (t * topk + j) routed to expert 0, padded with
    T * topk to a multiple of block_m, then expert 1's, ...; pairs of one expert in pair order. Entries
    past num_tokens_post_padded are padding too. expert_ids [num_blocks] int32: each block's expert, -1
    past the used blocks. num_tokens_post_padded [1] int32. num_blocks is a bound from the shapes
    alone (no host sync): every valid pair in a block of its expert, each expert used padded by at most
    block_m - 1 rows."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    max_rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_blocks = -(-max_rows // block_m)
    key = topk_ids.reshape(-1).to(torch.int64)
    key = torch.where((key >= 0) & (key < num_experts), key, num_experts)  # invalid ids sort last
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    # first sorted index of each key 0..E (searchsorted, not bincount: bincount syncs on CUDA)
    bounds = torch.searchsorted(sorted_key, torch.arange(num_experts + 1, device=device, dtype=torch.int64))
    counts = bounds[1:] - bounds[:-1]
    padded_end = torch.cumsum(-(-counts // block_m) * block_m, 0)
    padded_start = padded_end - -(-counts // block_m) * block_m
    expert = sorted_key.clamp(max=max(num_experts - 1, 0))
    pos = padded_start[expert] + torch.arange(num_pairs, device=device) - bounds[expert]
    pos = torch.where(sorted_key < num_experts, pos, num_blocks * block_m)  # the invalid ones: a dump row
    sorted_ids = torch.full((num_blocks * block_m + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, pos, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device, dtype=torch.int64) * block_m
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids[:-1], expert_ids, padded_end[-1:].to(torch.int32)


# -- kernels -------------------------------------------------------------------------------------------


@jit
def _moe_gemm1_kernel(
    X,
    W13,
    Act,
    SortedIds,
    ExpertIds,
    NumPostPadded,
    num_pairs,
    hidden,
    inter,
    stride_xt,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_at,
    TOPK: tl.constexpr,
    MMA_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NumPostPadded):  # past the used blocks
        return
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(SortedIds + offs_m).to(tl.int64)
    mask_m = pairs < num_pairs  # padding rows hold num_pairs
    tokens = pairs // TOPK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xk
    g_ptrs = W13 + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # gate rows.T
    u_ptrs = g_ptrs + inter * stride_wn  # up rows.T
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0).to(MMA_DTYPE)
            wg = tl.load(g_ptrs, mask=mask_n[None, :], other=0.0).to(MMA_DTYPE)
            wu = tl.load(u_ptrs, mask=mask_n[None, :], other=0.0).to(MMA_DTYPE)
        else:
            mask_k = offs_k < hidden - k0
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(MMA_DTYPE)
            wg = tl.load(g_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(MMA_DTYPE)
            wu = tl.load(u_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(MMA_DTYPE)
        acc_g = tl.dot(x, wg, acc_g, input_precision=DOT_PRECISION)  # pyright: ignore[reportArgumentType]
        acc_u = tl.dot(x, wu, acc_u, input_precision=DOT_PRECISION)  # pyright: ignore[reportArgumentType]
        x_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(
        Act + pairs[:, None] * stride_at + offs_n[None, :],
        act.to(Act.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@jit
def _moe_gemm2_kernel(
    Act,
    W2,
    Out,
    SortedIds,
    ExpertIds,
    NumPostPadded,
    TopkWeights,
    num_pairs,
    hidden,
    inter,
    stride_at,
    stride_we,
    stride_wk,
    stride_wn,
    stride_ot,
    MMA_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Out[pair, :] = weight[pair] * act[pair] @ w2[e].T; BLOCK_N output (hidden) columns a program,
    BLOCK_K the chunk of the reduction (intermediate) dim."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NumPostPadded):
        return
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(SortedIds + offs_m).to(tl.int64)
    mask_m = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = Act + pairs[:, None] * stride_at + offs_k[None, :]
    w_ptrs = W2 + expert * stride_we + offs_n[None, :] * stride_wk + offs_k[:, None] * stride_wn  # w2[e].T tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0).to(MMA_DTYPE)
            w = tl.load(w_ptrs, mask=mask_n[None, :], other=0.0).to(MMA_DTYPE)
        else:
            mask_k = offs_k < inter - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(MMA_DTYPE)
            w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(MMA_DTYPE)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)  # pyright: ignore[reportArgumentType]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wn
    weight = tl.load(TopkWeights + pairs, mask=mask_m, other=0.0).to(tl.float32)
    tl.store(
        Out + pairs[:, None] * stride_ot + offs_n[None, :],
        acc * weight[:, None],
        mask=mask_m[:, None] & mask_n[None, :],
    )


@jit
def _moe_sum_kernel(
    Parts,
    TopkIds,
    Out,
    n_tokens,
    hidden,
    num_experts,
    stride_pt,
    stride_ot,
    TOPK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Out[t] = sum over slots j (in order) of Parts[t * TOPK + j], for the slots with a valid expert."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_t = tokens < n_tokens
    mask_k = cols < hidden
    tokens = tokens.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOPK):  # pyright: ignore[reportGeneralTypeIssues]
        expert = tl.load(TopkIds + tokens * TOPK + j, mask=mask_t, other=-1)
        ok = mask_t & (expert >= 0) & (expert < num_experts)  # rows of skipped pairs were never written
        part = tl.load(
            Parts + (tokens * TOPK + j)[:, None] * stride_pt + cols[None, :],
            mask=ok[:, None] & mask_k[None, :],
            other=0.0,
        )
        acc += part
    tl.store(
        Out + tokens[:, None] * stride_ot + cols[None, :],
        acc.to(Out.dtype.element_ty),
        mask=mask_t[:, None] & mask_k[None, :],
    )


# -- launch --------------------------------------------------------------------------------------------


def _moe_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of both GEMMs; BLOCK_M from the mean rows an
    expert gets (decode batches: a 16-row block, the smallest tensor-core tile, per expert)."""
    if interpreting():
        return 16, 32, 32, 4, 1
    per_expert = -(-num_pairs // max(num_experts, 1))
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    block_n = 32 if block_m == 16 else 64
    if dtype == torch.float32:  # 3xTF32 dots: twice the bytes and three MMAs each, so a shorter K chunk
        return block_m, block_n, 32, 4, 2
    return block_m, block_n, 64, 4, 3


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate_e x_t) * up_e x_t), e = topk_ids[t, j],
    skipping ids outside [0, E) (kernels.reference.fused_moe).

    x [T, K] float32 / bfloat16 / float16; w13 [E, 2N, K] (each expert's N gate rows, then its N up
    rows) and w2 [E, K, N] in x's dtype; topk_weights [T, topk] float32; topk_ids [T, topk] int32 or
    int64. Returns out [T, K] in x's dtype: `out` when given (written in place), else a new tensor."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"fused_moe: x must be [T, K], w13 [E, 2N, K] and w2 [E, K, N], got {tuple(x.shape)}, "
            f"{tuple(w13.shape)} and {tuple(w2.shape)}"
        )
    n_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if w13.shape[1] % 2 or w13.shape[2] != hidden or w2.shape != (num_experts, hidden, inter):
        raise ValueError(
            f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}: "
            f"expected w13 [E, 2N, K={hidden}] and w2 [E, K={hidden}, N]"
        )
    if x.dtype not in _FLOAT_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(
            f"fused_moe: x, w13 and w2 must share a float32/bfloat16/float16 dtype, got {x.dtype}, "
            f"{w13.dtype}, {w2.dtype}"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n_tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"fused_moe: topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} "
            f"must both be [T={n_tokens}, topk]"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64) or topk_weights.dtype != torch.float32:
        raise ValueError(
            f"fused_moe: topk_ids must be int32/int64 and topk_weights float32, got {topk_ids.dtype}, "
            f"{topk_weights.dtype}"
        )
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"fused_moe: out is {out.dtype}{tuple(out.shape)} with strides {out.stride()}, expected "
            f"{x.dtype}{tuple(x.shape)} contiguous in its last dim"
        )
    check_device(x, w13, w2, topk_weights, topk_ids, out)
    topk = topk_ids.shape[1]
    num_pairs = n_tokens * topk
    if n_tokens == 0 or hidden == 0:
        return out
    if num_pairs == 0 or num_experts == 0 or inter == 0:
        return out.zero_()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()

    # Chunks of tokens bound the float32 [tokens * topk, K] buffer of weighted expert outputs.
    chunk = max(1, min(n_tokens, PARTS_BUDGET_BYTES // (topk * hidden * 4)))
    act = torch.empty(chunk * topk, inter, dtype=x.dtype, device=x.device)
    parts = torch.empty(chunk * topk, hidden, dtype=torch.float32, device=x.device)
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        _fused_moe_chunk(
            x[start:end], w13, w2, topk_weights[start:end], topk_ids[start:end], out[start:end], act, parts
        )
    return out


def _fused_moe_chunk(x, w13, w2, topk_weights, topk_ids, out, act, parts) -> None:
    """fused_moe over the rows of x (its checks done), with act / parts buffers of at least its pairs' rows."""
    n_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    topk = topk_ids.shape[1]
    num_pairs = n_tokens * topk

    block_m, block_n, block_k, warps, stages = _moe_tiles(num_pairs, num_experts, x.dtype)
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(topk_ids, num_experts, block_m)
    num_blocks = expert_ids.shape[0]
    cfg = dot_config(x.dtype)

    _moe_gemm1_kernel[(triton.cdiv(inter, block_n), num_blocks)](
        x,
        w13,
        act,
        sorted_ids,
        expert_ids,
        num_post_padded,
        num_pairs,
        hidden,
        inter,
        x.stride(0),
        x.stride(1),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        act.stride(0),
        TOPK=topk,
        **cfg,
        EVEN_K=hidden % block_k == 0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    _moe_gemm2_kernel[(triton.cdiv(hidden, block_n), num_blocks)](
        act,
        w2,
        parts,
        sorted_ids,
        expert_ids,
        num_post_padded,
        topk_weights,
        num_pairs,
        hidden,
        inter,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        parts.stride(0),
        **cfg,
        EVEN_K=inter % block_k == 0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    sum_cols = min(triton.next_power_of_2(hidden), 1024)
    sum_rows = max(1, min(4096 // sum_cols, triton.next_power_of_2(n_tokens), 16))
    _moe_sum_kernel[(triton.cdiv(n_tokens, sum_rows), triton.cdiv(hidden, sum_cols))](
        parts,
        topk_ids,
        out,
        n_tokens,
        hidden,
        num_experts,
        parts.stride(0),
        out.stride(0),
        TOPK=topk,
        BLOCK_T=sum_rows,
        BLOCK_K=sum_cols,
        num_warps=4,
    )

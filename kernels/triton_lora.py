"""Segment-batched LoRA (S-LoRA / Punica "SGMV") Triton kernels: one launch applies a different adapter
to each segment of consecutive rows of a batch.

A batch of T rows is cut into G non-overlapping segments: segment g covers rows
[seg_start[g], seg_start[g] + seg_len[g]) and uses adapter slot seg_slot[g]; rows in no segment are
left alone. `sgmv_shrink` computes xa = x @ A[slot].T (the rank-K down projection, K = the stacked
ranks of the fused projections) into a fresh float32 [T, K]; `sgmv_expand` adds xa @ B[slot].T (the
up projection) into `out` in place. The LoRA scaling is the caller's (fold it into A or B).

Grid: (segment, block of the segment's rows, block of output columns), each program looping over the
reduction dim (IN for shrink, K for expand) in masked chunks, so any sizes work. `max_seg_len` (the
longest segment, a host int the scheduler already knows) sizes the row-block axis: no host sync.
Programs past the end of a shorter segment exit at once.

Numerics: products accumulate in float32; expand adds the float32 delta to `out` upcast and rounds once
at the store. On the GPU shrink's dots take the 16-bit storage dtype (exact products in the float32
accumulator) and float32 inputs use 3xTF32 dots (float32 accuracy), as do expand's dots, whose xa is
float32 (B is upcast; exact in TF32 for bfloat16 / float16 weights). The interpreter computes
everything in float32 (it narrows float32 to bfloat16 by truncation at the store, not rounding).

`sgmv_shrink_ref` / `sgmv_expand_ref` are the pure-torch references with the same contracts.
"""

from __future__ import annotations

import torch

from kernels.triton_ops import check_device, dot_config, interpreting, jit, tl, triton

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# -- references ----------------------------------------------------------------------------------------


def _segments(seg_start, seg_len, seg_slot) -> list[tuple[int, int, int]]:
    return list(zip(seg_start.tolist(), seg_len.tolist(), seg_slot.tolist()))


def sgmv_shrink_ref(x, A, seg_start, seg_len, seg_slot, max_seg_len: int) -> torch.Tensor:
    """Pure-torch `sgmv_shrink` (max_seg_len is unused: every row of every segment is computed)."""
    xa = torch.zeros(x.shape[0], A.shape[1], dtype=torch.float32, device=x.device)
    for start, n, slot in _segments(seg_start, seg_len, seg_slot):
        xa[start : start + n] = x[start : start + n].float() @ A[slot].float().T
    return xa


def sgmv_expand_ref(xa, B, seg_start, seg_len, seg_slot, max_seg_len: int, out) -> None:
    """Pure-torch `sgmv_expand` (max_seg_len is unused: every row of every segment is computed)."""
    for start, n, slot in _segments(seg_start, seg_len, seg_slot):
        rows = slice(start, start + n)
        out[rows] = (out[rows].float() + xa[rows].float() @ B[slot].float().T).to(out.dtype)


# -- kernels -------------------------------------------------------------------------------------------


@jit
def _sgmv_shrink_kernel(
    X,
    A,
    XA,
    SegStart,
    SegLen,
    SegSlot,
    in_features,
    rank,
    stride_xt,
    stride_xi,
    stride_as,
    stride_ak,
    stride_ai,
    stride_ot,
    MMA_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_IN: tl.constexpr,
):
    seg = tl.program_id(0)
    seg_n = tl.load(SegLen + seg).to(tl.int64)
    if tl.program_id(1) * BLOCK_M >= seg_n:  # past the end of a shorter segment
        return
    seg_start = tl.load(SegStart + seg).to(tl.int64)
    slot = tl.load(SegSlot + seg).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_i = tl.arange(0, BLOCK_IN)
    mask_m = offs_m < seg_n
    mask_k = offs_k < rank
    rows = seg_start + offs_m
    x_ptrs = X + rows[:, None] * stride_xt + offs_i[None, :] * stride_xi
    a_ptrs = A + slot * stride_as + offs_k[None, :] * stride_ak + offs_i[:, None] * stride_ai  # A[slot].T tile
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for i0 in range(0, in_features, BLOCK_IN):
        mask_i = offs_i < in_features - i0
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_i[None, :], other=0.0).to(MMA_DTYPE)
        a = tl.load(a_ptrs, mask=mask_i[:, None] & mask_k[None, :], other=0.0).to(MMA_DTYPE)
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)  # pyright: ignore[reportArgumentType]
        x_ptrs += BLOCK_IN * stride_xi
        a_ptrs += BLOCK_IN * stride_ai
    tl.store(XA + rows[:, None] * stride_ot + offs_k[None, :], acc, mask=mask_m[:, None] & mask_k[None, :])


@jit
def _sgmv_expand_kernel(
    XA,
    B,
    Out,
    SegStart,
    SegLen,
    SegSlot,
    rank,
    out_features,
    stride_xat,
    stride_xak,
    stride_bs,
    stride_bn,
    stride_bk,
    stride_ot,
    stride_on,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    seg_n = tl.load(SegLen + seg).to(tl.int64)
    if tl.program_id(1) * BLOCK_M >= seg_n:  # past the end of a shorter segment
        return
    seg_start = tl.load(SegStart + seg).to(tl.int64)
    slot = tl.load(SegSlot + seg).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < seg_n
    mask_n = offs_n < out_features
    rows = seg_start + offs_m
    xa_ptrs = XA + rows[:, None] * stride_xat + offs_k[None, :] * stride_xak
    b_ptrs = B + slot * stride_bs + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk  # B[slot].T tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        mask_k = offs_k < rank - k0
        xa = tl.load(xa_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(xa, b, acc, input_precision=DOT_PRECISION)  # pyright: ignore[reportArgumentType]
        xa_ptrs += BLOCK_K * stride_xak
        b_ptrs += BLOCK_K * stride_bk
    out_ptrs = Out + rows[:, None] * stride_ot + offs_n[None, :] * stride_on
    mask = mask_m[:, None] & mask_n[None, :]
    acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=mask)


# -- launch --------------------------------------------------------------------------------------------


def _block(n: int, lo: int, hi: int) -> int:
    return max(lo, min(triton.next_power_of_2(max(n, 1)), hi))


def _block_m(max_seg_len: int) -> int:
    # tl.dot needs every block dim >= 16; decode segments (one row each) waste the rest of the tile
    return _block(max_seg_len, 16, 64)


def _check_segments(name: str, ref: torch.Tensor, seg_start, seg_len, seg_slot, max_seg_len: int) -> int:
    """Validates the segment tensors; returns G."""
    segs = (seg_start, seg_len, seg_slot)
    if any(s.dim() != 1 or s.dtype.is_floating_point or s.dtype == torch.bool for s in segs):
        raise ValueError(
            f"{name}: seg_start, seg_len and seg_slot must be 1-D integer tensors, got "
            + ", ".join(f"{s.dtype}{tuple(s.shape)}" for s in segs)
        )
    if not seg_start.shape == seg_len.shape == seg_slot.shape:
        raise ValueError(
            f"{name}: seg_start, seg_len and seg_slot have shapes {tuple(seg_start.shape)}, "
            f"{tuple(seg_len.shape)}, {tuple(seg_slot.shape)}; expected the same [G]"
        )
    if not all(s.is_contiguous() for s in segs):  # the kernels index them as flat arrays
        raise ValueError(f"{name}: seg_start, seg_len and seg_slot must be contiguous")
    if any(s.device != ref.device for s in segs):
        raise ValueError(f"{name}: the segment tensors must be on {ref.device}, got {[str(s.device) for s in segs]}")
    if max_seg_len < 0:
        raise ValueError(f"{name}: max_seg_len must be >= 0, got {max_seg_len}")
    return seg_start.shape[0]


def sgmv_shrink(x, A, seg_start, seg_len, seg_slot, max_seg_len: int) -> torch.Tensor:
    """xa[T, K] (float32): for each segment g, rows r in [seg_start[g], seg_start[g]+seg_len[g]):
    xa[r] = x[r] @ A[seg_slot[g]].T ; rows in no segment are 0.
    x: [T, IN] (fp32/bf16/fp16), A: [S, K, IN] same dtype as x (S adapter slots, K = stacked ranks),
    seg_start/seg_len/seg_slot: int64 tensors [G] on x's device, max_seg_len: python int (max of seg_len)."""
    if x.dim() != 2 or A.dim() != 3 or A.shape[2] != x.shape[1]:
        raise ValueError(f"sgmv_shrink: x must be [T, IN] and A [S, K, IN], got {tuple(x.shape)} and {tuple(A.shape)}")
    if x.dtype not in _FLOAT_DTYPES or A.dtype != x.dtype:
        raise ValueError(f"sgmv_shrink: x and A must share a float32/bfloat16/float16 dtype, got {x.dtype}, {A.dtype}")
    n_segs = _check_segments("sgmv_shrink", x, seg_start, seg_len, seg_slot, max_seg_len)
    check_device(x, A)
    n_tokens, in_features = x.shape
    rank = A.shape[1]
    xa = torch.zeros(n_tokens, rank, dtype=torch.float32, device=x.device)
    if n_segs == 0 or max_seg_len == 0 or n_tokens == 0 or rank == 0:
        return xa
    block_m, block_k = _block_m(max_seg_len), _block(rank, 16, 64)
    block_in = 128 if x.dtype != torch.float32 or interpreting() else 64
    _sgmv_shrink_kernel[(n_segs, triton.cdiv(max_seg_len, block_m), triton.cdiv(rank, block_k))](
        x,
        A,
        xa,
        seg_start,
        seg_len,
        seg_slot,
        in_features,
        rank,
        x.stride(0),
        x.stride(1),
        A.stride(0),
        A.stride(1),
        A.stride(2),
        xa.stride(0),
        **dot_config(x.dtype),
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        BLOCK_IN=block_in,
        num_warps=4,
        num_stages=2,  # fp32 64x64 tiles: 32 KiB of shared memory a stage
    )
    return xa


def sgmv_expand(xa, B, seg_start, seg_len, seg_slot, max_seg_len: int, out) -> None:
    """In place: out[r] += (xa[r] @ B[seg_slot[g]].T) for rows r of each segment g (accumulate in
    float32, add into out in out's dtype). xa: [T, K] float32, B: [S, OUT, K] in out's dtype, out: [T, OUT]."""
    if xa.dim() != 2 or B.dim() != 3 or out.dim() != 2 or B.shape[2] != xa.shape[1]:
        raise ValueError(
            f"sgmv_expand: xa must be [T, K], B [S, OUT, K] and out [T, OUT], got {tuple(xa.shape)}, "
            f"{tuple(B.shape)} and {tuple(out.shape)}"
        )
    if out.shape != (xa.shape[0], B.shape[1]):
        raise ValueError(f"sgmv_expand: out has shape {tuple(out.shape)}, expected ({xa.shape[0]}, {B.shape[1]})")
    if xa.dtype != torch.float32 or out.dtype not in _FLOAT_DTYPES or B.dtype != out.dtype:
        raise ValueError(
            f"sgmv_expand: xa must be float32 and B share out's float32/bfloat16/float16 dtype, got "
            f"{xa.dtype}, {B.dtype}, {out.dtype}"
        )
    n_segs = _check_segments("sgmv_expand", out, seg_start, seg_len, seg_slot, max_seg_len)
    check_device(xa, B, out)
    n_tokens, rank = xa.shape
    out_features = out.shape[1]
    if n_segs == 0 or max_seg_len == 0 or n_tokens == 0 or rank == 0 or out_features == 0:
        return
    block_m, block_k = _block_m(max_seg_len), _block(rank, 16, 64)
    block_n = 128 if interpreting() else 64
    _sgmv_expand_kernel[(n_segs, triton.cdiv(max_seg_len, block_m), triton.cdiv(out_features, block_n))](
        xa,
        B,
        out,
        seg_start,
        seg_len,
        seg_slot,
        rank,
        out_features,
        xa.stride(0),
        xa.stride(1),
        B.stride(0),
        B.stride(1),
        B.stride(2),
        out.stride(0),
        out.stride(1),
        DOT_PRECISION=dot_config(torch.float32)["DOT_PRECISION"],  # xa is float32
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        num_stages=2,  # fp32 64x64 tiles: 32 KiB of shared memory a stage
    )

"""Triton attention over the paged KV pool: GPU kernels, also run on CPU tensors under
TRITON_INTERPRET=1 (the tests do; see kernels/triton_ops.py).

Same layout and semantics as kernels/reference.py `paged_decode_attention` and
`paged_extend_attention`: every K/V row is read through `req_to_token[req_pool_indices[b], position]`,
so cached prefixes and freshly written tokens are read alike and any page size works.

Decode is split-KV (flash-decoding). Stage 1 runs one program per (request, KV head, split): it
takes a contiguous range of the request's positions and the whole query group of that KV head,
so each K/V row is read once per group, and writes the split's normalized partial output and its
log-sum-exp. Stage 2 merges the splits of each (request, head). Extend runs one program per
(head, block of new tokens, request), flash-attention style over positions 0 up to the block's
last token, causally masked. No host syncs: the grids depend only on shapes (and, for extend,
`max_extend_len`).

Numerics: softmax statistics and accumulators are float32, the output is cast once at the store.
On the GPU the two matmuls take the 16-bit storage dtype (their products are exact in the float32
accumulator; the probabilities are rounded to it for P @ V, as in flash attention); float32 inputs
use 3xTF32 dots (float32 accuracy on tensor cores), not plain TF32. The interpreter computes
everything in float32.

8-bit KV caches (kernels/reference.py defines the formats; `kv_format` is the pool's format code) are
read in place: the kernels load the int8 / uint8 elements, decode them to float32 in registers and
apply the scales, never writing a dequantized copy. int8 (code 1): the per-(slot, KV head) scale
multiplies the QK score for K and the probability for V, so the dots take the integer values (exact
in bfloat16 and float16). fp8 (codes 2 and 3, raw float8_e4m3fn / float8_e5m2 bits in uint8): decoded
by integer bit manipulation (identical in the interpreter and on the GPU, and exact in the 16-bit
MMA dtypes); the per-layer K scale is folded into the softmax scale and the V scale into the output.
`kv_format` is a compile-time constant: code 0 (plain float buffers) compiles to the float-only code.
"""

from __future__ import annotations

import functools

import torch

from kernels.triton_ops import check_device, dot_config, interpreting, jit, tl, triton

LOG2E = 1.4426950408889634
MAX_KV_SPLITS = 16
MIN_TOKENS_PER_SPLIT = 256
DECODE_BLOCK_N = 64  # positions per decode iteration; splits are whole multiples of it
# kv_format codes (srt/mem_cache/memory_pool.py KV_FORMATS) -> the element dtype of the K/V buffers
KV_FORMAT_DTYPES = {1: torch.int8, 2: torch.uint8, 3: torch.uint8}
KV_FORMAT_NAMES = {0: "float", 1: "int8", 2: "fp8_e4m3", 3: "fp8_e5m2"}


def choose_num_kv_splits(batch: int, max_seq_len: int, num_sms: int) -> int:
    """Splits per request for decode: enough that batch x splits programs (times the KV heads)
    cover the GPU's SMs, while each split keeps at least MIN_TOKENS_PER_SPLIT positions to amortize
    the merge, and at most MAX_KV_SPLITS."""
    if batch < 1 or max_seq_len < 1 or num_sms < 1:
        raise ValueError(
            f"choose_num_kv_splits: batch={batch}, max_seq_len={max_seq_len} and num_sms={num_sms} must all be >= 1"
        )
    wanted = -(-num_sms // batch)
    return max(1, min(wanted, max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_KV_SPLITS))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_common(name: str, q, k_buffer, v_buffer, o, req_to_token, tokens_dim: str) -> None:
    if q.dim() != 3 or k_buffer.dim() != 3 or v_buffer.dim() != 3 or o.dim() != 3:
        raise ValueError(
            f"{name}: q, k_buffer, v_buffer and o must be 3-D, got {tuple(q.shape)}, "
            f"{tuple(k_buffer.shape)}, {tuple(v_buffer.shape)}, {tuple(o.shape)}"
        )
    heads, kv_heads = q.shape[1], k_buffer.shape[1]
    if heads % kv_heads or v_buffer.shape[1] != kv_heads:
        raise ValueError(
            f"{name}: {heads} query heads need a multiple of k_buffer's {kv_heads} KV heads "
            f"(v_buffer has {v_buffer.shape[1]})"
        )
    if k_buffer.shape[2] != q.shape[2] or v_buffer.shape[0] != k_buffer.shape[0]:
        raise ValueError(
            f"{name}: k_buffer {tuple(k_buffer.shape)} does not fit q {tuple(q.shape)} "
            f"and v_buffer {tuple(v_buffer.shape)}"
        )
    if o.shape != (q.shape[0], heads, v_buffer.shape[2]):
        raise ValueError(
            f"{name}: o has shape {tuple(o.shape)}, expected "
            f"[{tokens_dim}={q.shape[0]}, H={heads}, Dv={v_buffer.shape[2]}]"
        )
    tensors = {"q": q, "k_buffer": k_buffer, "v_buffer": v_buffer, "o": o, "req_to_token": req_to_token}
    for t_name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {t_name} must be contiguous in its last dim, got strides {t.stride()}")
    check_device(*tensors.values())


def _check_kv_format(name: str, k_buffer, v_buffer, k_scales, v_scales, kv_format: int) -> None:
    """The stored format of the K/V buffers against kv_format, and the int8 scale tensors."""
    if kv_format not in KV_FORMAT_NAMES:
        raise ValueError(f"{name}: kv_format={kv_format!r} must be one of {KV_FORMAT_NAMES}")
    fmt = KV_FORMAT_NAMES[kv_format]
    expected = KV_FORMAT_DTYPES.get(kv_format)
    for t_name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if expected is None and not t.dtype.is_floating_point:
            raise ValueError(
                f"{name}: {t_name} is {t.dtype}, but kv_format=0 reads plain float values; pass the "
                f"format code of a quantized cache (1 int8, 2 fp8_e4m3, 3 fp8_e5m2)"
            )
        if expected is not None and t.dtype != expected:
            raise ValueError(f"{name}: kv_format={kv_format} ({fmt}) stores {expected}, but {t_name} is {t.dtype}")
    if kv_format != 1:
        if k_scales is not None or v_scales is not None:
            raise ValueError(
                f"{name}: k_scales / v_scales are the per-token scales of an int8 cache (kv_format=1), "
                f"got them with kv_format={kv_format} ({fmt})"
            )
        return
    for t_name, t, buf in (("k_scales", k_scales, k_buffer), ("v_scales", v_scales, v_buffer)):
        if t is None:
            raise ValueError(f"{name}: kv_format=1 (int8) needs k_scales and v_scales, got no {t_name}")
        if t.dtype != torch.float32 or t.shape != buf.shape[:2]:
            raise ValueError(
                f"{name}: {t_name} is {t.dtype}{tuple(t.shape)}, expected torch.float32 "
                f"[num_slots={buf.shape[0]}, kv_heads={buf.shape[1]}]"
            )
    check_device(k_scales, v_scales, k_buffer)


def _scale_log2(sm_scale: float, kv_format: int, k_scale: float) -> float:
    """The kernels' score scale (base 2); fp8's per-layer K scale is folded into it."""
    return sm_scale * k_scale * LOG2E if kv_format >= 2 else sm_scale * LOG2E


def _kernel_scale_args(k_scales, v_scales) -> tuple:
    """KS, VS and their (slot, head) strides for the kernels; None and zeros outside int8 (never read)."""
    if k_scales is None or v_scales is None:
        return None, None, 0, 0, 0, 0
    return k_scales, v_scales, k_scales.stride(0), k_scales.stride(1), v_scales.stride(0), v_scales.stride(1)


# -- decode -----------------------------------------------------------------------------------------


@jit
def _kv_to_float(x, KV_FORMAT: tl.constexpr):
    """Stored 8-bit K/V elements -> their float32 values, before any scale. fp8 is decoded from the
    bits: sign, exponent and mantissa moved into a float32 whose exponent bias is 127 instead of 7
    (e4m3) or 15 (e5m2), then rescaled by the bias difference; exact for normals and subnormals. The
    NaN / inf codes are never stored (writes saturate to the format's largest finite value)."""
    if KV_FORMAT == 1:
        f = x.to(tl.float32)
    elif KV_FORMAT == 2:
        u = x.to(tl.int32) & 0xFF
        bits = ((u & 0x80) << 24) | ((u & 0x7F) << 20)
        f = bits.to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2**120
    else:
        u = x.to(tl.int32) & 0xFF
        bits = ((u & 0x80) << 24) | ((u & 0x7F) << 21)
        f = bits.to(tl.float32, bitcast=True) * 5.192296858534828e33  # 2**112
    return f


@jit
def _attend_block(
    q,
    K,
    V,
    KS,
    VS,
    table_row,
    offs_n,
    mask_n,
    allowed,
    kv_head,
    offs_d,
    mask_d,
    offs_dv,
    mask_dv,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ksn,
    stride_ksh,
    stride_vsn,
    stride_vsh,
    scale_log2,
    m,
    denom,
    acc,
    MMA_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    """One online-softmax step over the KV positions offs_n (read through the page-table row):
    `allowed` [rows, BLOCK_N] masks what each query row may see. Returns the updated (m, denom, acc).
    Quantized K/V (KV_FORMAT > 0) are decoded in registers; the int8 scales KS / VS [slot, head] are
    applied to the scores and the probabilities (fp8's per-layer scales are the caller's)."""
    slots = tl.load(table_row + offs_n, mask=mask_n, other=0).to(tl.int64)
    k_ptrs = K + slots[None, :] * stride_kn + kv_head * stride_kh + offs_d[:, None]
    k_mask = mask_n[None, :] & mask_d[:, None]
    if KV_FORMAT == 0:
        k = tl.load(k_ptrs, mask=k_mask, other=0.0).to(MMA_DTYPE)
    else:
        k = _kv_to_float(tl.load(k_ptrs, mask=k_mask, other=0), KV_FORMAT).to(MMA_DTYPE)
    qk = tl.dot(q, k, input_precision=DOT_PRECISION)
    if KV_FORMAT == 1:
        k_scale = tl.load(KS + slots * stride_ksn + kv_head * stride_ksh, mask=mask_n, other=0.0)
        qk = qk * (k_scale * scale_log2)[None, :]
    else:
        qk = qk * scale_log2
    qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(qk - m_new[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    v_ptrs = V + slots[:, None] * stride_vn + kv_head * stride_vh + offs_dv[None, :]
    v_mask = mask_n[:, None] & mask_dv[None, :]
    if KV_FORMAT == 0:
        v = tl.load(v_ptrs, mask=v_mask, other=0.0).to(MMA_DTYPE)
    else:
        v = _kv_to_float(tl.load(v_ptrs, mask=v_mask, other=0), KV_FORMAT).to(MMA_DTYPE)
    if KV_FORMAT == 1:
        p = p * tl.load(VS + slots * stride_vsn + kv_head * stride_vsh, mask=mask_n, other=0.0)[None, :]
    # Inside a triton.jit function a tl.constexpr parameter is its value (here a tl.dtype).
    acc = acc * alpha[:, None] + tl.dot(p.to(MMA_DTYPE), v, input_precision=DOT_PRECISION)  # pyright: ignore[reportArgumentType]
    return m_new, denom, acc


@jit
def _decode_split_kernel(
    Q,
    K,
    V,
    KS,
    VS,
    req_to_token,
    req_pool_indices,
    seq_lens,
    MidO,
    MidLse,
    scale_log2,
    v_scale,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ksn,
    stride_ksh,
    stride_vsn,
    stride_vsh,
    stride_table,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    MMA_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_KV_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if end > start:
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < GROUP
        heads = kv_head * GROUP + offs_h
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_d = offs_d < HEAD_DIM
        mask_dv = offs_dv < HEAD_DIM_V
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :],
            other=0.0,
        ).to(MMA_DTYPE)
        table_row = req_to_token + tl.load(req_pool_indices + b).to(tl.int64) * stride_table
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            m, denom, acc = _attend_block(
                q,
                K,
                V,
                KS,
                VS,
                table_row,
                offs_n,
                mask_n,
                mask_n[None, :],
                kv_head,
                offs_d,
                mask_d,
                offs_dv,
                mask_dv,
                stride_kn,
                stride_kh,
                stride_vn,
                stride_vh,
                stride_ksn,
                stride_ksh,
                stride_vsn,
                stride_vsh,
                scale_log2,
                m,
                denom,
                acc,
                MMA_DTYPE,
                DOT_PRECISION,
                KV_FORMAT,
            )
        mid = MidO + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_dv[None, :]
        out = acc / denom[:, None]
        if KV_FORMAT >= 2:  # fp8: the V scale, applied once to the split's output
            out = out * v_scale
        tl.store(mid, out, mask=mask_h[:, None] & mask_dv[None, :])
        tl.store(MidLse + b * stride_lb + heads * stride_lh + split, m + tl.log2(denom), mask=mask_h)


@jit
def decode_merge_kernel(
    MidO,
    MidLse,
    Out,
    seq_lens,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_KV_SPLITS), BLOCK_N) * BLOCK_N
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < HEAD_DIM_V
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for split in range(NUM_KV_SPLITS):
        if split * split_len < seq_len:  # the same empty splits that stage 1 skipped
            lse = tl.load(MidLse + b * stride_lb + head * stride_lh + split)
            part = tl.load(
                MidO + b * stride_mb + head * stride_mh + split * stride_ms + offs_dv, mask=mask_dv, other=0.0
            )
            m_new = tl.maximum(m, lse)
            alpha = tl.exp2(m - m_new)
            weight = tl.exp2(lse - m_new)
            acc = acc * alpha + part * weight
            total = total * alpha + weight
            m = m_new
    tl.store(Out + b * stride_ob + head * stride_oh + offs_dv, (acc / total).to(Out.dtype.element_ty), mask=mask_dv)


def decode_attention_fwd(
    q,
    k_buffer,
    v_buffer,
    o,
    req_to_token,
    req_pool_indices,
    seq_lens,
    sm_scale,
    num_kv_splits=None,
    *,
    k_scales=None,
    v_scales=None,
    kv_format: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
):
    """One query token per request, at position seq_lens[b] - 1, attending to positions
    0..seq_lens[b] - 1 of request slot req_pool_indices[b]. q [B, H, D]; k_buffer [S, Hkv, D];
    v_buffer [S, Hkv, Dv]; o [B, H, Dv] is written in place (and returned); req_to_token [R, L]
    int32; req_pool_indices and seq_lens [B] int64, seq_lens >= 1.

    num_kv_splits None chooses with `choose_num_kv_splits` from the batch size and the batch's
    longest context when seq_lens is on the host, else the request table's width (an upper bound
    known without a device sync). Each request splits its own context into that many ranges of
    whole DECODE_BLOCK_N blocks, so short requests use fewer splits.

    The K/V buffers hold the pool's stored format `kv_format` (MHATokenToKVPool.kernel_args): 0 plain
    float values; 1 int8 values times k_scales / v_scales [S, Hkv] float32; 2 / 3 the raw bits of
    float8_e4m3fn / float8_e5m2 in uint8, times the per-layer floats k_scale / v_scale (which only the
    fp8 formats use)."""
    _check_common("decode_attention_fwd", q, k_buffer, v_buffer, o, req_to_token, "B")
    _check_kv_format("decode_attention_fwd", k_buffer, v_buffer, k_scales, v_scales, kv_format)
    batch, heads, head_dim = q.shape
    kv_heads, head_dim_v = k_buffer.shape[1], v_buffer.shape[2]
    if req_pool_indices.shape != (batch,) or seq_lens.shape != (batch,):
        raise ValueError(
            f"decode_attention_fwd: req_pool_indices {tuple(req_pool_indices.shape)} and seq_lens "
            f"{tuple(seq_lens.shape)} must both be [B={batch}]"
        )
    if batch == 0:
        return o
    if num_kv_splits is None:
        max_seq_len = int(seq_lens.max()) if not seq_lens.is_cuda else req_to_token.shape[1]
        num_kv_splits = choose_num_kv_splits(batch, max_seq_len, _num_sms(q.device) if q.is_cuda else 1)
    if not 1 <= num_kv_splits <= 256:
        raise ValueError(f"decode_attention_fwd: num_kv_splits={num_kv_splits} must be in 1..256")
    group = heads // kv_heads
    # The query group is padded to 16 rows on the GPU, the smallest tensor-core tile.
    block_h = triton.next_power_of_2(group) if interpreting() else max(16, triton.next_power_of_2(group))
    block_n = DECODE_BLOCK_N
    block_d, block_dv = triton.next_power_of_2(head_dim), triton.next_power_of_2(head_dim_v)

    mid_o = torch.empty(batch, heads, num_kv_splits, head_dim_v, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, heads, num_kv_splits, dtype=torch.float32, device=q.device)
    ks, vs, stride_ksn, stride_ksh, stride_vsn, stride_vsh = _kernel_scale_args(k_scales, v_scales)
    _decode_split_kernel[(batch, kv_heads, num_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        ks,
        vs,
        req_to_token,
        req_pool_indices,
        seq_lens,
        mid_o,
        mid_lse,
        _scale_log2(sm_scale, kv_format, k_scale),
        float(v_scale),
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        stride_ksn,
        stride_ksh,
        stride_vsn,
        stride_vsh,
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        BLOCK_N=block_n,
        NUM_KV_SPLITS=num_kv_splits,
        **dot_config(q.dtype),
        KV_FORMAT=kv_format,
        num_warps=4,
        num_stages=2,
    )
    decode_merge_kernel[(batch, heads)](
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
        num_stages=2,
    )
    return o


# -- extend -----------------------------------------------------------------------------------------


@jit
def _extend_kernel(
    Q,
    K,
    V,
    KS,
    VS,
    Out,
    req_to_token,
    req_pool_indices,
    seq_lens,
    prefix_lens,
    start_loc,
    TreeMask,
    tree_mask_starts,
    scale_log2,
    v_scale,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ksn,
    stride_ksh,
    stride_vsn,
    stride_vsh,
    stride_ot,
    stride_oh,
    stride_table,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    MMA_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    TREE: tl.constexpr,
):
    head = tl.program_id(0)
    block_m = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    prefix = tl.load(prefix_lens + b)
    m_start = block_m * BLOCK_M
    if m_start < seq_len - prefix:
        kv_head = head // GROUP
        offs_m = m_start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < seq_len - prefix
        q_pos = prefix + offs_m
        rows = tl.load(start_loc + b).to(tl.int64) + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_d = offs_d < HEAD_DIM
        mask_dv = offs_dv < HEAD_DIM_V
        q = tl.load(
            Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        ).to(MMA_DTYPE)
        table_row = req_to_token + tl.load(req_pool_indices + b).to(tl.int64) * stride_table
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        # The loop stops at the block's last token. Position 0, in the first iteration, is visible to
        # every row (padding rows included), so no row's running maximum stays -inf.
        end = tl.minimum(seq_len, prefix + m_start + BLOCK_M)
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            if TREE:  # draft tree nodes: the whole prefix, then the node's ancestors (its mask row)
                in_tree = offs_n >= prefix
                nodes = seq_len - prefix
                mask_row = (
                    TreeMask + tl.load(tree_mask_starts + b) + offs_m[:, None] * nodes + (offs_n - prefix)[None, :]
                )
                tree_ok = tl.load(mask_row, mask=mask_m[:, None] & (in_tree & mask_n)[None, :], other=0) != 0
                # padding rows see everything: no row's running maximum stays -inf
                allowed = mask_n[None, :] & ((offs_n < prefix)[None, :] | tree_ok | ~mask_m[:, None])
            else:
                allowed = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
            m, denom, acc = _attend_block(
                q,
                K,
                V,
                KS,
                VS,
                table_row,
                offs_n,
                mask_n,
                allowed,
                kv_head,
                offs_d,
                mask_d,
                offs_dv,
                mask_dv,
                stride_kn,
                stride_kh,
                stride_vn,
                stride_vh,
                stride_ksn,
                stride_ksh,
                stride_vsn,
                stride_vsh,
                scale_log2,
                m,
                denom,
                acc,
                MMA_DTYPE,
                DOT_PRECISION,
                KV_FORMAT,
            )
        out = acc / denom[:, None]
        if KV_FORMAT >= 2:  # fp8: the V scale, applied once to the output
            out = out * v_scale
        out = out.to(Out.dtype.element_ty)
        tl.store(
            Out + rows[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
            out,
            mask=mask_m[:, None] & mask_dv[None, :],
        )


def _extend_tiles(dtype: torch.dtype, block_d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    if interpreting():
        return 64, 64, 4, 1
    if dtype == torch.float32:  # 3xTF32 dots: three MMAs each and twice the bytes, so smaller tiles
        return 64, 16, 4, 1
    if block_d <= 128:
        return 128, 64, 4 if block_d <= 64 else 8, 2
    return 64, 64, 8, 1


def extend_attention_fwd(
    q,
    k_buffer,
    v_buffer,
    o,
    req_to_token,
    req_pool_indices,
    seq_lens,
    extend_prefix_lens,
    extend_start_loc,
    sm_scale,
    max_extend_len=None,
    *,
    k_scales=None,
    v_scales=None,
    kv_format: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tree_mask=None,
    tree_mask_starts=None,
):
    """Causal attention for the new tokens of each request, whose K/V are already in the pool.

    q [T, H, D] packs the new tokens in batch order: request b's seq_lens[b] - extend_prefix_lens[b]
    tokens start at row extend_start_loc[b] and sit at positions extend_prefix_lens[b]..seq_lens[b] - 1;
    the token at position p attends to positions 0..p, all read through req_to_token. o [T, H, Dv] is
    written in place (and returned); rows of q that belong to no request are left untouched.
    req_pool_indices, seq_lens, extend_prefix_lens, extend_start_loc [B] (int64 or int32).
    max_extend_len: the longest extend in the batch, from host data; None computes it (one sync).
    k_scales, v_scales, kv_format, k_scale, v_scale: the stored format, as in decode_attention_fwd.
    tree_mask (speculative verification): the new tokens are draft tree nodes, and instead of
    causally each attends to the whole prefix and to the nodes its row of its request's [n, n] mask
    allows (flattened bool / uint8, request b's from tree_mask_starts[b]; a node's ancestors come
    before it, in BFS order)."""
    _check_common("extend_attention_fwd", q, k_buffer, v_buffer, o, req_to_token, "T")
    _check_kv_format("extend_attention_fwd", k_buffer, v_buffer, k_scales, v_scales, kv_format)
    batch = seq_lens.shape[0]
    for t_name, t in (
        ("req_pool_indices", req_pool_indices),
        ("extend_prefix_lens", extend_prefix_lens),
        ("extend_start_loc", extend_start_loc),
    ):
        if t.shape != (batch,):
            raise ValueError(f"extend_attention_fwd: {t_name} has shape {tuple(t.shape)}, expected [B={batch}]")
    if max_extend_len is None:
        max_extend_len = int((seq_lens - extend_prefix_lens).max()) if batch else 0
    if batch == 0 or max_extend_len <= 0 or q.shape[0] == 0:
        return o
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, head_dim_v = k_buffer.shape[1], v_buffer.shape[2]
    block_d, block_dv = triton.next_power_of_2(head_dim), triton.next_power_of_2(head_dim_v)
    block_m, block_n, warps, stages = _extend_tiles(q.dtype, max(block_d, block_dv))
    # Heads vary fastest in the grid, so a KV head's query group runs together and shares its K/V in L2.
    grid = (heads, triton.cdiv(max_extend_len, block_m), batch)
    ks, vs, stride_ksn, stride_ksh, stride_vsn, stride_vsh = _kernel_scale_args(k_scales, v_scales)
    tree = tree_mask is not None
    if tree and (tree_mask_starts is None or tree_mask_starts.shape != (batch,)):
        raise ValueError("extend_attention_fwd: tree_mask needs tree_mask_starts [B]")
    _extend_kernel[grid](
        q,
        k_buffer,
        v_buffer,
        ks,
        vs,
        o,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_prefix_lens,
        extend_start_loc,
        tree_mask.to(torch.uint8) if tree else seq_lens,  # unread without a tree
        tree_mask_starts if tree else seq_lens,
        _scale_log2(sm_scale, kv_format, k_scale),
        float(v_scale),
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        stride_ksn,
        stride_ksh,
        stride_vsn,
        stride_vsh,
        o.stride(0),
        o.stride(1),
        req_to_token.stride(0),
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        **dot_config(q.dtype),
        KV_FORMAT=kv_format,
        TREE=tree,
        num_warps=warps,
        num_stages=stages,
    )
    return o

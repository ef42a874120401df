"""Triton kernels for the row-wise ops (RMSNorm, SiLU-and-mul), and the launch helpers shared with
kernels/triton_attention.py.

Same contracts as kernels/reference.py. Every kernel loads, upcasts to float32, computes in float32
and casts once at the store, rounding intermediates where the reference rounds them. They run on
CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1, which must be set before triton is first
imported (triton.language decorates its own helpers, tl.sum and the like, at import). Importing this
module needs neither triton nor CUDA; calling a kernel without triton raises ImportError.
"""

# triton and tl are None only where triton is not installed, and then no kernel body or launch helper
# runs (check_device raises first). Kernel parameters annotated `tl.constexpr` are triton.jit's
# compile-time markers, not types.
# pyright: reportOptionalMemberAccess=false, reportInvalidTypeForm=false

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU runtime never launches these kernels
    triton = tl = None

ROW_TILE = 4096  # elements per program: short rows are packed several to a program


def require_triton() -> None:
    if triton is None:
        raise ImportError(
            "the Triton kernels need the `triton` package (pip install triton); "
            "without it use the torch_native or cpu attention backend"
        )


def interpreting() -> bool:
    require_triton()
    from triton import knobs  # a submodule that `import triton` loads without binding it

    return bool(knobs.runtime.interpret)


def dot_config(dtype: torch.dtype) -> dict:
    """Operand dtype and input precision of a kernel's dots over `dtype` inputs: the 16-bit storage
    dtype with float32 accumulation, 3xTF32 (float32 accuracy) for float32, float32 under the interpreter."""
    if interpreting():
        return dict(MMA_DTYPE=tl.float32, DOT_PRECISION="ieee")
    if dtype not in (torch.float16, torch.bfloat16):
        return dict(MMA_DTYPE=tl.float32, DOT_PRECISION="tf32x3")
    return dict(MMA_DTYPE=tl.float16 if dtype == torch.float16 else tl.bfloat16, DOT_PRECISION="tf32")


def check_device(*tensors: torch.Tensor) -> None:
    if not interpreting() and not all(t.is_cuda for t in tensors):
        devices = sorted({str(t.device) for t in tensors})
        raise ValueError(
            f"Triton kernels need CUDA tensors, got {devices}; set TRITON_INTERPRET=1 to run them on CPU tensors"
        )


def jit(fn: Callable[..., Any]) -> Any:
    """`triton.jit` where triton is installed (launched as `kernel[grid](...)`). Without it the kernels
    stay plain functions that are never launched: every wrapper calls `check_device` first, which
    raises ImportError."""
    return triton.jit(fn) if triton is not None else fn


def _row_tiles(n_rows: int, width: int, max_cols: int) -> tuple[int, int, int]:
    """(rows per program, columns per program, num_warps) for a [n_rows, width] row-wise op."""
    cols = min(triton.next_power_of_2(width), max_cols)
    rows = min(max(1, ROW_TILE // cols), triton.next_power_of_2(n_rows), 16)
    return rows, cols, min(max((rows * cols) // 512, 1), 16)


@jit
def _rms_norm_kernel(
    X,
    R,
    W,
    Out,
    ResOut,
    n_rows,
    hidden,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    mask = (rows < n_rows)[:, None] & (cols < hidden)[None, :]
    rows = rows.to(tl.int64)[:, None]
    x = tl.load(X + rows * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(R + rows * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = x.to(X.dtype.element_ty)  # the reference adds in the input dtype and normalizes the rounded sum
        tl.store(ResOut + rows * stride_ro + cols[None, :], x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / hidden + eps)
    normed = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)  # rounded before the weight, as in HF
    w = tl.load(W + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    tl.store(Out + rows * stride_o + cols[None, :], (normed * w[None, :]).to(Out.dtype.element_ty), mask=mask)


@jit
def _silu_and_mul_kernel(X, Out, n_rows, d, stride_x, stride_o, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows < n_rows)[:, None] & (cols < d)[None, :]
    rows = rows.to(tl.int64)[:, None]
    gate = tl.load(X + rows * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + rows * stride_x + d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(Out.dtype.element_ty).to(tl.float32)  # the reference rounds silu first
    tl.store(Out + rows * stride_o + cols[None, :], (silu * up).to(Out.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm(x (+ residual)) * weight over the last dim. With a residual, returns
    (normed, x + residual); the inputs are not modified."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({hidden},)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"rms_norm: residual is {residual.dtype}{tuple(residual.shape)}, expected x's {x.dtype}{tuple(x.shape)}"
        )
    check_device(x, weight, *([] if residual is None else [residual]))
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    x2, o2, ro2 = _as_rows(x), out.view(-1, hidden), res_out.view(-1, hidden)
    r2 = _as_rows(residual) if residual is not None else x2
    n_rows = x2.shape[0]
    if n_rows:
        rows, cols, warps = _row_tiles(n_rows, hidden, max_cols=1 << 20)
        _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
            x2,
            r2,
            weight.contiguous(),
            o2,
            ro2,
            n_rows,
            hidden,
            x2.stride(0),
            r2.stride(0),
            o2.stride(0),
            ro2.stride(0),
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_ROWS=rows,
            BLOCK_COLS=cols,
            num_warps=warps,
        )
    return out if residual is None else (out, res_out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [..., 2 * d] laid out as (gate, up) -> [..., d]."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim must be even (gate, up), got {x.shape[-1]}")
    check_device(x)
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    x2, o2 = _as_rows(x), out.view(-1, d)
    n_rows = x2.shape[0]
    if n_rows and d:
        rows, cols, warps = _row_tiles(n_rows, d, max_cols=1024)
        _silu_and_mul_kernel[(triton.cdiv(n_rows, rows), triton.cdiv(d, cols))](
            x2, o2, n_rows, d, x2.stride(0), o2.stride(0), BLOCK_ROWS=rows, BLOCK_COLS=cols, num_warps=warps
        )
    return out

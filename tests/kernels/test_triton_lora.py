"""The segment-batched LoRA kernels (kernels/triton_lora.py) against their pure-torch references, and
the references against an explicit per-row loop: under the Triton interpreter on CPU tensors when there
is no GPU, natively on CUDA tensors when there is one."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede triton's import (see kernels/triton_ops.py); tests/conftest.py sets it too.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from kernels.triton_lora import (  # noqa: E402
    sgmv_expand,
    sgmv_expand_ref,
    sgmv_shrink,
    sgmv_shrink_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Shrink multiplies 16-bit inputs exactly into a float32 accumulator (in the interpreter and on the
# GPU alike), so xa matches the float32 reference to float32 rounding whatever the input dtype.
XA_TOL: dict[str, Any] = dict(atol=1e-4, rtol=1e-4)


def out_tol(dtype) -> dict[str, Any]:
    """Expand rounds the float32 sum once into out's dtype: within one ulp of the reference's rounding
    (the interpreter truncates where the GPU and the reference round to nearest)."""
    if dtype == torch.float32:
        return dict(atol=1e-4, rtol=1e-4)
    return dict(atol=1e-5, rtol=2**-7 if dtype == torch.bfloat16 else 2**-10)


# (T, segments as (start, len, slot)): rows outside every segment must be left alone
SEVERAL = (40, [(0, 5, 2), (5, 20, 0), (25, 0, 1), (30, 7, 1)])  # rows 25-29 and 37-39 in none
ONE_LONG = (70, [(0, 70, 1)])  # two row blocks
DECODE = (9, [(r, 1, s) for r, s in zip(range(8), [0, 2, 2, 1, 0, 0, 1, 2])])  # one row each; row 8 in none
NONE = (6, [])
CASES = {"several": SEVERAL, "one_long": ONE_LONG, "decode": DECODE, "none": NONE}


def segments(segs, device=DEVICE):
    cols = list(zip(*segs)) if segs else [(), (), ()]
    start, length, slot = (torch.tensor(c, dtype=torch.int64, device=device) for c in cols)
    return start, length, slot, max((n for _, n, _ in segs), default=0)


def covered(n_tokens, segs) -> torch.Tensor:
    mask = torch.zeros(n_tokens, dtype=torch.bool)
    for start, n, _ in segs:
        mask[start : start + n] = True
    return mask.to(DEVICE)


def make(n_tokens, in_features, rank, out_features, dtype, slots=3, seed=0):
    """x [T, IN], A [S, K, IN], B [S, OUT, K], out [T, OUT], scaled so that xa and the delta are O(1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, in_features, generator=g)
    A = torch.randn(slots, rank, in_features, generator=g) / in_features**0.5
    B = torch.randn(slots, out_features, rank, generator=g) / rank**0.5
    out = torch.randn(n_tokens, out_features, generator=g)
    return (t.to(dtype).to(DEVICE) for t in (x, A, B, out))


# -- kernels against the references --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("in_features,rank", [(72, 24), (200, 80)])  # K 24: one masked block; 80: two
def test_shrink_matches_reference(dtype, case, in_features, rank):
    n_tokens, segs = CASES[case]
    x, A, _, _ = make(n_tokens, in_features, rank, 8, dtype, seed=rank)
    seg = segments(segs)
    xa = sgmv_shrink(x, A, *seg)
    assert xa.dtype == torch.float32 and xa.shape == (n_tokens, rank)
    torch.testing.assert_close(xa, sgmv_shrink_ref(x, A, *seg), **XA_TOL)
    assert not xa[~covered(n_tokens, segs)].any()  # rows in no segment are exactly zero


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rank,out_features", [(24, 72), (80, 200)])  # OUT 200: two column blocks
def test_expand_matches_reference(dtype, case, rank, out_features):
    n_tokens, segs = CASES[case]
    _, _, B, out = make(n_tokens, 8, rank, out_features, dtype, seed=rank + 1)
    xa = torch.randn(n_tokens, rank, generator=torch.Generator().manual_seed(rank)).to(DEVICE)
    seg = segments(segs)
    before, ref = out.clone(), out.clone()
    assert sgmv_expand(xa, B, *seg, out) is None
    sgmv_expand_ref(xa, B, *seg, ref)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **out_tol(dtype))
    gap = ~covered(n_tokens, segs)
    assert torch.equal(out[gap], before[gap])  # rows in no segment are untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_shrink_then_expand_matches_reference(dtype):
    n_tokens, segs = SEVERAL
    x, A, B, out = make(n_tokens, 136, 40, 96, dtype, seed=7)
    seg = segments(segs)
    before, ref = out.clone(), out.clone()
    sgmv_expand(sgmv_shrink(x, A, *seg), B, *seg, out)
    sgmv_expand_ref(sgmv_shrink_ref(x, A, *seg), B, *seg, ref)
    torch.testing.assert_close(out, ref, **out_tol(dtype))
    gap = ~covered(n_tokens, segs)
    assert torch.equal(out[gap], before[gap])
    assert not torch.equal(out[~gap], before[~gap])


def test_expand_into_a_column_slice():
    # e.g. the q columns of a fused qkv output: strided rows, the other columns untouched
    n_tokens, segs = SEVERAL
    _, _, B, full = make(n_tokens, 8, 16, 100, torch.float32, seed=3)
    xa = torch.randn(n_tokens, 16, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    seg = segments(segs)
    before = full.clone()
    out = full[:, 30:90]
    ref = out.clone()
    sgmv_expand(xa, B[:, :60], *seg, out)
    sgmv_expand_ref(xa, B[:, :60], *seg, ref)
    torch.testing.assert_close(out, ref, **out_tol(torch.float32))
    assert torch.equal(full[:, :30], before[:, :30]) and torch.equal(full[:, 90:], before[:, 90:])


def test_shrink_reads_a_transposed_adapter_stack():
    n_tokens, segs = SEVERAL
    x, A, _, _ = make(n_tokens, 48, 20, 8, torch.float32, seed=4)
    A_t = A.transpose(1, 2).contiguous().transpose(1, 2)  # same values, IN-major storage
    seg = segments(segs)
    torch.testing.assert_close(sgmv_shrink(x, A_t, *seg), sgmv_shrink_ref(x, A, *seg), **XA_TOL)


def test_zero_segments_launch_nothing():
    x, A, B, out = make(5, 16, 8, 12, torch.float32)
    seg = segments([])
    before = out.clone()
    assert torch.equal(sgmv_shrink(x, A, *seg), torch.zeros(5, 8, device=DEVICE))
    sgmv_expand(torch.ones(5, 8, device=DEVICE), B, *seg, out)
    assert torch.equal(out, before)


def test_rejects_bad_arguments():
    x, A, B, out = make(6, 16, 8, 12, torch.float32)
    seg = segments([(0, 6, 0)])
    with pytest.raises(ValueError, match="share a float32/bfloat16/float16 dtype"):
        sgmv_shrink(x, A.to(torch.bfloat16), *seg)
    with pytest.raises(ValueError, match=r"A \[S, K, IN\]"):
        sgmv_shrink(x, A[:, :, :8], *seg)
    with pytest.raises(ValueError, match=r"out has shape \(6, 11\)"):
        sgmv_expand(torch.zeros(6, 8, device=DEVICE), B, *seg, out[:, :11])
    with pytest.raises(ValueError, match="xa must be float32"):
        sgmv_expand(torch.zeros(6, 8, device=DEVICE, dtype=torch.bfloat16), B, *seg, out)
    with pytest.raises(ValueError, match="1-D integer tensors"):
        sgmv_shrink(x, A, seg[0].float(), *seg[1:])
    with pytest.raises(ValueError, match="expected the same"):
        sgmv_shrink(x, A, seg[0], seg[1][:0], *seg[2:])


# -- the references against an explicit per-row loop --------------------------------------------------


def per_row(n_tokens, segs):
    """Each row's adapter slot, or None for rows in no segment."""
    slot_of: list[int | None] = [None] * n_tokens
    for start, n, slot in segs:
        for r in range(start, start + n):
            slot_of[r] = slot
    return slot_of


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_references_match_a_per_row_loop(dtype, case):
    n_tokens, segs = CASES[case]
    x, A, B, out = make(n_tokens, 40, 12, 20, dtype, seed=11)
    seg = segments(segs)
    xa = sgmv_shrink_ref(x, A, *seg)
    ref_out = out.clone()
    sgmv_expand_ref(xa, B, *seg, ref_out)
    want_xa = torch.zeros(n_tokens, 12, dtype=torch.float64)
    want_out = out.cpu().clone()
    for r, slot in enumerate(per_row(n_tokens, segs)):
        if slot is None:
            continue
        for k in range(12):
            want_xa[r, k] = sum(float(x[r, i]) * float(A[slot, k, i]) for i in range(40))
        delta = B[slot].double().cpu() @ xa[r].double().cpu()
        want_out[r] = (out[r].double().cpu() + delta).to(dtype)
    torch.testing.assert_close(xa.cpu().double(), want_xa, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref_out.cpu(), want_out, **out_tol(dtype))


# -- without triton --------------------------------------------------------------------------------------


def test_module_imports_without_triton():
    code = (
        "import sys, torch; sys.modules['triton'] = None\n"
        "from kernels import triton_lora as L\n"
        "seg = torch.tensor([0]), torch.tensor([2]), torch.tensor([0])\n"
        "assert L.sgmv_shrink_ref(torch.ones(2, 4), torch.ones(1, 3, 4), *seg, 2).sum() == 24\n"
        "try:\n"
        "    L.sgmv_shrink(torch.ones(2, 4), torch.ones(1, 3, 4), *seg, 2)\n"
        "except ImportError as e:\n"
        "    assert 'pip install triton' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no ImportError')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# -- GPU, real shapes ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_real_shapes(dtype):
    # a mixed batch: two prefills, decode rows with repeated slots, rows of a request without LoRA
    lens = [300, 1, 1, 1, 129, 1, 1]
    slots = [3, 0, 3, 7, 0, 5, 5]
    starts = [sum(lens[:i]) + (20 if i >= 4 else 0) for i in range(len(lens))]  # 20 rows in no segment
    n_tokens = starts[-1] + lens[-1] + 3
    segs = list(zip(starts, lens, slots))
    seg = segments(segs)
    for in_features, rank, out_features in [(1536, 192, 3072), (576, 8, 576), (3072, 64, 1536)]:
        x, A, B, out = make(n_tokens, in_features, rank, out_features, dtype, slots=8, seed=rank)
        before, ref = out.clone(), out.clone()
        torch.cuda.set_sync_debug_mode("error")  # no host syncs inside the wrappers
        try:
            xa = sgmv_shrink(x, A, *seg)
            sgmv_expand(xa, B, *seg, out)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        xa_ref = sgmv_shrink_ref(x, A, *seg)
        sgmv_expand_ref(xa_ref, B, *seg, ref)
        torch.testing.assert_close(xa, xa_ref, atol=5e-4, rtol=5e-4)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        gap = ~covered(n_tokens, segs)
        assert torch.equal(out[gap], before[gap])

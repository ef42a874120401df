"""The Triton kernels against the pure-torch references in kernels/reference.py: under the Triton
interpreter on CPU tensors when there is no GPU, natively on CUDA tensors when there is one."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede triton's import (see kernels/triton_ops.py); tests/conftest.py sets it too, before
    # anything else in the session (xgrammar) can import triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from conftest import random_tree_mask  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.triton_attention import (  # noqa: E402
    _kv_to_float,
    choose_num_kv_splits,
    decode_attention_fwd,
    extend_attention_fwd,
)
from kernels.triton_ops import rms_norm, silu_and_mul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GQA = [(8, 2), (4, 4)]  # (heads, kv_heads)


def tol(dtype):
    if dtype == torch.float32:  # on the GPU float32 dots run as 3xTF32: float32-level, not bit-exact
        return dict(atol=5e-5, rtol=5e-5) if DEVICE == "cuda" else dict(atol=2e-5, rtol=2e-5)
    return dict(atol=2e-2, rtol=2e-2)


def make_pool(page, kv_heads, seq_lens, dtype, seed, head_dim=64, device=DEVICE):
    """A KV pool holding each request's tokens the way a paged allocator places them: whole pages
    of `page` consecutive slots, the pages scattered through the pool, request slots shuffled."""
    g = torch.Generator().manual_seed(seed)
    pages_needed = sum(-(-n // page) for n in seq_lens) + 3
    slots_total = (pages_needed + 1) * page
    k = torch.randn(slots_total, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(slots_total, kv_heads, head_dim, generator=g).to(dtype)
    k[:page], v[:page] = float("nan"), float("nan")  # page 0, where unused table entries point, must never be read
    pages = (torch.randperm(pages_needed, generator=g) + 1).tolist()
    table = torch.zeros(len(seq_lens) + 2, max(seq_lens) + page, dtype=torch.int32)
    rows = list(range(len(seq_lens) + 2))
    random.Random(seed).shuffle(rows)
    rows = rows[: len(seq_lens)]
    for r, n in zip(rows, seq_lens):
        own = torch.tensor([pages.pop() for _ in range(-(-n // page))], dtype=torch.int32)
        pos = torch.arange(n, dtype=torch.int32)
        table[r, :n] = own[pos // page] * page + pos % page
    return k.to(device), v.to(device), table.to(device), torch.tensor(rows, device=device)


# --kv-cache-dtype formats -> the kernels' kv_format code (srt/mem_cache/memory_pool.py KV_FORMATS)
KV_FORMAT_CODES = {"bfloat16": 0, "int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}
FP8_KV_SCALES = (0.02, 0.01)  # K, V: randn / scale spans most of e4m3's range (and reaches its subnormals)


def store_kv(k, v, kv_format, page) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any], torch.Tensor, torch.Tensor]:
    """make_pool's float32 K/V in a stored format. Returns the buffers the kernels read, the format's
    keyword arguments for them, and the float32 values (`dequantize_kv` of the whole buffers) the
    reference reads. Page 0 stays poisoned: NaN int8 scales, fp8's largest finite code."""
    if KV_FORMAT_CODES[kv_format] == 0:
        kq, vq = k.to(getattr(torch, kv_format)), v.to(getattr(torch, kv_format))
        return kq, vq, {}, kq.float(), vq.float()
    k_scale, v_scale = FP8_KV_SCALES if kv_format in reference.FP8_FORMATS else (1.0, 1.0)
    k, v = k.clone(), v.clone()
    k[:page], v[:page] = 1e30, 1e30  # saturates fp8; int8 rows get huge scales, replaced by NaN below
    kq, ks = reference.quantize_kv(k, kv_format, k_scale)
    vq, vs = reference.quantize_kv(v, kv_format, v_scale)
    if ks is not None and vs is not None:
        ks[:page], vs[:page] = float("nan"), float("nan")
    fmt = dict(k_scales=ks, v_scales=vs, kv_format=KV_FORMAT_CODES[kv_format], k_scale=k_scale, v_scale=v_scale)
    kd = reference.dequantize_kv(kq, ks, kv_format, k_scale)
    vd = reference.dequantize_kv(vq, vs, kv_format, v_scale)
    return kq, vq, fmt, kd, vd


def run_decode(dtype, page, heads, kv_heads, seq_lens, head_dim=64, num_kv_splits=None, seed=0, kv_format=None):
    """dtype: of q and o, and of the K/V buffers unless kv_format names a stored format."""
    k, v, table, rows = make_pool(page, kv_heads, seq_lens, torch.float32 if kv_format else dtype, seed, head_dim)
    k, v, fmt, k_ref, v_ref = store_kv(k, v, kv_format, page) if kv_format else (k, v, {}, k.float(), v.float())
    q = torch.randn(len(seq_lens), heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    q, lens = q.to(DEVICE), torch.tensor(seq_lens, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    decode_attention_fwd(q, k, v, out, table, rows, lens, head_dim**-0.5, num_kv_splits, **fmt)
    ref = reference.paged_decode_attention(q.float(), k_ref, v_ref, table, rows, lens, head_dim**-0.5)
    return out, ref


def run_extend(
    dtype, page, heads, kv_heads, prefix, ext, head_dim=64, seed=0, pass_max_extend_len=True, kv_format=None
):
    seq = [p + e for p, e in zip(prefix, ext)]
    k, v, table, rows = make_pool(page, kv_heads, seq, torch.float32 if kv_format else dtype, seed, head_dim)
    k, v, fmt, k_ref, v_ref = store_kv(k, v, kv_format, page) if kv_format else (k, v, {}, k.float(), v.float())
    q = torch.randn(sum(ext) + 1, heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    q = q.to(DEVICE)
    starts = torch.tensor([sum(ext[:i]) for i in range(len(ext))], device=DEVICE)
    lens, prefix_lens = torch.tensor(seq, device=DEVICE), torch.tensor(prefix, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    max_len = max(ext) if pass_max_extend_len else None
    extend_attention_fwd(q, k, v, out, table, rows, lens, prefix_lens, starts, head_dim**-0.5, max_len, **fmt)
    assert out[-1].isnan().all(), "the row after the last request's tokens must stay untouched"
    ref = reference.paged_extend_attention(q[:-1].float(), k_ref, v_ref, table, rows, lens, prefix_lens, head_dim**-0.5)
    return out[:-1], ref


# -- decode ------------------------------------------------------------------------------------------

DECODE_LENS = [1, 7, 33, 300, 64, 130]  # ragged: one token, partial and whole blocks, a long context


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_matches_reference(dtype, page, heads, kv_heads, splits):
    out, ref = run_decode(dtype, page, heads, kv_heads, DECODE_LENS, num_kv_splits=splits, seed=page + heads)
    torch.testing.assert_close(out.float(), ref, **tol(dtype))


def test_decode_many_splits_some_empty():
    # 9 splits of whole blocks: the 300-token request fills some, the short ones leave most empty
    out, ref = run_decode(torch.float32, 16, 8, 2, [300, 2, 40, 1], num_kv_splits=9)
    torch.testing.assert_close(out, ref, **tol(torch.float32))


def test_decode_default_splits():
    out, ref = run_decode(torch.float32, 1, 8, 2, DECODE_LENS)
    torch.testing.assert_close(out, ref, **tol(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_non_power_of_two_head_dim(dtype):
    out, ref = run_decode(dtype, 16, 6, 2, [5, 90, 33], head_dim=80, num_kv_splits=3)
    torch.testing.assert_close(out.float(), ref, **tol(dtype))


def test_choose_num_kv_splits():
    assert choose_num_kv_splits(1, 100, 132) == 1  # too short to split
    assert choose_num_kv_splits(1, 4096, 132) == 16  # one long request: as many as allowed
    assert choose_num_kv_splits(1, 1024, 132) == 4  # at least 256 positions per split
    assert choose_num_kv_splits(64, 4096, 132) == 3  # a big batch fills the SMs by itself
    assert choose_num_kv_splits(256, 32768, 132) == 1
    assert choose_num_kv_splits(4, 4096, 1) == 1
    with pytest.raises(ValueError, match="batch=0"):
        choose_num_kv_splits(0, 100, 132)


def test_decode_rejects_bad_shapes():
    q = torch.zeros(2, 6, 64, device=DEVICE)
    k = torch.zeros(10, 4, 64, device=DEVICE)
    table, idx = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of k_buffer's 4 KV heads"):
        decode_attention_fwd(q, k, k, torch.empty_like(q), table, idx, idx + 1, 1.0)
    with pytest.raises(ValueError, match="o has shape"):
        decode_attention_fwd(q[:, :4], k, k, torch.empty(2, 4, 32, device=DEVICE), table, idx, idx + 1, 1.0)


# -- extend ------------------------------------------------------------------------------------------

EXTEND_PREFIX = [0, 0, 17, 100, 3, 64]  # no prefix, short and page-aligned prefixes
EXTEND_LENS = [40, 1, 25, 9, 1, 70]  # ragged, with one-token rows as in a mixed batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_extend_matches_reference(dtype, page, heads, kv_heads):
    out, ref = run_extend(dtype, page, heads, kv_heads, EXTEND_PREFIX, EXTEND_LENS, seed=page + heads)
    torch.testing.assert_close(out.float(), ref, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_non_power_of_two_head_dim(dtype):
    out, ref = run_extend(dtype, 16, 6, 2, [0, 20], [33, 12], head_dim=80)
    torch.testing.assert_close(out.float(), ref, **tol(dtype))


def test_extend_skips_fully_cached_requests():
    # a request with nothing new (prefix == seq_len) owns no rows of q and must not disturb the others
    out, ref = run_extend(torch.float32, 1, 4, 2, [5, 12, 0], [3, 0, 7], pass_max_extend_len=False)
    torch.testing.assert_close(out, ref, **tol(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 16])
def test_tree_verify_matches_reference(dtype, page):
    """Draft trees (speculative verification): each node sees its request's whole prefix, read in
    place, and its ancestors by its row of the tree mask."""
    prefix, nodes = [17, 100, 3, 64], [5, 8, 1, 12]
    seq = [p + n for p, n in zip(prefix, nodes)]
    k, v, table, rows = make_pool(page, 2, seq, dtype, seed=page)
    g = random.Random(page)
    masks = [random_tree_mask(n, g) for n in nodes]
    q = torch.randn(sum(nodes), 8, 64, generator=torch.Generator().manual_seed(page)).to(dtype).to(DEVICE)
    starts = torch.tensor([sum(nodes[:i]) for i in range(len(nodes))], device=DEVICE)
    mask_starts = torch.tensor([sum(n * n for n in nodes[:i]) for i in range(len(nodes))], device=DEVICE)
    lens, prefix_lens = torch.tensor(seq, device=DEVICE), torch.tensor(prefix, device=DEVICE)
    out = torch.empty_like(q)
    flat = torch.cat([m.reshape(-1) for m in masks]).to(DEVICE)
    extend_attention_fwd(
        q, k, v, out, table, rows, lens, prefix_lens, starts, 64**-0.5, max(nodes),
        tree_mask=flat, tree_mask_starts=mask_starts,
    )  # fmt: skip
    ref = reference.paged_tree_attention(
        q.float(), k.float(), v.float(), table, rows, lens, prefix_lens, masks, 64**-0.5
    )
    torch.testing.assert_close(out.float(), ref, **tol(dtype))


def test_value_head_dim_differs_from_key_head_dim():
    # the references assume Dv == D: zero-padding V to D and dropping the padding gives the same result
    k, v_full, table, rows = make_pool(16, 2, [70, 5], torch.float32, seed=5)
    v = v_full[..., :24].contiguous()
    v_padded = torch.cat([v, torch.zeros_like(v_full[..., 24:])], dim=-1)
    q = torch.randn(2, 4, 64, device=DEVICE)
    lens = torch.tensor([70, 5], device=DEVICE)
    out = decode_attention_fwd(q, k, v, torch.empty(2, 4, 24, device=DEVICE), table, rows, lens, 0.125, 2)
    ref = reference.paged_decode_attention(q, k, v_padded, table, rows, lens, 0.125)[..., :24]
    torch.testing.assert_close(out, ref, **tol(torch.float32))
    prefix = torch.tensor([60, 0], device=DEVICE)
    starts = torch.tensor([0, 10], device=DEVICE)
    q = torch.randn(15, 4, 64, device=DEVICE)
    out = extend_attention_fwd(q, k, v, torch.empty(15, 4, 24, device=DEVICE), table, rows, lens, prefix, starts, 0.125)
    ref = reference.paged_extend_attention(q, k, v_padded, table, rows, lens, prefix, 0.125)[..., :24]
    torch.testing.assert_close(out, ref, **tol(torch.float32))


# -- 8-bit KV caches ---------------------------------------------------------------------------------

# The kernels and the reference read identical decoded values: float32 q matches to float32 rounding.
QUANT_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: tol(torch.bfloat16)}


@triton.jit
def _kv_to_float_kernel(X, Y, N: tl.constexpr, KV_FORMAT: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, _kv_to_float(tl.load(X + offs), KV_FORMAT))


@pytest.mark.parametrize("kv_format", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_kv_decoding_matches_torch_for_every_code(kv_format):
    # all 256 codes: zeros of both signs, fp8 subnormals, normals, the largest finite values
    codes = torch.arange(256, dtype=torch.uint8)
    if kv_format == "int8":
        codes = codes.view(torch.int8)
        expected = codes.float()
    else:
        expected = codes.view(reference.FP8_FORMATS[kv_format][0]).float()
    got = torch.full((256,), float("nan"), device=DEVICE)
    _kv_to_float_kernel[(1,)](codes.to(DEVICE), got, N=256, KV_FORMAT=KV_FORMAT_CODES[kv_format])
    finite = expected.isfinite()  # the NaN (and e5m2's inf) codes are never stored: writes saturate
    assert int(finite.sum()) == {"int8": 256, "fp8_e4m3": 254, "fp8_e5m2": 248}[kv_format]
    assert torch.equal(got.cpu()[finite], expected[finite])
    assert torch.equal(got.cpu()[finite].signbit(), expected[finite].signbit())
    if kv_format == "fp8_e4m3":
        assert float(got[1]) == 2.0**-9 and float(got[0x7E]) == 448.0  # smallest subnormal, largest value


DECODE_CASES = [  # page, heads, kv_heads (GQA 3, 8, 1), ragged lens, splits, head dim, q dtype
    (1, 6, 2, [1, 7, 70, 33], 2, 64, torch.float32),
    (16, 8, 1, [130, 5, 16], 3, 48, torch.float32),
    (16, 2, 2, [40, 1, 17], None, 64, torch.bfloat16),
]
EXTEND_CASES = [  # page, heads, kv_heads, cached prefixes, new tokens, head dim, q dtype
    (1, 6, 2, [0, 17, 64], [40, 1, 9], 64, torch.float32),
    (16, 8, 1, [3, 0, 100], [25, 1, 30], 48, torch.float32),
    (16, 2, 2, [0, 20], [12, 5], 64, torch.bfloat16),
]


@pytest.mark.parametrize("kv_format", list(KV_FORMAT_CODES))
def test_decode_reads_stored_kv_formats(kv_format):
    for i, (page, heads, kv_heads, lens, splits, head_dim, dtype) in enumerate(DECODE_CASES):
        out, ref = run_decode(dtype, page, heads, kv_heads, lens, head_dim, splits, seed=i, kv_format=kv_format)
        torch.testing.assert_close(out.float(), ref.float(), **QUANT_TOL[dtype], msg=lambda m, i=i: f"case {i}: {m}")


@pytest.mark.parametrize("kv_format", list(KV_FORMAT_CODES))
def test_extend_reads_stored_kv_formats(kv_format):
    for i, (page, heads, kv_heads, prefix, ext, head_dim, dtype) in enumerate(EXTEND_CASES):
        out, ref = run_extend(dtype, page, heads, kv_heads, prefix, ext, head_dim, seed=i, kv_format=kv_format)
        torch.testing.assert_close(out.float(), ref.float(), **QUANT_TOL[dtype], msg=lambda m, i=i: f"case {i}: {m}")


def test_stored_kv_format_arguments_are_checked():
    q = torch.zeros(2, 4, 16, device=DEVICE)
    o = torch.empty_like(q)
    table, idx = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE)
    i8 = torch.zeros(10, 2, 16, dtype=torch.int8, device=DEVICE)
    u8 = torch.zeros(10, 2, 16, dtype=torch.uint8, device=DEVICE)
    scales = torch.ones(10, 2, device=DEVICE)
    bad: list[tuple[dict[str, Any], str]] = [
        (dict(k=u8, kv_format=0), "kv_format=0 reads plain float values"),
        (dict(k=i8, kv_format=0), "kv_format=0 reads plain float values"),
        (dict(k=i8, kv_format=1), "needs k_scales and v_scales, got no k_scales"),
        (dict(k=i8, kv_format=1, k_scales=scales), "got no v_scales"),
        (dict(k=i8, kv_format=1, k_scales=scales[:5], v_scales=scales), r"k_scales is torch.float32\(5, 2\)"),
        (dict(k=i8, kv_format=1, k_scales=scales, v_scales=scales.half()), "v_scales is torch.float16"),
        (dict(k=u8, kv_format=1, k_scales=scales, v_scales=scales), r"kv_format=1 \(int8\) stores torch.int8"),
        (dict(k=i8, kv_format=2), r"kv_format=2 \(fp8_e4m3\) stores torch.uint8, but k_buffer is torch.int8"),
        (dict(k=u8, kv_format=3, k_scales=scales, v_scales=scales), "per-token scales of an int8 cache"),
        (dict(k=u8, kv_format=4), "kv_format=4 must be one of"),
    ]
    for kw, match in bad:
        k = kw.pop("k")
        with pytest.raises(ValueError, match=match):
            decode_attention_fwd(q, k, k, o, table, idx, idx + 1, 1.0, 1, **kw)
        with pytest.raises(ValueError, match=match.replace("decode", "extend")):
            extend_attention_fwd(q, k, k, o, table, idx, idx + 1, idx, idx, 1.0, 1, **kw)
    with pytest.raises(ValueError, match="^decode_attention_fwd: v_buffer is torch.uint8"):
        decode_attention_fwd(q, q.new_zeros(10, 2, 16), u8, o, table, idx, idx + 1, 1.0, 1)


# -- row-wise ops ------------------------------------------------------------------------------------


# The interpreter narrows float32 to bfloat16 by truncation, not rounding, so the comparisons with
# the reference's own bfloat16 rounding are bit-exact only on the GPU.
EXACT_BF16 = DEVICE == "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn(5, 3, 96, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype).to(DEVICE)
    x_in, res_in = x.clone(), res.clone()
    got = rms_norm(x, w, 1e-5, res if with_residual else None)
    ref32 = reference.rms_norm(x.float(), w.float(), 1e-5, res.float() if with_residual else None)
    ref = reference.rms_norm(x, w, 1e-5, res if with_residual else None)
    if with_residual:
        assert got[1].dtype == dtype
        torch.testing.assert_close(got[1].float(), ref32[1], **tol(dtype))
        if EXACT_BF16 or dtype == torch.float32:
            torch.testing.assert_close(got[1], ref[1], atol=0, rtol=0)  # the same rounded sum
        got, ref32, ref = got[0], ref32[0], ref[0]
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), ref32, **tol(dtype))
    if EXACT_BF16 and dtype == torch.bfloat16:  # rounded where the reference rounds: within one ulp of it
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=2**-7)
    assert torch.equal(x, x_in) and torch.equal(res, res_in)


def test_rms_norm_mixed_dtypes_promote_like_the_reference():
    x = torch.randn(4, 64).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(64, device=DEVICE)
    got = rms_norm(x, w, 1e-6)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference.rms_norm(x, w, 1e-6), **tol(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(dtype):
    x = (torch.randn(2, 7, 2 * 72, generator=torch.Generator().manual_seed(4)) * 4).to(dtype).to(DEVICE)
    got = silu_and_mul(x)
    assert got.shape == (2, 7, 72) and got.dtype == dtype
    torch.testing.assert_close(got.float(), reference.silu_and_mul(x.float()), **tol(dtype))
    if EXACT_BF16 and dtype == torch.bfloat16:
        torch.testing.assert_close(got, reference.silu_and_mul(x), atol=1e-6, rtol=2**-7)


# -- without triton ----------------------------------------------------------------------------------


def test_modules_import_without_triton():
    code = (
        "import sys, torch; sys.modules['triton'] = None\n"
        "from kernels import triton_attention, triton_ops\n"
        "assert triton_attention.choose_num_kv_splits(1, 4096, 132) == 16\n"
        "try:\n"
        "    triton_ops.silu_and_mul(torch.zeros(2, 4))\n"
        "except ImportError as e:\n"
        "    assert 'pip install triton' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no ImportError')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# -- GPU, real shapes --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page", [1, 16])
def test_gpu_real_shapes_bf16(page):
    heads, kv_heads, head_dim = 32, 8, 128
    gen = random.Random(page)
    decode_lens = [gen.randint(1, 4096) for _ in range(62)] + [1, 4096]
    k, v, table, rows = make_pool(page, kv_heads, decode_lens, torch.bfloat16, seed=page, head_dim=head_dim)
    q = torch.randn(len(decode_lens), heads, head_dim, device="cuda").to(torch.bfloat16)
    lens = torch.tensor(decode_lens, device="cuda")
    for batch in (64, 2):  # the default split count: 3 for the full batch, 16 for two requests
        out = torch.empty_like(q[:batch])
        torch.cuda.set_sync_debug_mode("error")  # no host syncs inside the kernels' wrappers
        try:
            decode_attention_fwd(q[:batch], k, v, out, table, rows[:batch], lens[:batch], head_dim**-0.5)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref = reference.paged_decode_attention(
            q[:batch].float(), k.float(), v.float(), table, rows[:batch], lens[:batch], head_dim**-0.5
        )
        torch.testing.assert_close(out.float(), ref, **tol(torch.bfloat16))

    prefix = [0, 0, 1000, 2048, 17, 3000, 64, 511]
    ext = [4096, 1, 1000, 300, 2000, 1, 129, 1024]
    seq = [p + e for p, e in zip(prefix, ext)]
    k, v, table, rows = make_pool(page, kv_heads, seq, torch.bfloat16, seed=page + 1, head_dim=head_dim)
    q = torch.randn(sum(ext), heads, head_dim, device="cuda").to(torch.bfloat16)
    starts = torch.tensor([sum(ext[:i]) for i in range(len(ext))], device="cuda")
    lens, prefix_lens = torch.tensor(seq, device="cuda"), torch.tensor(prefix, device="cuda")
    out = torch.empty_like(q)
    torch.cuda.set_sync_debug_mode("error")
    try:
        extend_attention_fwd(q, k, v, out, table, rows, lens, prefix_lens, starts, head_dim**-0.5, max(ext))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = reference.paged_extend_attention(
        q.float(), k.float(), v.float(), table, rows, lens, prefix_lens, head_dim**-0.5
    )
    torch.testing.assert_close(out.float(), ref, **tol(torch.bfloat16))

    x, res = (torch.randn(4096, 4096, device="cuda").to(torch.bfloat16) for _ in range(2))
    w = torch.randn(4096, device="cuda").to(torch.bfloat16)
    normed, summed = rms_norm(x, w, 1e-6, res)
    ref_normed, ref_summed = reference.rms_norm(x.float(), w.float(), 1e-6, res.float())
    torch.testing.assert_close(normed.float(), ref_normed, **tol(torch.bfloat16))
    torch.testing.assert_close(summed.float(), ref_summed, **tol(torch.bfloat16))
    y = torch.randn(4096, 2 * 14336, device="cuda").to(torch.bfloat16)
    torch.testing.assert_close(silu_and_mul(y).float(), reference.silu_and_mul(y.float()), **tol(torch.bfloat16))

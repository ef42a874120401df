"""The C++ CPU attention kernels against the pure-torch references in kernels/reference.py."""

import random

import numpy as np
import pytest
import torch
from conftest import isa_variants, random_tree_mask

from kernels import cpu as cpu_kernels
from kernels import reference
from srt.configs.runtime_choices import cache_root
from srt.mem_cache.memory_pool import KV_FORMATS as KV_STORE  # format -> (buffer dtype, kernel code)

D = 32
KV_FORMATS = ["float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"]
# (query heads per KV head, head_dim): GQA ratios 1/3/4/8 over the generic and unrolled head dims
SHAPES = [(1, 64), (3, 64), (4, 32), (8, 128)]


def make_pool(page, kv_heads, seq_lens, dtype, seed, d=D):
    """A KV pool holding each request's tokens at scattered, page-aligned slots."""
    g = torch.Generator().manual_seed(seed)
    pages_needed = sum(-(-n // page) for n in seq_lens) + 3
    slots_total = (pages_needed + 1) * page
    k = torch.randn(slots_total, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(slots_total, kv_heads, d, generator=g).to(dtype)
    pages = (torch.randperm(pages_needed, generator=g) + 1).tolist()
    table = torch.zeros(len(seq_lens) + 2, max(seq_lens) + page, dtype=torch.int32)
    rows = list(range(len(seq_lens) + 2))
    random.Random(seed).shuffle(rows)
    rows = rows[: len(seq_lens)]
    for r, n in zip(rows, seq_lens):
        for pos in range(n):
            if pos % page == 0:
                cur = pages.pop()
            table[r, pos] = cur * page + pos % page
    return k, v, table, torch.tensor(rows)


def stored(k, v, kv_format):
    """(kernel cache arguments, K and V as the float values they decode to) for a format. fp8 gets
    non-unit scales so that their use is tested."""
    k_scale, v_scale = (0.05, 0.02) if kv_format.startswith("fp8") else (1.0, 1.0)
    kd, ks = reference.quantize_kv(k, kv_format, k_scale)
    vd, vs = reference.quantize_kv(v, kv_format, v_scale)
    code = KV_STORE[kv_format][1]
    kf = reference.dequantize_kv(kd, ks, kv_format, k_scale)
    vf = reference.dequantize_kv(vd, vs, kv_format, v_scale)
    return (kd, vd, ks, vs, code, k_scale, v_scale), kf, vf


@pytest.mark.parametrize("kv_format", KV_FORMATS)
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("group,head_dim", SHAPES)
def test_decode_matches_reference(ops, kv_format, page, group, head_dim):
    """Every ISA variant reads every format in place and matches the reference over the decoded
    values, with and without split contexts."""
    kv_heads = 2
    seq_lens = [1, 7, 33, 300, 64, 1000]  # ragged, one-token and long contexts
    k, v, table, rows = make_pool(page, kv_heads, seq_lens, torch.float32, seed=group * 10 + page, d=head_dim)
    cache, kf, vf = stored(k, v, kv_format)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim)
    ref = reference.paged_decode_attention(q, kf, vf, table, rows, torch.tensor(seq_lens), head_dim**-0.5)
    with isa_variants(ops, highest="avx512") as isas:  # avx512_bf16 runs the avx512 attention
        for isa in isas:
            for splits in (1, 3):
                out = torch.empty_like(q)
                ops.decode_attention(q, *cache, table, rows, torch.tensor(seq_lens), out, head_dim**-0.5, splits)
                torch.testing.assert_close(
                    out, ref, atol=3e-5, rtol=3e-5, msg=lambda m, i=isa, n=splits: f"{i}, {n} splits: {m}"
                )


@pytest.mark.parametrize("kv_format", KV_FORMATS)
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("group,head_dim", SHAPES)
def test_extend_matches_reference(ops, kv_format, page, group, head_dim):
    kv_heads = 2
    prefix = [0, 0, 17, 500, 3, 64]  # empty, short and long cached prefixes
    ext = [40, 1, 25, 9, 1, 70]  # ragged, including one-token (mixed-batch decode) rows
    seq = [p + e for p, e in zip(prefix, ext)]
    k, v, table, rows = make_pool(page, kv_heads, seq, torch.float32, seed=group + page, d=head_dim)
    cache, kf, vf = stored(k, v, kv_format)
    q = torch.randn(sum(ext), kv_heads * group, head_dim)
    starts = torch.tensor([sum(ext[:i]) for i in range(len(ext))])
    ref = reference.paged_extend_attention(
        q, kf, vf, table, rows, torch.tensor(seq), torch.tensor(prefix), head_dim**-0.5
    )
    with isa_variants(ops, highest="avx512") as isas:  # avx512_bf16 runs the avx512 attention
        for isa in isas:
            out = torch.empty_like(q)
            ops.extend_attention(
                q, *cache, table, rows, torch.tensor(seq), starts, torch.tensor(ext), out, head_dim**-0.5
            )
            torch.testing.assert_close(out, ref, atol=3e-5, rtol=3e-5, msg=lambda m, i=isa: f"{i}: {m}")


@pytest.mark.parametrize("kv_format", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("group,head_dim", SHAPES)
def test_tree_attention_matches_reference(ops, kv_format, page, group, head_dim):
    """Draft trees verified in place: every node sees its request's whole prefix and its ancestors."""
    kv_heads = 2
    prefix = [0, 17, 500, 3, 64]
    nodes = [5, 8, 1, 12, 3]
    seq = [p + e for p, e in zip(prefix, nodes)]
    k, v, table, rows = make_pool(page, kv_heads, seq, torch.float32, seed=7 * group + page, d=head_dim)
    cache, kf, vf = stored(k, v, kv_format)
    q = torch.randn(sum(nodes), kv_heads * group, head_dim)
    starts = torch.tensor([sum(nodes[:i]) for i in range(len(nodes))])
    g = random.Random(group + page)
    masks = [random_tree_mask(n, g) for n in nodes]
    ref = reference.paged_tree_attention(
        q, kf, vf, table, rows, torch.tensor(seq), torch.tensor(prefix), masks, head_dim**-0.5
    )
    flat = torch.cat([m.reshape(-1) for m in masks])
    with isa_variants(ops, highest="avx512") as isas:
        for isa in isas:
            out = torch.empty_like(q)
            ops.tree_attention(
                q, *cache, table, rows, torch.tensor(seq), starts, torch.tensor(nodes), flat, out, head_dim**-0.5
            )
            torch.testing.assert_close(out, ref, atol=3e-5, rtol=3e-5, msg=lambda m, i=isa: f"{i}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_queries(ops, dtype):
    """bf16 queries and outputs over a bf16 cache (a bf16 model's decode)."""
    seq_lens = [5, 200]
    k, v, table, rows = make_pool(16, 2, seq_lens, dtype, seed=3)
    q = torch.randn(2, 6, D).to(dtype)
    out = torch.empty_like(q)
    ops.decode_attention(q, k, v, None, None, 0, 1.0, 1.0, table, rows, torch.tensor(seq_lens), out, D**-0.5, 2)
    ref = reference.paged_decode_attention(
        q.float(), k.float(), v.float(), table, rows, torch.tensor(seq_lens), D**-0.5
    )
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_format", KV_FORMATS)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_kv_store_is_bit_identical_to_the_reference_quantizer(ops, kv_format, src_dtype):
    """The C++ writer and kernels/reference.py's quantize_kv store the same bytes and scales,
    including all-zero rows, values beyond the fp8 range and exact ties."""
    g = torch.Generator().manual_seed(1)
    t, heads, d = 37, 3, 64
    k = (torch.randn(t, heads, d, generator=g) * 30).to(src_dtype)
    v = (torch.randn(t, heads, d, generator=g) * 0.01).to(src_dtype)
    k[3] = 0
    k[4, 0, :2] = torch.tensor([1e6, -1e6])
    v[5, 1] = torch.arange(d) - d / 2  # ties at x.5 after scaling
    slots = 64
    buf_dtype, code = KV_STORE[kv_format]
    kb, vb = torch.zeros(slots, heads, d, dtype=buf_dtype), torch.zeros(slots, heads, d, dtype=buf_dtype)
    ks = vs = None
    if kv_format == "int8":
        ks, vs = torch.zeros(slots, heads), torch.zeros(slots, heads)
    k_scale, v_scale = (0.37, 3.0) if kv_format.startswith("fp8") else (1.0, 1.0)
    loc = torch.randperm(slots, generator=g)[:t]
    ops.kv_store(kb, vb, ks, vs, code, k_scale, v_scale, loc, k, v)
    ek, eks = reference.quantize_kv(k, kv_format, k_scale)
    ev, evs = reference.quantize_kv(v, kv_format, v_scale)
    assert torch.equal(kb[loc], ek) and torch.equal(vb[loc], ev)
    if kv_format == "int8":
        assert ks is not None and vs is not None and eks is not None and evs is not None
        assert torch.equal(ks[loc], eks) and torch.equal(vs[loc], evs)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[loc] = False
    assert not kb[untouched].any() and not vb[untouched].any()


def test_cached_build_is_reused(ops):
    import os

    assert os.path.exists(os.path.join(cpu_kernels.build_dir(cache_root()), "radixserve_cpu.so"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_matches_reference(ops, dtype):
    x = torch.randn(37, 96).to(dtype)
    res = torch.randn(37, 96).to(dtype)
    w = torch.randn(96).to(dtype)
    ref_out, ref_res = reference.rms_norm(x, w, 1e-5, res)
    a, r = x.clone(), res.clone()
    ops.rms_norm(a, r, w, 1e-5)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(r, ref_res)
    torch.testing.assert_close(a, ref_out, **tol)
    b = x.clone()
    ops.rms_norm(b, None, w, 1e-5)
    torch.testing.assert_close(b, reference.rms_norm(x, w, 1e-5), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_and_mul_matches_reference(ops, dtype):
    x = (torch.randn(19, 2 * 80) * 4).to(dtype)
    out = torch.empty(19, 80, dtype=dtype)
    ops.silu_and_mul(out, x)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, reference.silu_and_mul(x), **tol)


def test_bf16_silu_and_mul_rounds_like_torch(ops):
    """bf16 SiLU-and-mul (vectorized through bit conversions, in pieces of 256): silu rounded to bf16,
    then the product rounded to bf16, as torch computes it in bf16; rows longer than one piece."""
    x = (torch.randn(23, 2 * 600, generator=torch.Generator().manual_seed(1)) * 4).bfloat16()
    x[0, 0], x[1, 3] = float("inf"), -float("inf")
    out = torch.empty(23, 600, dtype=torch.bfloat16)
    ops.silu_and_mul(out, x)
    want = torch.nn.functional.silu(x[:, :600]) * x[:, 600:]
    ok = torch.isfinite(want)
    diff = (out.float() - want.float()).abs()
    assert (diff[ok] <= want.float().abs()[ok] * 2.0**-7 + 1e-30).all()  # one bf16 step at most (the exp differs)
    assert (out[ok] == want[ok]).float().mean() > 0.99


@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_fused_rotary_matches_reference(ops, rotary_dim):
    from srt.layers.rotary_embedding import RotaryEmbedding, default_inv_freq

    head_dim, heads = 32, 3
    rope = RotaryEmbedding(head_dim, rotary_dim, 512, 10000.0, None)
    qkv = torch.randn(9, 2 * heads * head_dim)
    pos = torch.tensor([0, 1, 2, 100, 511, 7, 7, 300, 42])
    q = qkv[:, : heads * head_dim]  # a strided slice, like the runtime's fused QKV output
    expect = reference.rotary_embedding(pos, q.clone(), head_dim, rotary_dim, default_inv_freq(10000.0, rotary_dim))
    ops.rotary_neox(q, pos, rope.cos_cache, rope.sin_cache, head_dim)
    torch.testing.assert_close(q, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("nbytes", [0, 8, 1000, 4096 * 8 * 3 + 72, 1 << 20])
def test_stream_read(ops, nbytes):
    """bench_roofline's memory reader reads every 64-bit word once, whatever the slices of the threads:
    it returns their XOR (a length that is not a multiple of 8 leaves its last bytes out)."""
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    words = buf[: nbytes // 8 * 8].numpy().view(np.uint64)
    expect = int(np.bitwise_xor.reduce(words)) if len(words) else 0
    assert ops.stream_read(buf) & (2**64 - 1) == expect
    with pytest.raises(RuntimeError, match="contiguous CPU uint8"):
        ops.stream_read(buf.float())


@pytest.mark.parametrize("threads", [1, 2])
def test_phased_read(ops, threads):
    """bench_roofline's phase-by-phase reader reads every word of the phases' bytes once, in the order
    given, whatever each thread's slice of each phase (phases of one line, of a few, of none, and of
    more lines than threads split evenly); it refuses phases that are not whole lines or that run past
    the buffer."""
    buf = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    phases = [64, 0, 640, 64 * 1001, 4096 * 7 + 192, 64 * 3]
    words = buf[: sum(phases)].numpy().view(np.uint64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert ops.phased_read(buf, phases) & (2**64 - 1) == int(np.bitwise_xor.reduce(words))
        assert ops.phased_read(buf, []) == 0
        with pytest.raises(RuntimeError, match="multiples of 64 bytes, got 100"):
            ops.phased_read(buf, [64, 100])
        with pytest.raises(RuntimeError, match="exceed the buffer"):
            ops.phased_read(buf, [1 << 20, 64])
    finally:
        torch.set_num_threads(before)


def test_barrier_ns(ops):
    """bench_roofline's reading of where the threads sit: a positive time per barrier with two threads,
    0 with one (no barrier to time) or no rounds. (No upper bound: with the suite's other worker busy on
    the same two cores a barrier waits for a descheduled thread, ~2 ms once.)"""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert 0 < ops.barrier_ns(200) < float("inf")
        assert ops.barrier_ns(0) == 0
        torch.set_num_threads(1)
        assert ops.barrier_ns(200) == 0
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 33, 49152, 49157])
def test_argmax_rows_is_torch_argmax(ops, n):
    """The greedy sampler's C++ argmax gives torch.argmax's index: the first of tied maxima, a NaN
    (the first one) over any number, all -inf rows, a maximum in the tail after the full vectors."""
    from srt.layers.sampler import Sampler

    gen = torch.Generator().manual_seed(n)
    rows = [torch.randn(n, generator=gen) for _ in range(6)]
    rows[1][n // 2] = rows[1][-1] = 1e9  # a tie: the first wins
    rows[2][:] = float("-inf")
    rows[3][-1] = float("nan")
    rows[3][n // 3] = float("nan")
    rows[4][:] = 7.0
    rows[5][-1] = 100.0  # the tail
    x = torch.stack(rows)
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))
    sampler = Sampler()
    sampler.fused_ops = ops
    assert torch.equal(sampler.argmax(x), x.argmax(dim=-1))
    assert torch.equal(sampler.argmax(x.bfloat16()), x.bfloat16().argmax(dim=-1))  # other dtypes: torch's

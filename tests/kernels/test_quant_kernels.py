"""The C++ quantized-weight kernels against the `gguf` package's reference dequantization.

Weights are random bytes in each GGML block layout (with finite fp16 scales), so every bit
pattern of the quants is exercised; the reference is `gguf.quants.dequantize` then a float64
matmul.

Tolerances: the kernels dequantize to the same float32 weights as the reference (at most one
rounding apart: the compiler may fuse scale * q + min into one FMA) and sum K products in float32
in a different order. Recursive summation of K terms errs by at most about K * 2^-24 * sum|x_i w_i|
(Higham's gamma_K), so each output is checked against 2 * K * 2^-24 * (|x| @ |W|.T) plus a tiny
absolute floor (and, for the decode kernels that round activations, the slack `activation_slack` derives).
bf16 activations are exact in float32; only the bf16 output rounding (2^-8 relative) is added.
"""

import numpy as np
import pytest
import torch
from conftest import isa_variants
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

# type -> byte offsets of the fp16 scale fields in a block (set to finite values; the rest is random)
SCALE_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}
TYPES = list(SCALE_FIELDS)


def random_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n, row_bytes]: random quants with fp16 scales in [0.001, 0.02] (mins signed)."""
    qtype = GGMLQuantizationType[type_name]
    block, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * (k // block), nbytes), dtype=np.uint8)
    for i, off in enumerate(SCALE_FIELDS[type_name]):
        scale = rng.uniform(0.001, 0.02, size=blocks.shape[0]).astype(np.float16)
        if i == 1 and type_name in ("Q4_1", "Q5_1"):
            scale = (scale * rng.choice([-4, 4], size=scale.shape)).astype(np.float16)  # a signed min
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


@pytest.fixture(autouse=True)
def float_tiles(ops):
    """Prefill-sized bf16 batches multiply float tiles unless `quant_fast_bf16` is on, which a GGUF
    model built earlier in this process turns on where the CPU has AMX / AVX512-BF16 (the kernel
    mode is process-wide): these tests check the float path, and the bf16 or int8 tiles where they ask."""
    ops.quant_fast_bf16(False)
    ops.quant_int8_tiles(0)


def reference(x: torch.Tensor, blocks: np.ndarray, type_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float64))
    xd = x.double()
    return xd @ w.T, xd.abs() @ w.abs().T


def activation_slack(ops, x: torch.Tensor, blocks: np.ndarray, type_name: str):
    """How far the decode kernels' activation handling may move an output beyond float32 summation:
    bf16-split or int16 activations (see below), else 0."""
    return bf16x2_slack(ops, x, blocks, type_name) + i16act_slack(ops, x, blocks, type_name)


def i16act_slack(ops, x: torch.Tensor, blocks: np.ndarray, type_name: str):
    """Q8_0 / Q4_K / Q5_K / Q6_K on AVX2 and up, and Q4_0 / Q4_1 on AVX2 and AVX-512 without BF16, at decode sizes
    (M <= 24; kernels/csrc/cpu_i16act.h) quantize each 32-value block of x to int16 with d_x = max |x| / 32767:
    every x moves by at most d_x / 2, so an output moves by at most sum_blocks d_x / 2 * sum |w|
    over the block; the int32 block sums are exact, and the product d_w * d_x adds one rounding."""
    isa = ops.quant_isa("")
    if (
        x.shape[0] > 24
        or isa == "scalar"
        or type_name not in ("Q8_0", "Q4_K", "Q5_K", "Q6_K") + (("Q4_0", "Q4_1") if isa != "avx512_bf16" else ())
    ):
        return 0
    w = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float64))
    xd = x.double()
    half_step = (xd.abs().reshape(x.shape[0], -1, 32).amax(-1, keepdim=True) / 32767 / 2).expand(-1, -1, 32)
    return half_step.reshape(x.shape) @ w.abs().T + 2.0**-22 * (xd.abs() @ w.abs().T)


def bf16x2_slack(ops, x: torch.Tensor, blocks: np.ndarray, type_name: str):
    """Q4_0 / Q4_1 at decode sizes (M <= 24) on AVX512-BF16 CPUs (kernels/csrc/cpu_bf16x2.h) split
    x into two bf16 parts, hi + lo = x within 2^-17 relative, and multiply them with the exact
    quants: an output may move by 2^-16 * sum |x| |d q| beyond the float32 summation bound, where
    |d q| <= |w| + max |w| of its block (the block's offset is one of its weights)."""
    if type_name not in ("Q4_0", "Q4_1") or x.shape[0] > 24 or ops.quant_isa("") != "avx512_bf16":
        return 0
    w = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float64))
    block_max = w.abs().reshape(w.shape[0], -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(w.shape)
    return 2.0**-16 * (x.double().abs() @ (w.abs() + block_max).T)


def check(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, k: int, bf16: bool = False, slack=0) -> None:
    tol = 2 * k * 2.0**-24 * bound + 1e-6 + slack
    if bf16:
        tol = tol + ref.abs() * 2.0**-8
    err = (out.double() - ref).abs()
    worst = (err - tol).max().item()
    assert worst <= 0, f"max error {err.max().item():.3g} exceeds the bound by {worst:.3g}"


def k_values(type_name: str) -> list[int]:
    block = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]
    return [256, 512] if block == 256 else [96, 512]  # 96: not a multiple of 256


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_matches_gguf(ops, type_name):
    qtype = GGMLQuantizationType[type_name]
    for k in k_values(type_name):
        blocks = random_blocks(type_name, 37, k, seed=k)
        ours = ops.quant_dequantize(torch.from_numpy(blocks), int(qtype), k)
        ref = torch.from_numpy(dequantize(blocks, qtype).astype(np.float32))
        # one float32 rounding apart at most (an FMA for scale * q + min)
        torch.testing.assert_close(ours, ref, rtol=2**-23, atol=1e-7)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 64, 300])
def test_linear_matches_reference(ops, type_name, m):
    qtype = int(GGMLQuantizationType[type_name])
    for k in k_values(type_name):
        blocks = random_blocks(type_name, 40, k, seed=m * 7 + k)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
        ref, bound = reference(x, blocks, type_name)
        out = ops.quant_linear(x, [torch.from_numpy(blocks)], [qtype])
        assert out.dtype == torch.float32 and out.shape == (m, 40)
        check(out, ref, bound, k, slack=activation_slack(ops, x, blocks, type_name))
        out_bf16 = ops.quant_linear(x.bfloat16(), [torch.from_numpy(blocks)], [qtype])
        assert out_bf16.dtype == torch.bfloat16
        ref16, bound16 = reference(x.bfloat16().float(), blocks, type_name)
        slack16 = activation_slack(ops, x.bfloat16().float(), blocks, type_name)
        check(out_bf16, ref16, bound16, k, bf16=True, slack=slack16)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 2, 3])
def test_linear_long_rows(ops, type_name, m):
    """Rows long enough (K >= 8192) that decode takes several weight rows per activation load
    (cpu_bf16x2.h), on every ISA this CPU has; an odd block count (K = 8224 is 257 blocks) and a row count that is not a
    multiple of 4 exercise the partial pair and the tail rows."""
    qtype = int(GGMLQuantizationType[type_name])
    k = 8224
    blocks = random_blocks(type_name, 43, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    with isa_variants(ops) as isas:
        for _ in isas:
            for xin in (x, x.bfloat16()):
                ref, bound = reference(xin.float(), blocks, type_name)
                out = ops.quant_linear(xin, [torch.from_numpy(blocks)], [qtype])
                assert out.dtype == xin.dtype and out.shape == (m, 43)
                slack = activation_slack(ops, xin.float(), blocks, type_name)
                check(out, ref, bound, k, bf16=xin.dtype == torch.bfloat16, slack=slack)


@pytest.mark.parametrize("type_name", TYPES)
def test_every_compiled_isa(ops, type_name):
    """Each dot-product variant this CPU can run gives the same answer (the default uses the best)."""
    qtype = int(GGMLQuantizationType[type_name])
    k = 512
    blocks = torch.from_numpy(random_blocks(type_name, 24, k, seed=5))
    with isa_variants(ops) as isas:
        for isa in isas:
            assert ops.quant_isa("") == isa
            for m in (1, 2, 3, 5, 8):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                ref, bound = reference(x, blocks.numpy(), type_name)
                out = ops.quant_linear(x, [blocks], [qtype])
                check(out, ref, bound, k, slack=activation_slack(ops, x, blocks.numpy(), type_name))
    with pytest.raises(RuntimeError, match="unknown ISA"):
        ops.quant_isa("sse9")


@pytest.mark.parametrize("m", [1, 5, 64])
def test_bf16_weights(ops, m):
    """Dense bfloat16 weights (`--dtype bfloat16` storage on CPUs without fast bf16 matmuls) go
    through the same kernels: bf16 -> fp32 is exact, so the bound is the summation one."""
    k, n = 160, 48
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 1))
    with isa_variants(ops) as isas:
        for _ in isas:
            out = ops.quant_linear(x, [w], [int(GGMLQuantizationType.BF16)])
            wd = w.double()
            check(out, x.double() @ wd.T, x.double().abs() @ wd.abs().T, k)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q6_K"])
def test_bf16_prefill_tiles(ops, type_name):
    """With fast bf16 GEMMs (AMX / AVX512-BF16), prefill-sized bf16 batches multiply bf16 tiles: the
    weights are rounded to bf16 (2^-8 relative), so the bound is 2^-7 * (|x| @ |W|.T) plus the
    output rounding; decode-sized batches are unaffected."""
    qtype = int(GGMLQuantizationType[type_name])
    k = 512
    blocks = random_blocks(type_name, 40, k, seed=11)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref, bound = reference(x.float(), blocks, type_name)
    try:
        ops.quant_fast_bf16(True)
        out = ops.quant_linear(x, [torch.from_numpy(blocks)], [qtype])
    finally:
        ops.quant_fast_bf16(False)
    err = (out.double() - ref).abs()
    assert (err <= 2.0**-7 * bound + ref.abs() * 2.0**-8 + 1e-6).all(), err.max()


@pytest.mark.parametrize("type_name", TYPES)
def test_bf16_tiles_hold_the_rounded_weights(ops, type_name):
    """The bf16 tiles are the dequantized weights rounded to nearest bf16, for every format (decoded
    straight to bf16 on AVX512-BF16): rows of the identity pick single weights out exactly."""
    qtype = int(GGMLQuantizationType[type_name])
    k = k_values(type_name)[-1]
    blocks = torch.from_numpy(random_blocks(type_name, 70, k, seed=5))
    x = torch.eye(k)[:64].bfloat16()  # 64 rows: above the decode-sized path
    try:
        ops.quant_fast_bf16(True)
        out = ops.quant_linear(x, [blocks], [qtype])
    finally:
        ops.quant_fast_bf16(False)
    want = ops.quant_dequantize(blocks, qtype, k)[:, :64].T.bfloat16()
    # the fill and quant_dequantize may differ by one float32 rounding (an FMA), hence rarely one bf16 step
    ulp = want.float().abs() * 2.0**-7 + 1e-30
    assert ((out.float() - want.float()).abs() <= ulp).all()
    assert (out == want).float().mean() > 0.99


def int8_tiles_reference(x: torch.Tensor, blocks: np.ndarray, type_name: str):
    """What the int8 tiles compute exactly: x quantized per block of 32 (d_x = max |x| / 127, q_x =
    round(x / d_x) in float32, ties to even) times the dequantized weights, in float64; and the
    float64 product of the unquantized x with its bound (|x| @ |W|.T)."""
    w = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float64))
    xf = x.float().reshape(x.shape[0], -1, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    dx = amax / 127
    xq = ((xf * inv).round().double() * dx.double()).reshape(x.shape)
    half_step = (dx.double() / 2).expand(-1, -1, 32).reshape(x.shape)
    return xq @ w.T, x.double() @ w.T, x.double().abs() @ w.abs().T, half_step @ w.abs().T


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_tiles(ops, type_name, dtype):
    """Batches above the decode sizes on AVX-512 VNNI (without AMX) multiply Q4_0 / Q4_1 / Q8_0 weights
    with x quantized to int8 per block of 32 (kernels/csrc/cpu_qvnni.h): the result is the quantized
    x times the exact weights up to float32 summation over the blocks, so within the activation
    rounding (each x moves by at most d_x / 2) of the float product. Row counts that are not a
    multiple of the micro-kernel's 4 and weight rows that are not a multiple of its 32-row panels
    included; the LM head (`exact`) keeps the path it had."""
    if not ops.quant_int8_tiles(0):
        pytest.skip("this CPU build has no AVX-512 VNNI")
    if ops.quant_isa("") not in ("avx512", "avx512_bf16"):
        pytest.skip("the kernels are capped below avx512")
    qtype = int(GGMLQuantizationType[type_name])
    k = 512
    blocks = random_blocks(type_name, 70, k, seed=7)
    x = torch.randn(43, k, generator=torch.Generator().manual_seed(9)).to(dtype)
    x[3, 64:96] = 0  # an all-zero block
    xq_ref, ref, bound, act = int8_tiles_reference(x, blocks, type_name)
    try:
        ops.quant_int8_tiles(2)
        out = ops.quant_linear(x, [torch.from_numpy(blocks)], [qtype])
        exact_path = ops.quant_linear(x, [torch.from_numpy(blocks)], [qtype], True)
        ops.quant_int8_tiles(1)  # bf16 / fp16 activations only
        mode1 = ops.quant_linear(x, [torch.from_numpy(blocks)], [qtype])
        # AMX CPUs' mode: bf16 / fp16 batches up to 160 rows as mode 1, larger ones as mode 0
        tall = torch.cat([x] * 4)[:170]
        ops.quant_int8_tiles(3)
        mode3 = ops.quant_linear(x, [torch.from_numpy(blocks)], [qtype])
        mode3_tall = ops.quant_linear(tall, [torch.from_numpy(blocks)], [qtype])
        ops.quant_int8_tiles(0)
        mode0_tall = ops.quant_linear(tall, [torch.from_numpy(blocks)], [qtype])
    finally:
        ops.quant_int8_tiles(0)
    assert torch.equal(mode3, mode1)
    assert torch.equal(mode3_tall, mode0_tall)
    assert out.dtype == dtype and out.shape == (43, 70)
    rounding = xq_ref.abs() * 2.0**-8 if dtype == torch.bfloat16 else 0
    tol = 2 * (k // 32) * 2.0**-24 * (bound + act) + 1e-6 + rounding
    assert ((out.double() - xq_ref).abs() <= tol).all(), (out.double() - xq_ref).abs().max()
    assert ((out.double() - ref).abs() <= tol + act).all()
    assert not torch.equal(out, exact_path)  # the LM head's float tiles
    assert torch.equal(mode1, out) == (dtype == torch.bfloat16)  # float32 keeps its float tiles in mode 1
    check(exact_path, ref, bound, k, bf16=dtype == torch.bfloat16)


def decode_test_rows(k: int) -> torch.Tensor:
    """30 rows of x (float32) for the decode-size tests, row 2 with an all-zero block."""
    x = torch.randn(30, k, generator=torch.Generator().manual_seed(k))
    x[2, 32:64] = 0
    return x


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("k", [160, 576, 14336])
def test_int8_decode(ops, type_name, k):
    """Decode sizes (M <= 24) in the int8 mode on AVX-512 VNNI + VBMI CPUs: Q4_0 / Q4_1 rows stream once
    through vpdpbusd with x quantized per block of 32, as the tiles do (kernels/csrc/cpu_qvnni.h: gemv), so
    the result is the quantized x times the exact weights up to float32 summation; bf16 activations in
    mode 1, float32 only in mode 2. K = 160 and 576 end in a partial group of 4 blocks, 14336 is an 8B
    model's down projection. A row's result is the same alone or in a batch, with 1 or 2 threads, and
    within float32 rounding of the tiles' (M > 24) for the same row. Without VBMI the decode sizes keep
    their bf16 / int16 kernels."""
    from kernels.cpu import cpu_flags

    if not ops.quant_int8_tiles(0):
        pytest.skip("this CPU build has no AVX-512 VNNI")
    if ops.quant_isa("") not in ("avx512", "avx512_bf16"):
        pytest.skip("the kernels are capped below avx512")
    qtype = int(GGMLQuantizationType[type_name])
    w = [torch.from_numpy(random_blocks(type_name, 37, k, seed=k))]
    x = decode_test_rows(k)
    threads = torch.get_num_threads()
    try:
        ops.quant_int8_tiles(1)
        for dtype in (torch.bfloat16, torch.float32):
            xs = x.to(dtype)
            xq_ref, ref, bound, act = int8_tiles_reference(xs[:5], w[0].numpy(), type_name)
            out = ops.quant_linear(xs[:5], w, [qtype])
            ops.quant_int8_tiles(0)
            before = ops.quant_linear(xs[:5], w, [qtype])
            ops.quant_int8_tiles(1)
            if "avx512vbmi" not in cpu_flags() or dtype == torch.float32:
                assert torch.equal(out, before)  # float32 in mode 1, or no VBMI: the decode kernels as before
                continue
            assert not torch.equal(out, before)
            tol = 2 * (k // 32) * 2.0**-24 * (bound + act) + 1e-6 + xq_ref.abs() * 2.0**-8
            assert ((out.double() - xq_ref).abs() <= tol).all(), (out.double() - xq_ref).abs().max()
            assert ((out.double() - ref).abs() <= tol + act).all()
            for r in range(5):  # alone, as the only row, with one thread: the same bits
                assert torch.equal(ops.quant_linear(xs[r : r + 1], w, [qtype]), out[r : r + 1])
            torch.set_num_threads(1)
            assert torch.equal(ops.quant_linear(xs[:5], w, [qtype]), out)
            torch.set_num_threads(threads)
            tiles = ops.quant_linear(xs, w, [qtype])  # 30 rows: the int8 tiles
            assert torch.allclose(tiles[:5].float(), out.float(), rtol=2**-7, atol=1e-5)
            ops.quant_int8_tiles(3)  # AMX CPUs' mode: the same decode rows and tiles
            assert torch.equal(ops.quant_linear(xs[:5], w, [qtype]), out)
            assert torch.equal(ops.quant_linear(xs, w, [qtype]), tiles)
            ops.quant_int8_tiles(1)
        if "avx512vbmi" in cpu_flags():
            ops.quant_int8_tiles(2)  # float32 too: tighter (no bf16 output rounding)
            xq_ref, ref, bound, act = int8_tiles_reference(x[:3], w[0].numpy(), type_name)
            out = ops.quant_linear(x[:3], w, [qtype])
            tol = 2 * (k // 32) * 2.0**-24 * (bound + act) + 1e-6
            assert out.dtype == torch.float32 and ((out.double() - xq_ref).abs() <= tol).all()
            assert not torch.equal(out, ops.quant_linear(x[:3], w, [qtype], True))  # exact: the LM head's path
    finally:
        torch.set_num_threads(threads)
        ops.quant_int8_tiles(0)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("k", [64, 576, 14336])
def test_row_tiles(ops, type_name, k):
    """quant_repack: a Q4_0 / Q4_1 weight repacked 16 rows at a time in place (kernels/csrc/cpu_rowtiles.h;
    37 rows: two tiles and 5 rows left in the file's layout) holds the same weights, and its kernels give
    the int8 products within the activation rounding at decode sizes (a row's bits the same alone, in a
    batch or on one thread) and the file layout's bits above them (the same panels). Where its kernels
    do not run (the ISA capped after loading, the int8 mode off, float32 activations) the weight is
    read back in the file's layout: the same bits as the file's weight. Without them it stays as it is."""
    if not ops.quant_int8_tiles(0):
        pytest.skip("this CPU build has no AVX-512 VNNI")
    isa = ops.quant_isa("")
    if isa not in ("avx512", "avx512_bf16"):
        pytest.skip("the kernels are capped below avx512")
    qtype = int(GGMLQuantizationType[type_name])
    w = torch.from_numpy(random_blocks(type_name, 37, k, seed=k + 1))
    tiled = w.clone()
    assert ops.quant_repack(tiled, qtype, k) == qtype  # int8 mode off: no tiles
    assert torch.equal(tiled, w)
    x = decode_test_rows(k)
    threads = torch.get_num_threads()
    try:
        ops.quant_int8_tiles(1)
        t = ops.quant_repack(tiled, qtype, k)
        assert t == qtype + 256 and tiled.shape == w.shape and not torch.equal(tiled, w)
        assert torch.equal(tiled[32:], w[32:])  # the rows after the last whole tile
        assert torch.equal(ops.quant_dequantize(tiled, t, k), ops.quant_dequantize(w, qtype, k))
        ids = torch.tensor([0, 5, 17, 31, 32, 36])
        emb = ops.quant_embedding(ids, tiled, t, k, torch.float32)
        assert torch.equal(emb, ops.quant_embedding(ids, w, qtype, k, torch.float32))
        xs = x.bfloat16()
        xq_ref, ref, bound, act = int8_tiles_reference(xs[:5], w.numpy(), type_name)
        out = ops.quant_linear(xs[:5], [tiled], [t])
        tol = 2 * (k // 32) * 2.0**-24 * (bound + act) + 1e-6 + xq_ref.abs() * 2.0**-8
        assert ((out.double() - xq_ref).abs() <= tol).all(), (out.double() - xq_ref).abs().max()
        assert ((out.double() - ref).abs() <= tol + act).all()
        for r in range(5):
            assert torch.equal(ops.quant_linear(xs[r : r + 1], [tiled], [t]), out[r : r + 1])
        torch.set_num_threads(1)
        assert torch.equal(ops.quant_linear(xs[:5], [tiled], [t]), out)
        torch.set_num_threads(threads)
        assert torch.equal(ops.quant_linear(xs, [tiled], [t]), ops.quant_linear(xs, [w], [qtype]))  # 30 rows
        # stacked with another segment: its columns land after the tiled weight's
        both = ops.quant_linear(xs[:3], [tiled, w[:16].contiguous()], [t, qtype])
        assert torch.equal(both[:, :37], out[:3]) and both.shape == (3, 53)
        for off in ("float32", "mode 0", "avx2"):
            xo = x[:5] if off == "float32" else xs[:5]
            if off == "mode 0":
                ops.quant_int8_tiles(0)
            if off == "avx2":
                ops.quant_isa("avx2")
            assert torch.equal(ops.quant_linear(xo, [tiled], [t]), ops.quant_linear(xo, [w], [qtype])), off
            ops.quant_int8_tiles(1)
            ops.quant_isa(isa)
    finally:
        torch.set_num_threads(threads)
        ops.quant_int8_tiles(0)
        ops.quant_isa(isa)


@pytest.mark.parametrize("k", [64, 576, 2048])
def test_row_tiles_q8_lm_head(ops, k):
    """A Q8_0 LM head / embedding in row tiles (quant_repack on AVX-512 VNNI, whatever the int8 mode):
    the same rows for the embedding and quant_dequantize; at decode sizes float32 x split into two
    int16 parts per block (max |x| * 2^-31 left over), so the logits stay within float32 summation of
    the exact product, an outlier included, and well inside the int16 kernels' slack; bf16 x takes the
    high part alone (the int16 kernels' slack); a row's bits the same alone or in a batch; above the
    decode sizes and with the ISA capped, the file layout's bits."""
    if not ops.quant_int8_tiles(0):
        pytest.skip("this CPU build has no AVX-512 VNNI")
    isa = ops.quant_isa("")
    if isa not in ("avx512", "avx512_bf16"):
        pytest.skip("the kernels are capped below avx512")
    q8 = int(GGMLQuantizationType.Q8_0)
    blocks = random_blocks("Q8_0", 37, k, seed=k + 2)
    w = torch.from_numpy(blocks)
    tiled = w.clone()
    t = ops.quant_repack(tiled, q8, k)
    assert t == q8 + 256 and not torch.equal(tiled, w) and torch.equal(tiled[32:], w[32:])
    assert torch.equal(ops.quant_dequantize(tiled, t, k), ops.quant_dequantize(w, q8, k))
    ids = torch.tensor([0, 15, 16, 31, 32, 36, 3])
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(ops.quant_embedding(ids, tiled, t, k, dtype), ops.quant_embedding(ids, w, q8, k, dtype))
    x = torch.randn(30, k, generator=torch.Generator().manual_seed(k))
    x[:, 7] = 40.0  # an outlier that coarsens int16 steps of its block
    x[4, 32:64] = 0  # an all-zero block
    ref, bound = reference(x[:5], blocks, "Q8_0")
    out = ops.quant_linear(x[:5], [tiled], [t], True)
    check(out, ref, bound, k)
    int16_slack = i16act_slack(ops, x[:5], blocks, "Q8_0")
    assert isinstance(int16_slack, torch.Tensor)
    assert (out.double() - ref).abs().max() * 16 < int16_slack.max()
    for r in range(5):
        assert torch.equal(ops.quant_linear(x[r : r + 1], [tiled], [t], True), out[r : r + 1])
    # bf16 activations take h alone: each x within half an int16 step of its block (the int16 kernels'
    # slack), finer than bf16's own rounding of the block's largest value
    xb = x.bfloat16()
    ref_b, bound_b = reference(xb[:5], blocks, "Q8_0")
    out_b = ops.quant_linear(xb[:5], [tiled], [t], True)
    check(out_b, ref_b, bound_b, k, bf16=True, slack=i16act_slack(ops, xb[:5], blocks, "Q8_0"))
    for r in range(5):
        assert torch.equal(ops.quant_linear(xb[r : r + 1], [tiled], [t], True), out_b[r : r + 1])
    assert torch.equal(ops.quant_linear(x, [tiled], [t], True), ops.quant_linear(x, [w], [q8], True))  # 30 rows
    try:
        ops.quant_isa("avx2")
        assert torch.equal(ops.quant_linear(x[:5], [tiled], [t], True), ops.quant_linear(x[:5], [w], [q8], True))
    finally:
        ops.quant_isa(isa)


def test_int8_tiles_choice(monkeypatch):
    """RADIXSERVE_INT8_TILES: 0 turns the int8 tiles off, 1 on for float32 activations too (where the
    CPU has VNNI), anything else is an error naming the variable; unset, they serve bf16 / fp16
    activations on AVX-512 VNNI CPUs without AMX, and their decode rows only on AMX CPUs."""
    from kernels.cpu import cpu_flags
    from srt.utils import cpu_int8_tiles

    vnni = {"avx512_vnni", "avx512bw"} <= cpu_flags()
    monkeypatch.delenv("RADIXSERVE_CPU_ISA", raising=False)
    monkeypatch.setenv("RADIXSERVE_INT8_TILES", "0")
    assert cpu_int8_tiles() == 0
    monkeypatch.setenv("RADIXSERVE_INT8_TILES", "1")
    assert cpu_int8_tiles() == (2 if vnni else 0)
    monkeypatch.setenv("RADIXSERVE_INT8_TILES", "yes")
    with pytest.raises(ValueError, match="RADIXSERVE_INT8_TILES must be 0 or 1; got 'yes'"):
        cpu_int8_tiles()
    monkeypatch.delenv("RADIXSERVE_INT8_TILES")
    assert cpu_int8_tiles() == (0 if not vnni else 3 if "amx_int8" in cpu_flags() else 1)
    monkeypatch.setenv("RADIXSERVE_CPU_ISA", "avx2")
    assert cpu_int8_tiles() == 0


def test_stacked_segments_of_mixed_types(ops):
    """A fused projection whose parts are stored in different types (Q4_K_M files mix Q4_K and
    Q6_K) and a dense part: one call, outputs side by side."""
    k = 512
    parts = [("Q4_K", 16), ("Q6_K", 8), ("Q8_0", 24)]
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    weights, qtypes, refs, bounds = [], [], [], []
    for i, (name, n) in enumerate(parts):
        blocks = random_blocks(name, n, k, seed=i)
        weights.append(torch.from_numpy(blocks))
        qtypes.append(int(GGMLQuantizationType[name]))
        r, b = reference(x, blocks, name)
        refs.append(r)
        bounds.append(b)
    dense = torch.randn(6, k, generator=torch.Generator().manual_seed(9))
    weights.append(dense)
    qtypes.append(int(GGMLQuantizationType.F32))
    refs.append(x.double() @ dense.double().T)
    bounds.append(x.double().abs() @ dense.double().abs().T)
    for xs in (x, x.repeat(20, 1)):  # the small-M and the tiled path
        out = ops.quant_linear(xs, weights, qtypes)
        reps = xs.shape[0] // x.shape[0]
        check(out, torch.cat(refs, 1).repeat(reps, 1), torch.cat(bounds, 1).repeat(reps, 1), k)


def test_embedding_rows(ops):
    k = 96
    blocks = random_blocks("Q8_0", 50, k, seed=3)
    table = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0).astype(np.float32))
    ids = torch.tensor([0, 49, 7, 7, 23])
    out = ops.quant_embedding(ids, torch.from_numpy(blocks), int(GGMLQuantizationType.Q8_0), k, torch.float32)
    torch.testing.assert_close(out, table[ids], rtol=2**-23, atol=1e-7)
    out16 = ops.quant_embedding(ids, torch.from_numpy(blocks), int(GGMLQuantizationType.Q8_0), k, torch.bfloat16)
    assert out16.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="out of range"):
        ops.quant_embedding(
            torch.tensor([50]), torch.from_numpy(blocks), int(GGMLQuantizationType.Q8_0), k, torch.float32
        )


def test_bad_shapes_are_errors(ops):
    blocks = torch.from_numpy(random_blocks("Q4_0", 4, 64, seed=0))
    with pytest.raises(RuntimeError, match="not a multiple of the block size"):
        ops.quant_linear(torch.randn(1, 48), [blocks], [int(GGMLQuantizationType.Q4_0)])
    with pytest.raises(RuntimeError, match="bytes, expected"):
        ops.quant_linear(torch.randn(1, 96), [blocks], [int(GGMLQuantizationType.Q4_0)])
    with pytest.raises(RuntimeError, match="unsupported quantized weight type"):
        ops.quant_linear(torch.randn(1, 64), [blocks], [int(GGMLQuantizationType.Q2_K)])


# -- w8a8_int8: int8 weights per channel x int8 activations per token ------------------------------


def int8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The formula: activations quantized per row (round half to even, like the kernel's
    nearbyint), the int8 products summed exactly, then both scales applied."""
    xf = x.float().double()
    xs = xf.abs().amax(dim=1, keepdim=True) / 127
    xs = torch.where(xs > 0, xs, torch.ones_like(xs))
    xq = torch.round(xf / xs).clamp(-127, 127)
    return (xq @ q.double().T) * xs * scale.double()[None]


@pytest.mark.parametrize("k", [64, 100, 576])
@pytest.mark.parametrize("m", [1, 3, 16, 64, 300])
def test_int8_linear_matches_formula(ops, m, k):
    """Every compiled variant (VNNI, AVX2, scalar), fp32 and bf16 activations, K not a multiple of
    the vector width (100). The int32 sums are exact, so the only differences are float32 rounding
    of the activation scale and the final product: relative 1e-5 of the output's magnitude. bf16
    activations are converted to fp32 exactly, so the same reference holds for them."""
    from srt.layers.quantization.w8a8_int8 import W8A8_QTYPE, pack_rows, quantize_rows

    gen = torch.Generator().manual_seed(m * 1000 + k)
    w = torch.randn(37, k, generator=gen)  # 37 rows: 9 groups of 4 and a tail of 1
    q, scale = quantize_rows(w)
    rows = pack_rows(q, scale)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
        x[0, : k // 2] = 0  # a zero run (and, for m = 1, half the row zero)
        ref = int8_reference(x, q, scale)
        with isa_variants(ops) as isas:
            for isa in isas:
                out = ops.quant_linear(x, [rows], [W8A8_QTYPE])
                assert out.dtype == dtype
                err = (out.double() - ref).abs().max().item()
                bound = 1e-5 * ref.abs().max().item() + (0 if dtype == torch.float32 else 0.01 * ref.abs().max().item())
                assert err <= bound, (isa, dtype, err, bound)


def test_int8_rows_mixed_with_gguf_blocks_and_embedding(ops):
    """An int8 segment stacked with a Q4_0 one in one call, an all-zero activation row (scale 1,
    output 0), dequantization for embedding lookups, and a wrong row size named in the error."""
    from srt.layers.quantization.w8a8_int8 import W8A8_QTYPE, pack_rows, quantize_rows

    k = 128
    q, scale = quantize_rows(torch.randn(8, k))
    rows = pack_rows(q, scale)
    blocks = torch.from_numpy(random_blocks("Q4_0", 5, k, seed=1))
    x = torch.randn(2, k)
    x[1] = 0
    out = ops.quant_linear(x, [rows, blocks], [W8A8_QTYPE, int(GGMLQuantizationType.Q4_0)])
    assert out.shape == (2, 13)
    torch.testing.assert_close(out[:, :8], ops.quant_linear(x, [rows], [W8A8_QTYPE]))
    torch.testing.assert_close(out[:, 8:], ops.quant_linear(x, [blocks], [int(GGMLQuantizationType.Q4_0)]))
    assert out[1].abs().max().item() == 0
    torch.testing.assert_close(ops.quant_dequantize(rows, W8A8_QTYPE, k), q.float() * scale[:, None])
    with pytest.raises(RuntimeError, match="int8 weight rows hold 136 bytes, expected 104 for K=96"):
        ops.quant_linear(torch.randn(1, 96), [rows], [W8A8_QTYPE])


def test_cpu_isa_cap_env(ops):
    """RADIXSERVE_CPU_ISA caps the kernels' instruction set (to reproduce an older CPU's paths);
    a value that is not an ISA name is a clear error."""
    import os
    import subprocess
    import sys

    code = (
        "from kernels import cpu; from srt.configs.runtime_choices import cache_root; "
        "from srt.utils import cpu_has_fast_bf16; "
        "print(cpu.load(cache_root()).quant_isa(''), cpu_has_fast_bf16())"
    )
    env = {**os.environ, "RADIXSERVE_CPU_ISA": "scalar"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["scalar", "False"]
    env["RADIXSERVE_CPU_ISA"] = "sse9"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "RADIXSERVE_CPU_ISA must be one of" in out.stderr and "'sse9'" in out.stderr


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_exact_activations_for_the_lm_head(ops, type_name):
    """`exact=True` (the LM head's calls) keeps float activations: no int16 slack on any ISA, only
    the bf16-split one where that kernel runs."""
    qtype = int(GGMLQuantizationType[type_name])
    k = 512
    blocks = random_blocks(type_name, 24, k, seed=9)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(9))
    x[:, 7] = 40.0  # an outlier that coarsens int16 steps of its block
    ref, bound = reference(x, blocks, type_name)
    with isa_variants(ops) as isas:
        for isa in isas:
            out = ops.quant_linear(x, [torch.from_numpy(blocks)], [qtype], True)
            check(out, ref, bound, k, slack=bf16x2_slack(ops, x, blocks, type_name))
            if isinstance(i16act_slack(ops, x, blocks, type_name), torch.Tensor):  # int16 kernels apply here
                fast = ops.quant_linear(x, [torch.from_numpy(blocks)], [qtype])
                err_exact = (out.double() - ref).abs().max().item()
                assert err_exact * 4 < (fast.double() - ref).abs().max().item(), isa


def test_quant_moe_decode_path_is_the_expert_loop_bit_for_bit(ops, monkeypatch):
    """quant_moe at decode sizes (bf16 activations, few rows an expert) runs all the chosen experts in
    one parallel region (cpu_moe.cpp: quant_moe_lean); its output is the per-expert loop's
    (`RADIXSERVE_DISABLE_LEAN_DECODE=1`, read at each call) bit for bit: Qwen3-MoE's expert shapes
    (2048 -> 768), Q4_0 gate-up and Q8_0 down (the int8 GEMV and the int16-activation dots), 1-8
    tokens of 8 experts each, every ISA the CPU runs (AVX2: the int16 dots for both); and with the
    gate-up weights in row tiles as a GGUF model loads them (quant_repack, where the CPU has them)."""
    experts, hidden, inter, topk = 16, 2048, 768, 8
    w13 = [torch.from_numpy(random_blocks("Q4_0", 2 * inter, hidden, seed=e)) for e in range(experts)]
    w2 = [torch.from_numpy(random_blocks("Q8_0", hidden, inter, seed=100 + e)) for e in range(experts)]
    g = torch.Generator().manual_seed(0)
    ops.quant_int8_tiles(1)  # as a GGUF model sets it: int8 activations for 16-bit ones
    tiled = [w.clone() for w in w13]
    tiled_types = [ops.quant_repack(w, 2, hidden) for w in tiled]
    layouts = [(w13, [2] * experts)] + ([(tiled, tiled_types)] if tiled_types[0] != 2 else [])
    with isa_variants(ops) as isas:
        for isa, (up, up_types) in ((isa, layout) for isa in isas for layout in layouts):
            args = (up, up_types, [1] * experts, w2, [8] * experts, [1] * experts)
            for tokens in (1, 2, 5, 8):
                x = (torch.randn(tokens, hidden, generator=g) * 2).bfloat16()
                ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
                ids[0, 0] = -1  # another rank's expert: skipped
                weights = torch.rand(tokens, topk, generator=g)
                monkeypatch.delenv("RADIXSERVE_DISABLE_LEAN_DECODE", raising=False)
                lean = ops.quant_moe(x, *args, weights, ids)
                monkeypatch.setenv("RADIXSERVE_DISABLE_LEAN_DECODE", "1")
                loop = ops.quant_moe(x, *args, weights, ids)
                assert lean.dtype == torch.bfloat16 and torch.equal(lean, loop), (isa, tokens)


@pytest.mark.parametrize("type_name", TYPES)
def test_small_batches_give_each_row_its_one_row_result(ops, type_name):
    """The float-activation kernels (the LM head's `exact` calls, and types without integer decode
    kernels) take 2-24 rows in tiles of weight rows, 512 values at a time: each row's result is
    bit for bit what it gets alone (a batch's composition changes no logit), on every ISA."""
    qtype = int(GGMLQuantizationType[type_name])
    ks = (512, 2048) if type_name.endswith("_K") else (576, 2048)
    with isa_variants(ops) as isas:
        for isa in isas:
            for k in ks:
                w = torch.from_numpy(random_blocks(type_name, 37, k, seed=k))
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.randn(13, k, generator=torch.Generator().manual_seed(k)).to(dtype)
                    batch = ops.quant_linear(x, [w], [qtype], True)
                    alone = torch.cat([ops.quant_linear(x[i : i + 1], [w], [qtype], True) for i in range(13)])
                    assert torch.equal(batch, alone), (isa, k, dtype)

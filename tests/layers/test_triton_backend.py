"""The triton attention backend: how it is chosen, when it refuses to start, and a tiny model's
greedy outputs and logits through it against torch_native (float32). Without a GPU the kernels
run under triton's interpreter on CPU tensors."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read at the kernels' first launch

pytest.importorskip("triton")

from srt.layers.attention import create_attention_backend, default_attention_backend  # noqa: E402
from srt.layers.attention.triton_backend import decode_kv_splits, triton_unavailable_reason  # noqa: E402
from srt.model_executor.static_batch import StaticBatchGenerator  # noqa: E402
from srt.sampling.sampling_params import SamplingParams  # noqa: E402
from srt.server_args import ServerArgs  # noqa: E402

PROMPTS = [list(range(3, 40)), [7, 8, 9], [100 + i % 13 for i in range(70)]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


def test_default_backend_per_device():
    assert default_attention_backend("cuda", triton_installed=True) == "triton"
    assert default_attention_backend("cuda", triton_installed=False) == "torch_native"
    assert default_attention_backend("cpu", triton_installed=True) == "cpu"
    assert default_attention_backend("cpu", triton_installed=False) == "cpu"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "--attention-backend triton" in triton_unavailable_reason("cpu")
    assert triton_unavailable_reason("cuda") is None
    with pytest.raises(ValueError, match="--attention-backend triton needs a CUDA device"):
        ServerArgs(device="cpu", attention_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_unavailable_reason("cpu") is None
    ServerArgs(device="cpu", attention_backend="triton")


def test_split_count_is_a_power_of_two():
    for batch in (1, 3, 7, 64, 300):
        for max_len in (1, 255, 256, 1000, 5000, 1 << 17):
            n = decode_kv_splits(batch, max_len, 132)
            assert n & (n - 1) == 0 and 1 <= n <= 16
    assert decode_kv_splits(1, 1 << 17, 132) == 16
    assert decode_kv_splits(1, 100, 132) == 1  # short contexts are not split


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_named_triton_backend_without_interpreter_fails_at_start(tiny_model_factory, runner_factory, monkeypatch):
    runner = runner_factory(tiny_model_factory(), attention_backend="torch_native")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="--attention-backend triton"):
        create_attention_backend("triton", runner)
    assert create_attention_backend(None, runner).name in ("cpu", "torch_native")  # the CPU default is unchanged


@pytest.mark.parametrize("page_size", [1, 16])
def test_tiny_model_matches_torch_native(tiny_model_factory, runner_factory, page_size):
    path = tiny_model_factory()
    native = StaticBatchGenerator(runner_factory(path, attention_backend="torch_native", page_size=page_size))
    triton_runner = runner_factory(path, attention_backend="triton", page_size=page_size)
    assert triton_runner.attn_backend.name == "triton"
    ours = StaticBatchGenerator(triton_runner)
    torch.testing.assert_close(ours.prefill_logits(PROMPTS), native.prefill_logits(PROMPTS), atol=1e-4, rtol=1e-4)
    # chunked prefill: later chunks attend to a cached prefix; decode reads the whole pool in place
    expect = [r.output_ids for r in native.generate(PROMPTS, GREEDY, chunk_size=16)]
    assert [r.output_ids for r in ours.generate(PROMPTS, GREEDY, chunk_size=16)] == expect


SHAPES = {"small": (8, 2, 16, 1), "llama-8b": (32, 8, 128, 16)}  # heads, KV heads, head dim, page size
MODES = {
    "decode": ([1, 300, 45, 1000], [1, 1, 1, 1]),
    "extend": ([0, 17, 64, 0], [33, 5, 40, 1]),
    "mixed": ([0, 30, 500, 0], [12, 1, 1, 9]),
}  # (cached prefix, new tokens) per request


def build_paged_batch(shape, mode, dtype, device, **pool_kwargs):
    """A one-layer pool (its stored format from pool_kwargs) holding each request's cached prefix,
    request slots out of batch order, and the batch of new tokens: (pool, forward batch, layer, q, k, v)."""
    from srt.layers.radix_attention import RadixAttention
    from srt.mem_cache.allocator import TokenToKVPoolAllocator
    from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    heads, kv_heads, head_dim, page = SHAPES[shape]
    prefix, ext = MODES[mode]
    seq = [p + e for p, e in zip(prefix, ext)]
    g = torch.Generator().manual_seed(0)
    pool = MHATokenToKVPool(4096, page, dtype, kv_heads, head_dim, 1, device, **pool_kwargs)
    alloc = TokenToKVPoolAllocator(4096, page)
    r2t = ReqToTokenPool(len(seq) + 2, 2048, device)
    slots = r2t.alloc(len(seq))[::-1]  # not in batch order
    for s, n in zip(slots, prefix):
        if n:
            loc = alloc.alloc_extend([0], [n], [0])
            r2t.write(s, 0, loc)
            kv = torch.randn(2, n, kv_heads, head_dim, generator=g).to(dtype)
            pool.set_kv_buffer(0, loc.to(device), kv[0].to(device), kv[1].to(device))
    last = [int(r2t.req_to_token[s, p - 1]) if p else 0 for s, p in zip(slots, prefix)]
    loc = alloc.alloc_extend(prefix, seq, last)
    off = 0
    for s, p, e in zip(slots, prefix, ext):
        r2t.write(s, p, loc[off : off + e])
        off += e
    t = sum(ext)
    fmode = ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND
    fb = ForwardBatch.build(fmode, [0] * t, slots, seq, prefix, loc, device)
    fb.req_to_token_pool, fb.token_to_kv_pool = r2t, pool
    layer = RadixAttention(heads, head_dim, head_dim**-0.5, kv_heads, layer_id=0)
    q, k, v = (torch.randn(t, n * head_dim, generator=g).to(dtype).to(device) for n in (heads, kv_heads, kv_heads))
    return pool, fb, layer, q, k, v


@pytest.mark.parametrize(
    "shape",
    [
        "small",
        pytest.param(
            "llama-8b", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
        ),
    ],
)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_matches_torch_native_over_a_paged_pool(shape, mode, dtype):
    from srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from srt.layers.attention.triton_backend import TritonAttnBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    _, fb, layer, q, k, v = build_paged_batch(shape, mode, dtype, device)
    outs = []
    for backend in (TorchNativeAttnBackend(), TritonAttnBackend()):
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        outs.append(layer(q, k, v, fb).float())
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs[1], outs[0], **tol)


@pytest.mark.parametrize("kv_format", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("mode", ["decode", "mixed"])
def test_backend_reads_a_quantized_pool_in_place(kv_format, mode):
    # The layer writes the new tokens' K/V quantized, then the kernels read the 8-bit pool (cached
    # prefixes and new tokens alike): the same result as the reference over the dequantized buffers.
    from kernels import reference
    from srt.layers.attention.triton_backend import TritonAttnBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    fp8 = kv_format.startswith("fp8")
    pool, fb, layer, q, k, v = build_paged_batch(
        "small", mode, torch.float32, device, kv_format=kv_format, fp8_scales=[0.01] if fp8 else None
    )
    if fp8:
        pool.v_scale[0] = 0.006  # K and V scales differ, set before any write
    backend = TritonAttnBackend()
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    out = layer(q, k, v, fb)
    assert pool.k_buffer[0].dtype == (torch.int8 if kv_format == "int8" else torch.uint8)
    k_scales = pool.k_scale_buffer[0] if pool.k_scale_buffer is not None else None
    v_scales = pool.v_scale_buffer[0] if pool.v_scale_buffer is not None else None
    k_ref = reference.dequantize_kv(pool.k_buffer[0], k_scales, kv_format, pool.k_scale[0])
    v_ref = reference.dequantize_kv(pool.v_buffer[0], v_scales, kv_format, pool.v_scale[0])
    q3 = q.view(q.shape[0], layer.tp_q_head_num, layer.head_dim)
    assert fb.req_to_token_pool is not None
    table = fb.req_to_token_pool.req_to_token
    if mode == "decode":
        ref = reference.paged_decode_attention(q3, k_ref, v_ref, table, fb.req_pool_indices, fb.seq_lens, layer.scaling)
    else:
        ref = reference.paged_extend_attention(
            q3, k_ref, v_ref, table, fb.req_pool_indices, fb.seq_lens, fb.extend_prefix_lens, layer.scaling
        )
    torch.testing.assert_close(out, ref.view(out.shape), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_verify_agrees_across_backends(dtype):
    """TARGET_VERIFY (speculative draft trees): the triton and C++ kernels, which read the paged
    prefix in place, agree with torch_native's SDPA over gathered K/V with the tree mask."""
    import random

    from conftest import random_tree_mask

    from srt.layers.attention.cpu_backend import CpuAttnBackend
    from srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from srt.layers.attention.triton_backend import TritonAttnBackend
    from srt.model_executor.forward_batch_info import ForwardMode

    device = "cuda" if torch.cuda.is_available() else "cpu"
    _, fb, layer, q, k, v = build_paged_batch("small", "extend", dtype, device)
    g = random.Random(0)
    masks = [random_tree_mask(n, g).to(device) for n in fb.extend_seq_lens_cpu]
    fb.forward_mode, fb.tree_masks = ForwardMode.TARGET_VERIFY, masks
    backends = [TorchNativeAttnBackend(), TritonAttnBackend()]
    if device == "cpu":
        backends.append(CpuAttnBackend())
    outs = []
    for backend in backends:
        fb.attn_backend = backend
        backend.init_target_verify_metadata(fb)
        outs.append(layer(q, k, v, fb).float())
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], **tol)
    causal = [torch.tril(torch.ones(n, n, dtype=torch.bool, device=device)) for n in fb.extend_seq_lens_cpu]
    fb.tree_masks = causal  # a chain is causal: the same as an extend
    backends[0].init_target_verify_metadata(fb)
    fb.attn_backend = backends[0]
    chain = layer(q, k, v, fb).float()
    fb.forward_mode = ForwardMode.EXTEND
    backends[1].init_forward_metadata(fb)
    fb.attn_backend = backends[1]
    torch.testing.assert_close(layer(q, k, v, fb).float(), chain, **tol)

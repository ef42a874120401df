"""--mem-fraction-static: the KV pool's size from free device memory after loading (CUDA, as SGLang)
or from available RAM before loading (CPU), as plain arithmetic."""

from srt.model_executor.model_runner import kv_pool_tokens

GiB = 1 << 30
LLAMA_8B_BF16 = 2 * 8 * 128 * 32 * 2  # K and V, 8 KV heads x 128 dims, 32 layers, 2 bytes


def test_cuda_takes_the_static_share_of_the_device_less_what_is_in_use():
    # an H200: 141 GiB, 16 GiB of weights loaded, graphs and the request table reserved
    n = kv_pool_tokens(
        "cuda",
        0.88,
        LLAMA_8B_BF16,
        1,
        free_before=140 * GiB,
        free_after=124 * GiB,
        total=141 * GiB,
        weight_bytes=16 * GiB,
        reserved_bytes=3 * GiB,
    )
    assert n == int((124 * GiB - 141 * GiB * (1 - 0.88) - 3 * GiB) // LLAMA_8B_BF16)
    assert 800_000 < n < 900_000  # ~104 GiB of KV
    # memory another process holds counts too: the 12% left for activations stays free
    shared = kv_pool_tokens(
        "cuda",
        0.88,
        LLAMA_8B_BF16,
        1,
        free_before=100 * GiB,
        free_after=84 * GiB,
        total=141 * GiB,
        weight_bytes=16 * GiB,
        reserved_bytes=3 * GiB,
    )
    assert n - shared == 40 * GiB // LLAMA_8B_BF16


def test_cpu_takes_a_share_of_available_ram_less_the_weights():
    n = kv_pool_tokens("cpu", 0.4, 1000, 16, free_before=10 * GiB, free_after=9 * GiB, total=24 * GiB, weight_bytes=GiB)
    assert n == int((0.4 * 10 * GiB - GiB) // 1000) // 16 * 16


def test_whole_pages_and_never_negative():
    assert (
        kv_pool_tokens("cuda", 0.5, 1000, 16, free_before=0, free_after=10_000_000, total=10_000_000, weight_bytes=0)
        == 4992
    )
    assert kv_pool_tokens("cuda", 0.5, 1000, 1, free_before=0, free_after=GiB, total=4 * GiB, weight_bytes=0) == 0
    assert kv_pool_tokens("cpu", 0.4, 1000, 1, free_before=GiB, free_after=GiB, total=GiB, weight_bytes=GiB) == 0

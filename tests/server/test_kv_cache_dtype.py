"""--kv-cache-dtype: 8-bit KV caches through a live server, against the float32 cache.

Why the teacher-forcing bounds: with the weights and the inputs fixed, an 8-bit cache perturbs
each attention read by the rounding of K and V. int8 keeps a scale per (token, head), so each value
is off by at most half a step of 1/127 of its row's largest magnitude (~0.4%); fp8 e4m3 keeps 3
mantissa bits, so each value is off by up to 1/16 of itself (6%), with one unit scale per tensor.
fp8 e5m2 keeps 2 (up to 1/8 off). The reference token's logprob moves by about 2e-2 (int8),
5e-2 (e4m3) and 1e-1 (e5m2) on average, which flips the top-1 token only where the two best tokens
are that close: a few percent of positions in a 135M model's chat replies, more as the format gets
coarser (measured here: 98.8%, 95.9% and 91.8% agree). 97% (int8), 95% (fp8_e4m3; the issue's
bounds) and 88% (fp8_e5m2) leave room for those near-ties while failing any decoding bug (a wrong
scale, a misplaced row), which drops agreement far lower.
"""

from __future__ import annotations

import numpy as np
import pytest
import requests
from conftest import chat_prompt_ids, forcing_body, top1_agreement

INT8_FLAGS = ("--kv-cache-dtype", "int8", "--max-total-tokens", "16384", "--chunked-prefill-size", "256")
FP8_FLAGS = ("--kv-cache-dtype", "fp8_e4m3", "--max-total-tokens", "16384")
E5M2_FLAGS = ("--kv-cache-dtype", "fp8_e5m2", "--max-total-tokens", "16384")


@pytest.fixture(scope="module")
def chat_prompts(default_model_path) -> list[list[int]]:
    return chat_prompt_ids(default_model_path)


@pytest.fixture(scope="module")
def forced(default_server, chat_prompts) -> list[tuple[list[int], dict]]:
    """Each prompt + the float32-cache server's 64 greedy tokens, and that server's top-1 at each
    of those positions under teacher forcing."""
    out = []
    for prompt in chat_prompts:
        ref = default_server.generate(
            input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
        )
        ids = prompt + ref["output_ids"]
        out.append((ids, default_server.generate(**forcing_body(ids, len(prompt)))["meta_info"]))
    return out


@pytest.mark.parametrize(
    "flags,bound",
    [
        (INT8_FLAGS, 0.97),
        pytest.param(FP8_FLAGS, 0.95, marks=pytest.mark.full),
        pytest.param(E5M2_FLAGS, 0.88, marks=pytest.mark.full),
    ],
    ids=["int8", "fp8_e4m3", "fp8_e5m2"],
)
def test_teacher_forcing_tracks_the_float32_cache(shared_server, default_server, chat_prompts, forced, flags, bound):
    server = shared_server(*flags)
    agree = total = 0
    deltas: list[float] = []
    for prompt, (ids, ref) in zip(chat_prompts, forced):
        a, n, d = top1_agreement(server.generate(**forcing_body(ids, len(prompt)))["meta_info"], ref)
        agree, total, deltas = agree + a, total + n, deltas + d
    print(f"\n{flags[1]} KV vs float32 KV: top-1 agreement {agree}/{total}, mean |dlogprob| {np.mean(deltas):.2e}")
    assert total >= 8 * 60
    assert agree >= bound * total, f"top-1 agreement {agree}/{total}"


def test_server_info_reports_the_cache(shared_server, default_server):
    fp32 = requests.get(f"{default_server.url}/server_info", timeout=30).json()
    int8 = requests.get(f"{shared_server(*INT8_FLAGS).url}/server_info", timeout=30).json()
    assert fp32["kv_cache_dtype"] == "float32" and int8["kv_cache_dtype"] == "int8"
    assert fp32["max_total_num_tokens"] == int8["max_total_num_tokens"] == 16384  # --max-total-tokens is in tokens
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, K and V; int8 adds a float32 scale per token and head
    assert fp32["kv_cache_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert int8["kv_cache_bytes_per_token"] == 2 * 30 * 3 * (64 + 4)


def test_radix_cache_and_chunking_do_not_change_int8_outputs(shared_server, chat_prompts):
    """A shared 600-token prefix (three 256-token prefill chunks): each request's greedy reply is
    the same computed from scratch and over the prefix read back from the int8 cache."""
    server = shared_server(*INT8_FLAGS)
    prefix = [t for p in chat_prompts for t in p] * 4
    prefix = prefix[:600]
    prompts = [prefix + p for p in chat_prompts[:3]]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    fresh, margins = [], []
    for p in prompts:
        server.flush_cache()
        out = server.generate(input_ids=p, sampling_params=params, return_logprob=True, top_logprobs_num=2)
        assert out["meta_info"]["cached_tokens"] == 0
        fresh.append(out["output_ids"])
        margins.append([top[0][0] - top[1][0] for top in out["meta_info"]["output_top_logprobs"]])
    server.flush_cache()
    server.generate(input_ids=prefix + [42], sampling_params={"max_new_tokens": 1})
    for p, want, margin in zip(prompts, fresh, margins):
        out = server.generate(input_ids=p, sampling_params=params)
        assert out["meta_info"]["cached_tokens"] >= 600
        same_or_near_tie(out["output_ids"], want, margin)
    # and a batch of them at once (batch composition, decode over cached and fresh rows)
    together = server.generate(input_ids=prompts, sampling_params=params)
    for out, want, margin in zip(together, fresh, margins):
        same_or_near_tie(out["output_ids"], want, margin)


# Chunks of other lengths multiply with other GEMM blockings, whose float rounding differs in the
# last bits on some CPUs (seen on a Sapphire Rapids Xeon, not on an EPYC); an int8 cache can round
# such a difference to a different level. Greedy outputs then stay equal except where the top two
# tokens were nearly tied; a wrong KV read diverges at confident tokens.
NEAR_TIE = 0.1  # nats between the top-2 logprobs


def same_or_near_tie(got: list[int], want: list[int], margin: list[float]) -> None:
    if got == want:
        return
    k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    assert margin[k] < NEAR_TIE, f"outputs diverge at token {k} where the margin was {margin[k]:.3f} nats"


def test_bad_kv_cache_flags_are_start_up_errors(tmp_path):
    from srt.server_args import ServerArgs

    with pytest.raises(
        ValueError, match="--kv-cache-dtype must be one of auto, bfloat16, bf16, fp8_e4m3, fp8_e5m2, int8; got 'fp4'"
    ):
        ServerArgs(kv_cache_dtype="fp4")
    path = tmp_path / "scales.json"
    path.write_text("{}")
    with pytest.raises(
        ValueError, match="--quantization-param-path holds fp8 KV cache scales; it needs --kv-cache-dtype"
    ):
        ServerArgs(kv_cache_dtype="int8", quantization_param_path=str(path))
    with pytest.raises(ValueError, match="--quantization-param-path '/nonexistent.json' is not a file"):
        ServerArgs(kv_cache_dtype="fp8_e4m3", quantization_param_path="/nonexistent.json")


@pytest.mark.full
def test_int8_cache_under_tp2_retraction_and_chunking(shared_server, tiny_chat_model):
    """Tree-shaped prompts through a tensor-parallel server whose tiny int8 pool forces retractions
    and chunked prefills: every output equals a roomy single-rank int8 server's, and the pool is
    whole when idle."""
    import asyncio

    from test_retraction import run_all, tree_prompts

    bodies = tree_prompts(160)  # every tenth request generates 150-200 tokens: more than a 600-token pool holds
    roomy = shared_server("--model-path", tiny_chat_model, "--max-total-tokens", "60000", "--kv-cache-dtype", "int8")
    expect = asyncio.run(run_all(roomy.url, bodies))
    tight = shared_server(
        "--model-path",
        tiny_chat_model,
        "--kv-cache-dtype",
        "int8",
        "--max-total-tokens",
        "600",
        "--chunked-prefill-size",
        "128",
        "--tp-size",
        "2",
    )
    before = tight.wait_idle()
    got = asyncio.run(run_all(tight.url, bodies))
    assert [g["output_ids"] for g in got] == [e["output_ids"] for e in expect]
    state = tight.wait_idle()
    assert state["total_retractions"] > before["total_retractions"]
    assert state["idle"] and state["integrity_ok"]
    assert state["kv_available"] + state["kv_evictable"] == state["kv_capacity"]

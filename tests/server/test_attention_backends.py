"""Greedy outputs (float32) through live servers are identical with the cpu (C++) and torch_native
attention backends, and a server whose kernels cannot be built falls back and still serves."""

import pytest

from kernels import cpu as cpu_kernels
from srt.configs.runtime_choices import cache_root
from srt.hf_transformers_utils import get_tokenizer

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does.",
    "Hi!",
    "Why is the sky blue? Answer briefly.",
]
PARAMS = {"temperature": 0, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def prompts(default_model_path):
    tok = get_tokenizer(default_model_path)
    out = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    ids = [tok.encode(t, add_special_tokens=False) for t in out]
    # a long prompt too, so both the SDPA (long extend) and kernel (short extend) paths run
    return ids + [ids[0][:-4] + ids[1] * 6 + ids[0][-4:]]


def generate_all(server, prompts):
    server.flush_cache()  # a shared server may hold these prompts: the first pass must compute them all
    batched = [o["output_ids"] for o in server.generate(input_ids=prompts, sampling_params=PARAMS)]
    again = server.generate(input_ids=prompts, sampling_params=PARAMS)  # cached prefixes: short extends
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
    return batched, [o["output_ids"] for o in again]


def test_cpu_and_torch_native_backends_agree(shared_server, request, prompts):
    if cpu_kernels.load(cache_root()) is None:  # built here, not at collection
        pytest.skip("no C++ compiler")
    native = shared_server("--max-total-tokens", "16384", "--attention-backend", "torch_native")
    expect = generate_all(native, prompts)
    cpu = request.getfixturevalue("default_server")  # --max-total-tokens 16384, the CPU default backend
    assert "Attention backend: cpu" in cpu.log_text()
    got = generate_all(cpu, prompts)
    assert got == expect
    assert expect[0] == expect[1]


def test_fallback_when_kernels_are_unavailable(shared_server, prompts):
    server = shared_server("--max-total-tokens", "16384", env={"RADIXSERVE_DISABLE_CPU_KERNELS": "1"})
    log = server.log_text()
    assert "falls back to torch_native" in log and "Attention backend: torch_native" in log
    out = server.generate(input_ids=prompts[0], sampling_params=PARAMS)
    assert "Paris" in out["text"]

"""`--quantization gguf`: GGUF weights kept quantized and multiplied by the C++ kernels, through the
server, against the same server with `--quantization none` (the file dequantized to float32).

Tiny GGUF files are written here with the `gguf` package: random weights in every type the kernels
multiply (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), mixed inside fused projections (Q, K and V
of one layer in three types), plus Q2_K, which has no kernel and is dequantized at load.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import requests
import torch
from conftest import chat_prompt_ids, forcing_body, top1_agreement
from gguf import GGMLQuantizationType as Q
from test_gguf_loader import TOKENS, add_tokenizer, llama_cpp_permute

from kernels import cpu as cpu_kernels
from kernels.cpu import cpu_flags

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 512, 4, 2, 64, 2
VOCAB = len(TOKENS)

# Per layer: the GGML type of each projection (fused QKV and gate/up mix types on purpose).
LAYER_TYPES = [
    {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.Q5_0,
     "ffn_gate": Q.Q4_K, "ffn_up": Q.Q6_K, "ffn_down": Q.Q5_K},
    {"attn_q": Q.Q5_1, "attn_k": Q.Q5_1, "attn_v": Q.Q5_1, "attn_output": Q.Q4_K,
     "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q2_K},
]  # fmt: skip
Q4_LAYER_TYPES = [
    {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "attn_output": Q.Q4_0,
     "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_1},
    {"attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "attn_output": Q.Q4_1,
     "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_1},
]  # fmt: skip
# K-quant projections (as in Q4_K_M / Q5_K_M files), and Q4_0 / Q4_1 beside K-quants and Q8_0 in one projection:
# the lean stack's int16-activation rows, and both kinds of rows in one phase.
KQ_LAYER_TYPES = [
    {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_K,
     "ffn_gate": Q.Q5_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K},
    {"attn_q": Q.Q4_0, "attn_k": Q.Q8_0, "attn_v": Q.Q6_K, "attn_output": Q.Q8_0,
     "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_K, "ffn_down": Q.Q4_0},
]  # fmt: skip
# Byte offsets of the fp16 scale fields of the K-quant blocks written as random bytes, and a scale
# that keeps the random weights around 0.05 so activations stay finite and logits spread out.
K_SCALES = {Q.Q4_K: ([0, 2], 3e-4), Q.Q5_K: ([0, 2], 1.5e-4), Q.Q6_K: ([208], 3e-5), Q.Q2_K: ([80, 82], 3e-3)}


def quantized(rng: np.random.Generator, shape: tuple[int, int], qtype: Q) -> np.ndarray:
    if qtype in K_SCALES:  # gguf cannot quantize to K-quants: random blocks with sane scales
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
        offsets, scale = K_SCALES[qtype]
        for off in offsets:
            value = rng.uniform(0.5 * scale, scale, blocks.shape[:2] + (1,)).astype(np.float16)
            blocks[..., off : off + 2] = value.view(np.uint8)
        return blocks.reshape(shape[0], -1)
    return gguf.quants.quantize((rng.standard_normal(shape) * 0.08).astype(np.float32), qtype)


def write_quantized_gguf(path: Path, arch: str, seed: int = 0, layer_types: list[dict] | None = None) -> Path:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(1024)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    add_tokenizer(w)

    def add(name: str, shape: tuple[int, int], qtype: Q, heads: int | None = None) -> None:
        data = quantized(rng, shape, qtype)
        if heads and arch == "llama":  # llama.cpp's row order for Q and K (rows are whole blocks)
            data = llama_cpp_permute(data, heads)
        w.add_tensor(name, data, raw_dtype=qtype)

    add("token_embd.weight", (VOCAB, HIDDEN), Q.Q8_0)
    if arch == "llama":  # Qwen3's output projection stays tied to the embedding
        add("output.weight", (VOCAB, HIDDEN), Q.Q6_K)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for i, types in enumerate(layer_types or LAYER_TYPES):
        b = f"blk.{i}"
        add(f"{b}.attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), types["attn_q"], HEADS)
        add(f"{b}.attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), types["attn_k"], KV_HEADS)
        add(f"{b}.attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), types["attn_v"])
        add(f"{b}.attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), types["attn_output"])
        add(f"{b}.ffn_gate.weight", (FFN, HIDDEN), types["ffn_gate"])
        add(f"{b}.ffn_up.weight", (FFN, HIDDEN), types["ffn_up"])
        add(f"{b}.ffn_down.weight", (HIDDEN, FFN), types["ffn_down"])
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"{b}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        if arch == "qwen3":
            for norm in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"{b}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HEAD_DIM)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("quantized-gguf")
    files = {arch: str(write_quantized_gguf(folder / f"tiny-{arch}.gguf", arch)) for arch in ("llama", "qwen3")}
    for arch in ("llama", "qwen3"):  # Q4_0 / Q4_1 projections only: the fused stack's lean path
        files[f"{arch}-q4"] = str(write_quantized_gguf(folder / f"tiny-{arch}-q4.gguf", arch, 1, Q4_LAYER_TYPES))
    files["llama-kq"] = str(write_quantized_gguf(folder / "tiny-llama-kq.gguf", "llama", 2, KQ_LAYER_TYPES))
    return files


PROMPTS = [[5 + (7 * i + 3 * j) % (VOCAB - 10) for j in range(12 + 5 * i)] for i in range(4)]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
# float32 activations on both sides: the comparison is of the weights' arithmetic, not of bf16 rounding
FLAGS = ("--dtype", "float32", "--max-total-tokens", "2048")


def greedy_ids(server) -> list[list[int]]:
    return [server.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen3", marks=pytest.mark.full)])
def test_quantized_server_matches_dequantized(server_factory, gguf_files, arch):
    path = gguf_files[arch]
    quant = server_factory("--model-path", path, "--quantization", "gguf", *FLAGS)
    info = requests.get(f"{quant.url}/server_info", timeout=30).json()
    assert info["quantization"] == "gguf"
    kernel_types = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
    assert set(info["weight_formats"]["linear"].split("+")) == kernel_types | {"float32"}  # Q2_K -> float32
    assert info["weight_formats"]["lm_head"] == ("Q6_K" if arch == "llama" else "tied to embedding (Q8_0)")
    assert info["weight_formats"]["embedding"] == "Q8_0"
    assert info["kernel_isa"] in ("avx512_bf16", "avx512", "avx2", "scalar")
    assert "Q2_K" not in info["weight_formats"]["linear"]  # no kernel: dequantized at load, said in the log
    assert "Q2_K has no CPU kernel" in quant.log_text()
    ours = greedy_ids(quant)
    quant.stop()

    dense = server_factory("--model-path", path, "--quantization", "none", *FLAGS)
    info_dense = requests.get(f"{dense.url}/server_info", timeout=30).json()
    assert info_dense["quantization"] == "none"
    assert info_dense["weight_bytes"] > 3 * info["weight_bytes"]
    assert greedy_ids(dense) == ours
    dense.stop()
    if arch != "llama":
        return
    # Tensor parallel: rows split whole; a row-parallel split inside a 256-weight Q4_K block (the
    # 128 input columns of layer 1's output projection) dequantizes that shard, with a log line.
    tp2 = server_factory("--model-path", path, "--quantization", "gguf", "--tp-size", "2", *FLAGS)
    assert "falls inside Q4_K blocks" in tp2.log_text()
    assert greedy_ids(tp2) == ours
    tp2.stop()


# -- the default model: quantized (the default on CPU) against its float32 dequantization ----------------


@pytest.mark.full  # quantized serving stays live in make test: test_quantized_server_matches_dequantized
def test_default_model_quantized_tracks_float32_reference(default_server, shared_server, default_model_path):
    """Teacher forcing on 8 chat prompts x 32 tokens: the quantized server's top-1 next token equals
    the float32 reference's at >= 99% of positions; the mean |delta logprob| of the reference token
    is printed (the figure the README reports)."""
    reference = shared_server("--quantization", "none", "--dtype", "float32", "--max-total-tokens", "4096")
    info = requests.get(f"{default_server.url}/server_info", timeout=30).json()
    assert info["quantization"] == "gguf" and info["weight_formats"]["linear"] == "Q4_1"
    agree = total = 0
    deltas: list[float] = []
    for prompt in chat_prompt_ids(default_model_path):
        ref = reference.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 32})
        body = forcing_body(prompt + ref["output_ids"], len(prompt))
        a, n, d = top1_agreement(default_server.generate(**body)["meta_info"], reference.generate(**body)["meta_info"])
        agree, total, deltas = agree + a, total + n, deltas + d
    print(f"\ndefault model, gguf vs float32: top-1 agreement {agree}/{total}, mean |dlogprob| {np.mean(deltas):.2e}")
    assert total >= 100  # replies may end before 32 tokens
    assert agree >= 0.99 * total, f"top-1 agreement {agree}/{total}"


class CountingStack:
    """A model's FusedDecodeStack, counting the decode steps it runs (with or without the LM head)."""

    def __init__(self, stack):
        self.stack, self.calls, self.heads = stack, 0, 0

    def __call__(self, *args):
        out = self.stack(*args)
        self.calls += out is not None
        return out

    def run_head(self, *args):
        out = self.stack.run_head(*args)
        self.calls += out is not None
        self.heads += out is not None
        return out


@pytest.mark.parametrize(
    "arch,kv_cache_dtype,dtype,long",
    [
        ("llama", "auto", "float32", False),
        ("qwen3", "auto", "float32", False),
        ("llama", "int8", "float32", False),
        ("qwen3", "fp8_e4m3", "float32", False),
        ("llama-q4", "auto", "bfloat16", False),
        ("llama-q4", "auto", "bfloat16", True),
        ("qwen3-q4", "int8", "bfloat16", True),
        ("llama-kq", "auto", "bfloat16", False),
        pytest.param("llama-q4", "fp8_e4m3", "bfloat16", True, marks=pytest.mark.full),
    ],
)
def test_fused_decode_layer_matches_python_layers(gguf_files, runner_factory, arch, kv_cache_dtype, dtype, long):
    """The one-op-per-layer decode step (kernels/csrc/cpu_decode_layer.cpp) runs the same kernels in
    the same order as the Python layers, and the one-call-per-step stack of them
    (its DecodeStack) the same ops: same tokens, same logprobs, also over an 8-bit KV cache. With
    bf16 activations and Q4_0 / Q4_1 projections the stack runs each step in one parallel region (its
    lean path, where the int8 GEMV applies): bit for bit the per-layer ops' output, also with the
    attention split over a long context (`long`: one 300-token prompt, merged by log-sum-exp)."""
    from srt.model_executor.static_batch import StaticBatchGenerator
    from srt.model_loader.default_model import resolve_model_path
    from srt.sampling.sampling_params import SamplingParams

    runner = runner_factory(
        resolve_model_path(gguf_files[arch]), quantization="gguf", kv_cache_dtype=kv_cache_dtype, dtype=dtype
    )
    model = runner.model.model
    layers = list(model.layers)
    fused, stack = [layer.fused_decode for layer in layers], model.fused_decode_stack
    assert all(f is not None for f in fused) and stack is not None
    prompts = [PROMPTS[0] * 25] if long else PROMPTS
    lean = stack.stack.lean_for(torch.bfloat16, len(prompts))
    if dtype == "bfloat16" and {"avx512vbmi", "avx512_vnni", "avx2"} <= cpu_flags():
        assert lean, "Q4 / K-quant / Q8_0 projections in bf16 take the lean path"
    gen = StaticBatchGenerator(runner)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    model.fused_decode_stack = counting = CountingStack(stack)
    with_stack = gen.generate(prompts, params, return_logprob=True)
    assert counting.calls >= 11  # every decode step ran the stack
    model.fused_decode_stack = None
    with_op = gen.generate(prompts, params, return_logprob=True)
    for layer in layers:
        layer.fused_decode = None
    without = gen.generate(prompts, params, return_logprob=True)
    for layer, f in zip(layers, fused):
        layer.fused_decode = f
    model.fused_decode_stack = stack
    for other in (with_op, with_stack):
        assert [r.output_ids for r in other] == [r.output_ids for r in without]
        for a, b in zip(other, without):
            np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, rtol=0, atol=1e-6)
    if lean:
        assert [r.output_logprobs for r in with_stack] == [r.output_logprobs for r in with_op]


@pytest.mark.parametrize("threads,isa,arch", [(1, None, "llama-q4"), (3, None, "llama-kq"), (2, "avx2", "llama-q4")])
def test_lean_decode_stack_same_at_any_thread_count(gguf_files, runner_factory, ops, threads, isa, arch):
    """The lean stack shares each phase's work out between however many threads run it (stealing
    from each other's tails); a row's arithmetic is one thread's, so 1 and 3 threads give the
    per-layer ops' tokens and logprobs bit for bit too; and so do the AVX2 kernels' rows (the
    int16-activation dots, which an AVX2-only CPU runs for every type)."""
    from srt.model_executor.static_batch import StaticBatchGenerator
    from srt.model_loader.default_model import resolve_model_path
    from srt.sampling.sampling_params import SamplingParams

    if isa is not None and "avx2" not in cpu_flags():
        pytest.skip("needs AVX2")
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    before, before_isa = torch.get_num_threads(), ops.quant_isa("")
    try:
        if isa is not None:  # before loading: the weights then keep the file's rows (row tiles need AVX-512)
            ops.quant_isa(isa)
        runner = runner_factory(resolve_model_path(gguf_files[arch]), quantization="gguf", dtype="bfloat16")
        model = runner.model.model
        stack = model.fused_decode_stack
        gen = StaticBatchGenerator(runner)
        if not stack.stack.lean_for(torch.bfloat16, len(PROMPTS)):
            pytest.skip("no lean path for these kernels on this CPU")
        torch.set_num_threads(threads)
        lean = gen.generate(PROMPTS, params, return_logprob=True)
        model.fused_decode_stack = None
        per_layer = gen.generate(PROMPTS, params, return_logprob=True)
    finally:
        torch.set_num_threads(before)
        ops.quant_isa(before_isa)
        model.fused_decode_stack = stack
    assert [r.output_ids for r in lean] == [r.output_ids for r in per_layer]
    assert [r.output_logprobs for r in lean] == [r.output_logprobs for r in per_layer]


@pytest.mark.parametrize("arch", ["qwen3-q4", "llama-q4"])
def test_lean_stack_runs_the_lm_head_as_quant_linear_does(gguf_files, runner_factory, arch):
    """A Q8_0 LM head in row tiles (qwen3's tiny file ties it to the Q8_0 embedding, as the default
    model does) runs with the final norm at the end of the stack's parallel region
    (DecodeStack.run_head): the same tokens and logprobs, bit for bit, as the separate norm and
    quant_linear call, at batch 1 and 4; a head it does not take (llama's Q6_K output) runs as before."""
    from srt.model_executor.static_batch import StaticBatchGenerator
    from srt.model_loader.default_model import resolve_model_path
    from srt.sampling.sampling_params import SamplingParams

    runner = runner_factory(resolve_model_path(gguf_files[arch]), quantization="gguf", dtype="bfloat16")
    model = runner.model.model
    stack = model.fused_decode_stack
    if not stack.stack.lean_for(torch.bfloat16, 1):
        pytest.skip("no lean path for these kernels on this CPU")
    gen = StaticBatchGenerator(runner)
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    model.fused_decode_stack = counting = CountingStack(stack)
    try:
        fused = [gen.generate(p, params, return_logprob=True) for p in (PROMPTS[:1], PROMPTS)]
        counting.run_head = lambda *args: None  # the layers on the stack, the norm and head after it
        separate = [gen.generate(p, params, return_logprob=True) for p in (PROMPTS[:1], PROMPTS)]
    finally:
        model.fused_decode_stack = stack
    assert counting.heads == (18 if arch == "qwen3-q4" else 0)  # every decode step of both batches, or none
    for a, b in zip(fused, separate):
        assert [r.output_ids for r in a] == [r.output_ids for r in b]
        assert [r.output_logprobs for r in a] == [r.output_logprobs for r in b]


@pytest.mark.parametrize("arch", ["qwen3-q4", "llama-q4"])
def test_continuous_decode_steps_match_single_steps(gguf_files, runner_factory, arch, monkeypatch):
    """--num-continuous-decode-steps' model side (ModelRunner.decode_steps): N steps in one call give
    the tokens of N single steps, at batch 1 and 4, with budgets that end inside a call, a stop token
    met inside one, seeded sampling with filters next to greedy rows, and contexts split a different
    number of ways at every step (the C++ loop moves one attention on from step to step); every KV slot
    comes back. qwen3's tiny file
    ties a Q8_0 embedding and
    LM head as the default model does: the stack runs all the steps in one C++ call (run_steps); llama's
    Q6_K head is not the stack's, so its steps run one forward at a time."""
    from srt.model_executor.static_batch import StaticBatchGenerator
    from srt.model_loader.default_model import resolve_model_path
    from srt.sampling.sampling_params import SamplingParams

    runner = runner_factory(resolve_model_path(gguf_files[arch]), quantization="gguf", dtype="bfloat16")
    model = runner.model.model
    stack = model.fused_decode_stack
    if not stack.stack.lean_for(torch.bfloat16, 1):
        pytest.skip("no lean path for these kernels on this CPU")
    single, multi = StaticBatchGenerator(runner), StaticBatchGenerator(runner, decode_steps=5)
    free = runner.token_to_kv_pool_allocator.available_size()
    calls = []
    original = stack.decode_steps
    stack.decode_steps = lambda *args: calls.append(out := original(*args)) or out
    try:
        for prompts in (PROMPTS[:1], PROMPTS):
            params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (13, 7, 11, 2)]
            params = params[: len(prompts)]
            want = [r.output_ids for r in single.generate(prompts, params)]
            assert [r.output_ids for r in multi.generate(prompts, params)] == want
            # a stop token met on the 4th decode step: the steps after it are dropped
            stop = [SamplingParams(temperature=0, max_new_tokens=13, stop_token_ids=[want[0][4]])] + params[1:]
            want = [r.output_ids for r in single.generate(prompts, stop)]
            assert want[0][-1] == want[0][4] and len(want[0]) <= 5
            assert [r.output_ids for r in multi.generate(prompts, stop)] == want
            # seeded sampling (on qwen3's stack, the sampler's row pass inside run_steps): the seed hashes
            # each token's position; greedy and filtered rows in the same batch
            seeded = [
                SamplingParams(temperature=1.5, top_k=20, sampling_seed=0, max_new_tokens=9),
                SamplingParams(temperature=0, max_new_tokens=8),
                SamplingParams(temperature=1.2, top_p=0.9, min_p=0.02, sampling_seed=2, max_new_tokens=9),
                SamplingParams(temperature=0.9, sampling_seed=3, max_new_tokens=6),
            ][: len(prompts)]
            want = [r.output_ids for r in single.generate(prompts, seeded)]
            assert [r.output_ids for r in multi.generate(prompts, seeded)] == want
            # logit processors that move on from step to step inside a call (a forward and a sample a
            # step): a bias that would pick a stop token at once, banned by min_new_tokens for 4 tokens
            # (the ban holds, then lifts, inside the first call); the same bias outweighed by the
            # frequency penalty of its repeats inside a call; seeded sampling with presence and
            # repetition penalties; a ban alone
            ban = want[0][2]
            moving = [
                SamplingParams(
                    temperature=0, max_new_tokens=12, min_new_tokens=4, stop_token_ids=[ban], logit_bias={str(ban): 6.0}
                ),
                SamplingParams(
                    temperature=0, max_new_tokens=12, logit_bias={str(ban): 6.0}, frequency_penalty=2.0, ignore_eos=True
                ),
                SamplingParams(
                    temperature=0.8, sampling_seed=5, presence_penalty=1.0, repetition_penalty=1.3, max_new_tokens=10
                ),
                SamplingParams(temperature=0, max_new_tokens=8, min_new_tokens=6, stop_token_ids=[ban]),
            ][: len(prompts)]
            want = [r.output_ids for r in single.generate(prompts, moving)]
            assert [r.output_ids for r in multi.generate(prompts, moving)] == want
            assert len(want[0]) == 5 and want[0][-1] == ban and ban not in want[0][:-1]
            if len(prompts) > 1:
                assert 2 <= want[1].count(ban) < len(want[1])
            with monkeypatch.context() as m:  # 1, 2 or 3 pieces of context by step, in both
                m.setattr(cpu_kernels, "num_decode_splits", lambda batch, kv_heads, longest: 1 + longest % 3)
                want = [r.output_ids for r in single.generate(prompts, params)]
                assert [r.output_ids for r in multi.generate(prompts, params)] == want
            assert runner.token_to_kv_pool_allocator.available_size() == free
    finally:
        stack.decode_steps = original
    assert calls and all((out is not None) == (arch == "qwen3-q4") for out in calls)
    if arch == "qwen3-q4":  # the quantized embedding table went to the stack: the steps ran in C++
        assert stack.embed_key is not None and stack.embed_key[1]


def test_released_weights_come_back_to_the_lean_stack(gguf_files, runner_factory):
    """/release_memory_occupation's weights on a quantized model: every tensor the model holds is
    freed in place (the huge-page arena with them) and read back into the same tensor objects, so
    the decode stack, which holds them, gives the same tokens after resume."""
    from srt.model_executor.static_batch import StaticBatchGenerator
    from srt.model_loader.default_model import resolve_model_path
    from srt.model_loader.loader import weight_tensors
    from srt.rl.memory import ReleasedWeights
    from srt.sampling.sampling_params import SamplingParams

    runner = runner_factory(resolve_model_path(gguf_files["llama-q4"]), quantization="gguf", dtype="bfloat16")
    gen = StaticBatchGenerator(runner)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    before = [r.output_ids for r in gen.generate(PROMPTS, params)]
    held = [t for t in weight_tensors(runner.model) if t.layout == torch.strided and t.numel()]
    released = ReleasedWeights(runner.model)
    try:
        assert released.nbytes >= sum(t.untyped_storage().nbytes() for t in {t.data_ptr(): t for t in held}.values())
        assert all(t.numel() == 0 for t in held)
    finally:
        released.restore()
    assert all(t.numel() for t in held)
    assert [r.output_ids for r in gen.generate(PROMPTS, params)] == before


def test_bad_quantization_choices_name_the_flag(tiny_model_factory, runner_factory):
    from srt.configs.model_config import ModelLoadError
    from srt.server_args import ServerArgs

    with pytest.raises(ModelLoadError, match="--quantization gguf needs a .gguf model file"):
        runner_factory(tiny_model_factory("LlamaForCausalLM"), quantization="gguf")
    with pytest.raises(
        ValueError, match="--quantization must be one of none, gguf, w8a8_int8, int4_weight_only, fp8; got 'int3'"
    ):
        ServerArgs(quantization="int3")

"""CUDA graphs for decode: the batch sizes captured, how a batch is padded into the static inputs,
the same computation run eagerly on CPU (padded rows change nothing), the memory reserved for the
graphs; on a GPU, greedy outputs identical with graphs on and off and across attention backends,
in process and through the Engine (overlap scheduler: replay on the worker's stream)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read at the kernels' first launch

from srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from srt.model_executor.cuda_graph_runner import (
    PADDING,
    CudaGraphRunner,
    DecodeInputs,  # noqa: E402
    capture_batch_sizes,
    graph_memory_estimate,
    graph_unsupported_reason,
    padded_batch_size,
)
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from srt.model_executor.static_batch import StaticBatchGenerator  # noqa: E402
from srt.sampling.sampling_params import SamplingParams  # noqa: E402
from srt.server_args import ServerArgs  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_capture_batch_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    sizes = capture_batch_sizes(160)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 160 and len(sizes) == 4 + 19
    assert all(b % 8 == 0 for b in sizes[3:])


def test_padded_batch_size():
    sizes = capture_batch_sizes(32)
    assert [padded_batch_size(b, sizes) for b in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 24, 32]
    assert padded_batch_size(33, sizes) is None


def _decode_batch(rows: list[tuple[int, int, int, int]]) -> ForwardBatch:
    """rows of (token, request slot, seq len, KV slot)."""
    t = [torch.tensor(c, dtype=torch.int64) for c in zip(*rows)]
    return ForwardBatch(ForwardMode.DECODE, len(rows), t[0], t[2] - 1, t[1], t[2], t[2].tolist(), t[3])


def test_decode_inputs_copy_rows_and_pad():
    inputs = DecodeInputs.allocate(8, "cpu")
    inputs.load(_decode_batch([(11, 3, 20, 100), (12, 5, 7, 101), (13, 4, 1, 102)]), 4)
    assert inputs.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert inputs.positions[:4].tolist() == [19, 6, 0, 0]
    assert inputs.req_pool_indices[:4].tolist() == [3, 5, 4, 0]
    assert inputs.seq_lens[:4].tolist() == [20, 7, 1, 1]
    assert inputs.out_cache_loc[:4].tolist() == [100, 101, 102, 0]  # padding writes the KV sink only
    # a smaller batch later: the rows it does not fill are padding again, not stale requests
    inputs.load(_decode_batch([(21, 6, 9, 200)]), 2)
    assert inputs.req_pool_indices[:2].tolist() == [6, 0] and inputs.out_cache_loc[:2].tolist() == [200, 0]
    fb = inputs.forward_batch(2)
    assert fb.batch_size == 2 and fb.forward_mode.is_decode() and fb.seq_lens.tolist() == [9, 1]
    assert fb.input_ids.data_ptr() == inputs.input_ids.data_ptr()  # views of the static buffers
    assert set(PADDING) == {"input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc"}


def test_graph_unsupported_reasons():
    native = TorchNativeAttnBackend()
    native.name = "torch_native"
    args = ServerArgs()
    assert graph_unsupported_reason("cpu", args, native) == "CUDA graphs need a CUDA device"
    assert "cannot be captured" in graph_unsupported_reason("cuda", args, native)
    assert graph_unsupported_reason("cuda", ServerArgs(disable_cuda_graph=True), native) == "--disable-cuda-graph"
    with pytest.raises(ValueError, match="--cuda-graph-max-bs"):
        ServerArgs(cuda_graph_max_bs=0)


def test_graph_memory_estimate():
    # Llama-3.1-8B shapes, bf16, max batch 160: the logits dominate, the total stays well under a GiB
    est = graph_memory_estimate(160, 128256, 4096, 14336, 32, 128, 2)
    assert 160 * 128256 * 4 < est < 1 << 30
    assert graph_memory_estimate(8, 128256, 4096, 14336, 32, 128, 2) < est


def test_cpu_runner_reports_graphs_off(tiny_model_factory, runner_factory):
    runner = runner_factory(tiny_model_factory(), attention_backend="torch_native", cuda_graph_max_bs=4, device="cpu")
    assert runner.cuda_graph_runner is None
    assert runner.cuda_graph_status() == {"enabled": False, "reason": "CUDA graphs need a CUDA device"}


def test_padded_replay_matches_eager(tiny_model_factory, runner_factory):
    """What a graph replays, run eagerly (the CPU has no graphs): static buffers, 3 rows padded to
    4, the backend's graph-time split counts. Real rows get the eager tokens; the KV of every
    allocated slot is the eager run's, so padding rows wrote nothing but the sink."""
    pytest.importorskip("triton")
    path = tiny_model_factory()
    prompts = [list(range(3, 30)), [7, 8, 9], [100 + i % 13 for i in range(50)]]
    eager_runner = runner_factory(path, attention_backend="triton")
    expect = [r.output_ids for r in StaticBatchGenerator(eager_runner).generate(prompts, GREEDY)]

    runner = runner_factory(path, attention_backend="triton")
    runner.cuda_graph_runner = CudaGraphRunner(runner, max_bs=4, capture=False)
    assert runner.cuda_graph_runner.sizes == [1, 2, 4]
    got = [r.output_ids for r in StaticBatchGenerator(runner).generate(prompts, GREEDY)]
    assert got == expect
    assert runner.cuda_graph_runner.replays == GREEDY.max_new_tokens - 1  # every decode step went through it
    assert runner.attn_backend.num_kv_splits == 4  # the graph-time count for batch 4, context 1024 (eager: 1)
    single = StaticBatchGenerator(runner).generate(prompts[1:2], GREEDY)
    assert single[0].output_ids == expect[1]


# -- on a GPU ---------------------------------------------------------------------------------------

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does.",
    "Hi!",
    "Why is the sky blue? Answer briefly.",
]


@pytest.fixture(scope="module")
def gpu_model():
    """(path, prompt token ids): RADIXSERVE_TEST_MODEL (benchmark/gpu_check.py points it at a
    random-weight SmolLM2 when the default model's package is not installed), else the default model."""
    from srt.configs.model_config import ModelLoadError
    from srt.hf_transformers_utils import get_tokenizer
    from srt.model_loader.default_model import resolve_default_model

    path = os.environ.get("RADIXSERVE_TEST_MODEL")
    if not path:
        try:
            path = resolve_default_model(progress=False)
        except ModelLoadError as e:
            pytest.skip(f"no test model: {e}")
    tok = get_tokenizer(path)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    return path, [tok.encode(t, add_special_tokens=False) for t in texts]


def assert_greedy_agree(results: dict[str, list[list[int]]], dtype: str) -> None:
    """float32: identical. bfloat16: different kernels (and GEMMs over a padded batch) round
    differently, and a near-tie flips a token and everything after it, so at least half of the
    prompts identical (random test weights have many near-ties)."""
    names = list(results)
    base = results[names[0]]
    for name in names[1:]:
        same = [a == b for a, b in zip(base, results[name])]
        if dtype == "float32":
            assert all(same), f"{names[0]} vs {name}: {results[names[0]]} != {results[name]}"
        else:
            assert 2 * sum(same) >= len(same), f"{names[0]} vs {name}: {sum(same)}/{len(same)} identical"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backends_and_graphs_agree_on_gpu(gpu_model, runner_factory, dtype):
    path, prompts = gpu_model
    variants = {
        "torch_native": dict(attention_backend="torch_native"),
        "triton": dict(attention_backend="triton", disable_cuda_graph=True),
        "triton+graphs": dict(attention_backend="triton", cuda_graph_max_bs=8),
    }
    results = {}
    for name, args in variants.items():
        runner = runner_factory(path, dtype=dtype, max_total_tokens=16384, **args)
        assert (runner.cuda_graph_runner is not None) == (name == "triton+graphs"), runner.cuda_graph_status()
        results[name] = [r.output_ids for r in StaticBatchGenerator(runner).generate(prompts, GREEDY)]
        if runner.cuda_graph_runner is not None:
            assert runner.cuda_graph_runner.replays == GREEDY.max_new_tokens - 1  # 6 rows padded to 8
            assert runner.cuda_graph_status()["batch_sizes"] == [1, 2, 4, 8]
        del runner
        torch.cuda.empty_cache()
    assert_greedy_agree(results, dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_cuda_graphs_matches_eager(gpu_model, dtype):
    """Overlap scheduler (the GPU default): graphs are replayed on the forward worker's stream."""
    from srt.entrypoints.engine import Engine

    path, prompts = gpu_model
    params = {"temperature": 0, "max_new_tokens": 24}
    results = {}
    for name, extra in {"eager": dict(disable_cuda_graph=True), "graphs": dict(cuda_graph_max_bs=16)}.items():
        with Engine(
            model_path=path,
            dtype=dtype,
            max_total_tokens=16384,
            attention_backend="triton",
            grammar_backend="none",
            **extra,
        ) as engine:
            results[name] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
            state = engine.get_server_info()["internal_states"][0]
            if "cuda_graph" in state:
                assert state["cuda_graph"]["enabled"] == (name == "graphs"), state["cuda_graph"]
                if name == "graphs":
                    assert state["cuda_graph"]["replays"] > 0
    assert_greedy_agree(results, dtype)

"""Mixture-of-experts and MLA models in the model runner (tiny random models, float32): greedy tokens
equal HF transformers' with any batching, chunk size and page size, on every attention and MoE kernel;
the MLA cache holds one latent row per token; flags not built for these models are clear errors.
(Logits vs HF per architecture: tests/models/test_tiny_models.py; kernels: tests/kernels.)"""

import conftest
import pytest
import torch

from srt.configs.model_config import ModelConfig, ModelLoadError
from srt.layers.moe import FusedMoE
from srt.model_executor.model_runner import unsupported_with_model
from srt.model_executor.static_batch import StaticBatchGenerator
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

PROMPTS = [list(range(3, 40)), [7, 8, 9], [100 + i % 13 for i in range(90)], [5], [11 + i % 7 for i in range(33)]]
NEW = 12
PARAMS = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)


def hf_greedy(path: str) -> list[list[int]]:
    return conftest.hf_greedy(path, PROMPTS, NEW)


@pytest.mark.parametrize("arch", ["Qwen2MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_matches_hf_with_any_batching_chunking_and_paging(arch, page_size, tiny_model_factory, runner_factory):
    path = tiny_model_factory(arch)
    expect = hf_greedy(path)
    gen = StaticBatchGenerator(runner_factory(path, page_size=page_size))
    batched = [r.output_ids for r in gen.generate(PROMPTS, PARAMS)]
    chunked = [r.output_ids for r in gen.generate(PROMPTS, PARAMS, chunk_size=7)]
    long_chunks = [r.output_ids for r in gen.generate(PROMPTS, PARAMS, chunk_size=40)]
    single = [gen.generate([p], PARAMS)[0].output_ids for p in PROMPTS]
    assert batched == chunked == long_chunks == single == expect
    allocator = gen.runner.token_to_kv_pool_allocator
    assert allocator.available_size() == allocator.size


@pytest.mark.parametrize(
    "attention,moe",
    [("cpu", "cpu"), ("torch_native", "torch_native"), ("triton", "triton")],
)
def test_every_kernel_gives_hf_tokens(attention, moe, tiny_model_factory, runner_factory):
    """C++ (cpu), torch references and Triton (under the interpreter on CPU) MLA attention and fused MoE."""
    path = tiny_model_factory("DeepseekV3ForCausalLM")
    runner = runner_factory(path, attention_backend=attention, moe_runner_backend=moe)
    assert runner.attn_backend.name == attention
    assert {m.backend for m in runner.model.modules() if isinstance(m, FusedMoE)} == {moe}
    gen = StaticBatchGenerator(runner)
    prompts = PROMPTS[:3]
    out = [r.output_ids for r in gen.generate(prompts, PARAMS, chunk_size=16)]
    assert out == hf_greedy(path)[:3]


def test_mla_cache_holds_one_latent_per_token(tiny_model_factory, runner_factory):
    path = tiny_model_factory("DeepseekV2ForCausalLM")
    runner = runner_factory(path)
    cfg = runner.model_config.hf_config
    layers, latent = cfg.num_hidden_layers, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert runner.kv_bytes_per_token == layers * latent * 4
    buf = runner.token_to_kv_pool.kv_buffer[0]
    assert buf.shape[1:] == (1, latent)
    # the same model with per-head K (nope + rope) and V would store this many bytes per token
    heads = cfg.num_attention_heads
    mha = layers * heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 4
    assert runner.kv_bytes_per_token * 5 < mha


def test_unsupported_flags_are_clear_errors(tiny_model_factory):
    mla = ModelConfig.from_path(tiny_model_factory("DeepseekV3ForCausalLM"))
    moe = ModelConfig.from_path(tiny_model_factory("MixtralForCausalLM"))
    dense = ModelConfig.from_path(tiny_model_factory("LlamaForCausalLM"))
    assert unsupported_with_model(mla, ServerArgs(model_path=mla.path)) is None
    assert unsupported_with_model(moe, ServerArgs(model_path=moe.path, tp_size=2, ep_size=2)) is None
    why = unsupported_with_model(mla, ServerArgs(model_path=mla.path, disaggregation_mode="prefill"))
    assert why is not None and "--disaggregation-mode" in why and "MLA" in why
    why = unsupported_with_model(moe, ServerArgs(model_path=moe.path, enable_lora=True))
    assert why is not None and "--enable-lora" in why and "mixture-of-experts" in why
    why = unsupported_with_model(dense, ServerArgs(model_path=dense.path, tp_size=2, ep_size=2))
    assert why is not None and "--ep-size 2" in why
    with pytest.raises(ValueError, match="--ep-size must be >= 1 and divide --tp-size 2"):
        ServerArgs(model_path=moe.path, tp_size=2, ep_size=3)
    with pytest.raises(ModelLoadError, match="--kv-cache-dtype int8 is not supported for MLA"):
        from conftest import make_runner

        make_runner(mla.path, kv_cache_dtype="int8")


@pytest.mark.parametrize("quantization", ["w8a8_int8", "int4_weight_only"])
def test_quantized_experts(quantization, tiny_model_factory, runner_factory, ops):
    """--quantization reaches the experts (each expert's projections in the format, the C++ kernels):
    fewer weight bytes, logits near the dense model's, greedy tokens independent of batching."""
    path = tiny_model_factory("DeepseekV3ForCausalLM", hidden_size=128, intermediate_size=256)
    dense = runner_factory(path)
    runner = runner_factory(path, quantization=quantization)
    experts = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.quantized and m.backend.startswith("per-expert int") for m in experts)
    assert runner.weight_bytes < 0.6 * dense.weight_bytes
    ref = StaticBatchGenerator(dense).prefill_logits(PROMPTS)
    gen = StaticBatchGenerator(runner)
    got = gen.prefill_logits(PROMPTS)
    cosine = torch.nn.functional.cosine_similarity(got, ref, dim=-1).min().item()
    assert cosine > (0.995 if quantization == "w8a8_int8" else 0.7), cosine
    batched = [r.output_ids for r in gen.generate(PROMPTS, PARAMS)]
    chunked = [r.output_ids for r in gen.generate(PROMPTS, PARAMS, chunk_size=7)]
    single = [gen.generate([p], PARAMS)[0].output_ids for p in PROMPTS]
    assert batched == chunked == single

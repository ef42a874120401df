"""Every registered architecture, as a tiny random model, against HF transformers (float32)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from srt.model_executor.static_batch import StaticBatchGenerator
from srt.models.registry import MODEL_REGISTRY
from srt.sampling.sampling_params import SamplingParams

PROMPTS = [list(range(3, 40)), [7, 8, 9], [100 + i % 13 for i in range(90)], [5]]

VARIANTS = [
    ("LlamaForCausalLM", {}),
    ("LlamaForCausalLM", {"attention_bias": True, "tie_word_embeddings": True}),
    (
        "LlamaForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    ("MistralForCausalLM", {}),
    ("Qwen2ForCausalLM", {}),
    (
        "Qwen2ForCausalLM",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}},
    ),
    ("Qwen3ForCausalLM", {}),
    ("MixtralForCausalLM", {}),
    ("Qwen2MoeForCausalLM", {}),
    ("Qwen2MoeForCausalLM", {"norm_topk_prob": True, "decoder_sparse_step": 2}),
    ("Qwen3MoeForCausalLM", {"norm_topk_prob": True}),
    ("DeepseekV2ForCausalLM", {}),
    ("DeepseekV2ForCausalLM", {"topk_method": "greedy", "q_lora_rank": 24, "moe_layer_freq": 1}),
    (
        "DeepseekV2ForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "beta_fast": 32,
                "beta_slow": 1,
            }
        },
    ),
    ("DeepseekV3ForCausalLM", {}),
    ("DeepseekV3ForCausalLM", {"rope_interleave": False, "norm_topk_prob": False}),
]


def test_every_registered_architecture_is_covered():
    # EAGLE draft heads and DeepSeek-V3's MTP layer are not models of their own (test_eagle_heads.py)
    heads = {name for name, cls in MODEL_REGISTRY.items() if getattr(cls, "is_draft_head", False)}
    assert heads == {"LlamaForCausalLMEagle", "LlamaForCausalLMEagle3", "DeepseekV3ForCausalLMNextN"}
    # vision-language models are checked with their images (tests/multimodal/test_vlm_models.py)
    vision = {name for name, cls in MODEL_REGISTRY.items() if "image" in getattr(cls, "modalities", ())}
    # encoders pool rather than generate (tests/models/test_bert.py)
    encoders = {name for name, cls in MODEL_REGISTRY.items() if getattr(cls, "is_encoder", False)}
    assert encoders == {
        "BertModel",
        "BertForSequenceClassification",
        "RobertaModel",
        "XLMRobertaModel",
        "RobertaForSequenceClassification",
        "XLMRobertaForSequenceClassification",
    }
    assert {a for a, _ in VARIANTS} == set(MODEL_REGISTRY) - heads - vision - encoders


def _hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "arch,overrides",
    VARIANTS,
    ids=lambda x: (
        x
        if isinstance(x, str)
        else "-".join(str(v.get("rope_type", v)) if isinstance(v, dict) else str(k) for k, v in x.items()) or "base"
    ),
)
def test_logits_and_greedy_match_hf(arch, overrides, tiny_model_factory, runner_factory):
    path = tiny_model_factory(arch, **overrides)
    hf = _hf(path)
    gen = StaticBatchGenerator(runner_factory(path))
    ours = gen.prefill_logits(PROMPTS)
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            ref = hf(torch.tensor([p])).logits[0, -1]
            torch.testing.assert_close(ours[i], ref, atol=1e-4, rtol=1e-4)
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    out = gen.generate(PROMPTS, params, chunk_size=16)
    with torch.no_grad():
        for p, r in zip(PROMPTS, out):
            ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)[
                0, len(p) :
            ].tolist()
            assert r.output_ids == ref


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_is_independent_of_batching_chunking_and_paging(page_size, tiny_model_factory, runner_factory):
    path = tiny_model_factory("Qwen3ForCausalLM")
    gen = StaticBatchGenerator(runner_factory(path, page_size=page_size))
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    batched = [r.output_ids for r in gen.generate(PROMPTS, params)]
    chunked = [r.output_ids for r in gen.generate(PROMPTS, params, chunk_size=7)]
    single = [gen.generate([p], params)[0].output_ids for p in PROMPTS]
    assert batched == chunked == single
    allocator = gen.runner.token_to_kv_pool_allocator
    assert allocator.available_size() == allocator.size


def test_prompt_logprobs_match_hf(tiny_model_factory, runner_factory):
    path = tiny_model_factory("LlamaForCausalLM")
    hf = _hf(path)
    gen = StaticBatchGenerator(runner_factory(path))
    out = gen.generate(
        PROMPTS[:3],
        SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True),
        chunk_size=10,
        return_logprob=True,
    )
    with torch.no_grad():
        for p, r in zip(PROMPTS[:3], out):
            full = p + r.output_ids
            ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), -1)
            expect_in = [ref[i - 1, full[i]].item() for i in range(1, len(p))]
            expect_out = [ref[len(p) - 1 + j, r.output_ids[j]].item() for j in range(3)]
            assert len(r.input_logprobs) == len(p) - 1
            torch.testing.assert_close(torch.tensor(r.input_logprobs), torch.tensor(expect_in), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(torch.tensor(r.output_logprobs), torch.tensor(expect_out), atol=1e-4, rtol=1e-4)

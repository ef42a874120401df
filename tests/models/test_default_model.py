"""The default model (SmolLM2-135M-Instruct from its GGUF) against HF transformers, float32, greedy."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from srt.hf_transformers_utils import get_tokenizer
from srt.model_executor.static_batch import StaticBatchGenerator
from srt.sampling.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence what a CPU does.",
    "Translate 'good morning' into Spanish.",
    "Give me a short tip for writing clean Python code, with an example function that adds two numbers.",
    "Hi!",
    "Why is the sky blue? Answer briefly.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def setup(default_model_path, runner_factory):
    tok = get_tokenizer(default_model_path)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS
    ]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    runner = runner_factory(default_model_path, max_total_tokens=8192, max_running_requests=16)
    return prompts, hf, StaticBatchGenerator(runner), tok


@pytest.fixture(scope="module")
def hf_outputs(setup):
    prompts, hf, _, tok = setup
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(
                torch.tensor([p]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
            outs.append(ids[0, len(p) :].tolist())
    return outs


def test_prompts_are_chat_formatted_and_mixed_length(setup):
    prompts, _, _, tok = setup
    assert len({len(p) for p in prompts}) >= 5
    assert tok.decode(prompts[0]).startswith("<|im_start|>system")
    assert prompts[0][-4:] == tok.encode("<|im_start|>assistant\n")


def test_last_position_logits_within_1e3(setup):
    prompts, hf, gen, _ = setup
    ours = gen.prefill_logits(prompts)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = hf(torch.tensor([p])).logits[0, -1].float()
            assert (ours[i] - ref).abs().max().item() < 1e-3


def test_greedy_batch_matches_hf(setup, hf_outputs):
    prompts, _, gen, tok = setup
    out = gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS))
    assert [r.output_ids for r in out] == hf_outputs
    # non-vacuous: real text came out, and at least one answer ran the full length
    assert any(len(o) == NEW_TOKENS for o in hf_outputs)
    assert "Paris" in tok.decode(out[0].output_ids)


def test_greedy_one_by_one_matches_hf(setup, hf_outputs):
    prompts, _, gen, _ = setup
    for p, expect in zip(prompts, hf_outputs):
        assert gen.generate([p], SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS))[0].output_ids == expect
    allocator = gen.runner.token_to_kv_pool_allocator
    assert allocator.available_size() == allocator.size

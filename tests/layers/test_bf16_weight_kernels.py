"""`--dtype bfloat16` on a CPU without fast bf16 matmuls: the weights stay bf16 (half the bytes of
float32) and the C++ kernels multiply them in float32 registers, instead of oneDNN's slow bf16
GEMMs. RADIXSERVE_BF16_WEIGHT_KERNELS=1 forces that path on any CPU, so it is tested everywhere."""

import torch

from srt.model_executor.static_batch import StaticBatchGenerator
from srt.sampling.sampling_params import SamplingParams

PROMPTS = [[5, 17, 33, 101, 7], list(range(40, 70)), [3] * 12]


def test_bf16_weights_on_the_kernels_match_float32(tiny_model_factory, runner_factory, monkeypatch):
    path = tiny_model_factory("LlamaForCausalLM")
    monkeypatch.setenv("RADIXSERVE_BF16_WEIGHT_KERNELS", "1")
    ours = runner_factory(path, dtype="bfloat16")
    assert ours.weight_report["formats"]["linear"] == "bfloat16 (float32 compute)"
    assert all(layer.fused_decode is not None for layer in ours.model.model.layers)
    linear_bytes = sum(p.numel() * 2 for n, p in ours.model.named_parameters() if "proj" in n)
    assert ours.weight_bytes <= linear_bytes + 2 * sum(p.numel() for p in ours.model.parameters())

    reference = runner_factory(path, dtype="float32")
    got = StaticBatchGenerator(ours).prefill_logits(PROMPTS).float()
    want = StaticBatchGenerator(reference).prefill_logits(PROMPTS)
    # bf16 weights and activations against float32: about 2^-8 relative per value, a few of them
    # compounding over two layers; the logits are O(1), so 0.1 absolute is loose but not vacuous
    # (random weights give logit differences of order 1).
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.1)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 2 / 3

    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    fused = StaticBatchGenerator(ours).generate(PROMPTS, params)
    for layer in ours.model.model.layers:
        layer.fused_decode = None
    python = StaticBatchGenerator(ours).generate(PROMPTS, params)
    assert [r.output_ids for r in fused] == [r.output_ids for r in python]

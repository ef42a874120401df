"""Quantized weights on CUDA (skipped without a GPU; run by benchmark/gpu_check.sh): `--quantization
fp8` through torch._scaled_mm against bf16, and a GGUF file on CUDA, dequantized to --dtype at load,
against the same file dequantized on the CPU."""

from __future__ import annotations

import pytest
import torch
from test_hf_quantized import PROMPTS, prefill_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_fp8_tracks_bfloat16(tiny_model_factory):
    path = tiny_model_factory("LlamaForCausalLM", hidden_size=128, intermediate_size=256)
    args = dict(device="cuda", dtype="bfloat16")
    ref, dense = prefill_logits(path, PROMPTS, **args)
    out, report = prefill_logits(path, PROMPTS, quantization="fp8", **args)
    assert report["quantization"] == "fp8" and out.is_cuda
    ratio = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    print(f"\nfp8 on {torch.cuda.get_device_name(0)}: max |dlogit| / max |logit| = {ratio:.3f}")
    assert ratio < 0.3, ratio  # the CPU test's bound (tests/model_loader/test_hf_quantized.py)
    assert report["weight_bytes"] < 0.8 * dense["weight_bytes"]  # 1 byte per linear weight, not 2


def test_fp8_runs_scaled_mm_on_fp8_gpus(tiny_model_factory):
    from conftest import make_runner

    from srt.layers.quantization.fp8 import Fp8LinearMethod

    path = tiny_model_factory("LlamaForCausalLM", hidden_size=128, intermediate_size=256)
    runner = make_runner(path, device="cuda", dtype="bfloat16", quantization="fp8")
    methods = [
        m.quant_method for m in runner.model.modules() if isinstance(getattr(m, "quant_method", None), Fp8LinearMethod)
    ]
    assert methods and all(m.weight.is_cuda and m.weight.dtype == torch.float8_e4m3fn for m in methods)
    fp8_gpu = torch.cuda.get_device_capability() >= (8, 9)
    assert all(m.scaled_mm == fp8_gpu for m in methods)


def test_gguf_on_cuda_is_dequantized_at_load(tmp_path):
    from conftest import make_runner
    from test_gguf_quantized import write_quantized_gguf

    from srt.configs.model_config import ModelLoadError
    from srt.model_executor.static_batch import StaticBatchGenerator
    from srt.model_loader.default_model import resolve_model_path

    path = resolve_model_path(str(write_quantized_gguf(tmp_path / "tiny.gguf", "llama")))
    prompts = [[5, 9, 13, 21, 30], [7, 8]]
    cpu = make_runner(path, quantization="none")
    gpu = make_runner(path, device="cuda")
    assert gpu.quantization == "none"
    ref = StaticBatchGenerator(cpu).prefill_logits(prompts)
    out = StaticBatchGenerator(gpu).prefill_logits(prompts).float().cpu()
    torch.testing.assert_close(out, ref, atol=2e-3 * ref.abs().max().item(), rtol=0)
    with pytest.raises(ModelLoadError, match="on cuda GGUF weights are dequantized at load"):
        make_runner(path, device="cuda", quantization="gguf")

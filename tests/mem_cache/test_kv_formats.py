"""The KV pool's stored formats (--kv-cache-dtype): sizes, writes, and the runner's memory budget."""

from __future__ import annotations

import json

import pytest
import torch

from kernels import reference
from srt.mem_cache.memory_pool import MHATokenToKVPool, load_fp8_kv_scales


@pytest.mark.parametrize("kv_format", ["float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_pool_stores_and_gathers_each_format(kv_format):
    pool = MHATokenToKVPool(64, 4, torch.float32, 2, 16, 2, "cpu", kv_format, [0.5, 2.0])
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 2, 16, generator=g) * 3, torch.randn(5, 2, 16, generator=g)
    loc = torch.tensor([7, 4, 30, 31, 60])
    pool.set_kv_buffer(1, loc, k, v)
    index = (loc.unsqueeze(1) * 2 + torch.arange(2)).reshape(-1)
    gk, gv = pool.gather(1, index, torch.float32)
    scale = 2.0 if kv_format.startswith("fp8") else 1.0
    want_k = reference.dequantize_kv(*reference.quantize_kv(k, kv_format, scale), kv_format, scale)
    want_v = reference.dequantize_kv(*reference.quantize_kv(v, kv_format, scale), kv_format, scale)
    assert torch.equal(gk, want_k.reshape(-1, 16)) and torch.equal(gv, want_v.reshape(-1, 16))
    # decoded values are close to what was written: exact for float32, else the format's rounding
    # (relative for normal numbers; fp8 subnormals have a fixed step: 2^-9 e4m3, 2^-16 e5m2, times the scale)
    rel = {"float32": 0, "bfloat16": 2**-8, "int8": 1 / 254 + 1e-6, "fp8_e4m3": 2**-4, "fp8_e5m2": 2**-3}[kv_format]
    floor = {"fp8_e4m3": 2**-10 * scale, "fp8_e5m2": 2**-17 * scale}.get(kv_format, 0.0) + 1e-7
    bound = rel * (k.abs().amax(-1, keepdim=True) if kv_format == "int8" else k.abs()) + floor
    assert ((gk.view(5, 2, 16) - k).abs() <= bound).all()
    assert not pool.k_buffer[0].any()  # other layers untouched


def test_bytes_per_token():
    assert MHATokenToKVPool.bytes_per_token(3, 64, 30, torch.float32) == 2 * 3 * 64 * 30 * 4
    assert MHATokenToKVPool.bytes_per_token(3, 64, 30, torch.float32, "bfloat16") == 2 * 3 * 64 * 30 * 2
    assert MHATokenToKVPool.bytes_per_token(3, 64, 30, torch.float32, "fp8_e4m3") == 2 * 3 * 64 * 30
    assert MHATokenToKVPool.bytes_per_token(3, 64, 30, torch.float32, "int8") == 2 * 3 * 30 * (64 + 4)


def test_int8_pool_holds_over_3_5x_the_float32_tokens(tiny_model_factory, runner_factory, monkeypatch):
    """The same --mem-fraction-static budget in bytes: int8 KV (one byte per value plus a float32
    scale per token and head) holds >= 3.5x the tokens of float32 KV at head_dim 64 (the default
    model's; 4 / (1 + 4 / head_dim) in general). Available memory is pinned, so both runners see
    the same budget."""
    from srt.model_executor import model_runner

    gib = 2**30
    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda device: 8 * gib)
    monkeypatch.setattr(model_runner, "memory_info", lambda device: (8 * gib, 16 * gib))
    path = tiny_model_factory("LlamaForCausalLM", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    sizes = {}
    for kv in ("auto", "bfloat16", "fp8_e4m3", "int8"):
        runner = runner_factory(path, kv_cache_dtype=kv, max_total_tokens=None, mem_fraction_static=0.01)
        pool = runner.token_to_kv_pool
        sizes[kv] = runner.max_total_num_tokens
        assert pool.k_buffer[0].dtype == {"auto": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}.get(
            kv, torch.uint8
        )
        assert sizes[kv] * runner.kv_bytes_per_token <= 0.01 * 8 * gib
    print(f"\nKV pool tokens for one budget: {sizes}")
    assert sizes["int8"] >= 3.5 * sizes["auto"]
    assert sizes["fp8_e4m3"] >= 3.9 * sizes["auto"] and sizes["bfloat16"] >= 1.95 * sizes["auto"]


def test_fp8_scales_from_the_quantization_param_path(tiny_model_factory, runner_factory, tmp_path):
    """SGLang's JSON: per TP rank, one scale per layer for K and V; errors name what is wrong."""
    path = tiny_model_factory("LlamaForCausalLM")
    layers = json.load(open(f"{path}/config.json"))["num_hidden_layers"]
    good = tmp_path / "kv.json"
    scales = {str(i): 0.5 + i for i in range(layers)}
    good.write_text(json.dumps({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": scales}}}))
    runner = runner_factory(path, kv_cache_dtype="fp8_e4m3", quantization_param_path=str(good))
    assert runner.token_to_kv_pool.k_scale == runner.token_to_kv_pool.v_scale == [0.5 + i for i in range(layers)]
    with pytest.raises(ValueError, match="kv_cache.dtype is 'float8_e4m3fn', but --kv-cache-dtype fp8_e5m2 needs"):
        load_fp8_kv_scales(str(good), "fp8_e5m2", 0, layers)
    with pytest.raises(ValueError, match="no kv_cache.scaling_factor for TP rank 1"):
        load_fp8_kv_scales(str(good), "fp8_e4m3", 1, layers)
    with pytest.raises(ValueError, match=rf"scaling_factor\['0'\]\['{layers}'\] must be a positive number, got None"):
        load_fp8_kv_scales(str(good), "fp8_e4m3", 0, layers + 1)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read it as JSON"):
        load_fp8_kv_scales(str(bad), "fp8_e4m3", 0, layers)

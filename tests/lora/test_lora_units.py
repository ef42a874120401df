"""LoRA pieces without a server: --lora-paths forms and server-argument checks, batch segments, the two
backends against each other, and the pool's layout (fused parts, tensor-parallel shards) against a
dense reference of the adapter's delta."""

from __future__ import annotations

import json

import pytest
import torch

from srt.lora.adapter import LoRAError, LoRARef, parse_lora_paths
from srt.lora.backend import LoRABatchInfo, TorchNativeBackend
from srt.server_args import ServerArgs


def test_lora_paths_forms(tmp_path):
    refs = parse_lora_paths(
        ["/x/y/adapter-1/", "named=/p/q", json.dumps({"lora_name": "pin", "lora_path": "/r", "pinned": True})]
    )
    assert refs == [LoRARef("adapter-1", "/x/y/adapter-1"), LoRARef("named", "/p/q"), LoRARef("pin", "/r", True)]
    with pytest.raises(LoRAError, match="twice"):
        parse_lora_paths(["a=/1", "a=/2"])
    with pytest.raises(LoRAError, match="not valid JSON"):
        parse_lora_paths(["{oops"])
    with pytest.raises(LoRAError, match="pinned"):
        parse_lora_paths([json.dumps({"lora_name": "p", "lora_path": "/r", "pinned": "yes"})])


def test_server_args_checks(tmp_path):
    args = ServerArgs(enable_lora=True)
    assert (args.max_lora_rank, args.max_loaded_loras, args.lora_backend) == (16, 8, "torch_native")
    assert args.lora_target_modules is not None and len(args.lora_target_modules) == 7
    with pytest.raises(ValueError, match="--max-loaded-loras"):
        ServerArgs(enable_lora=True, max_loras_per_batch=4, max_loaded_loras=2)
    with pytest.raises(ValueError, match="speculative"):
        ServerArgs(enable_lora=True, speculative_algorithm="NGRAM")
    with pytest.raises(ValueError, match="--lora-target-modules 'lm_head'"):
        ServerArgs(enable_lora=True, lora_target_modules=["lm_head"])
    with pytest.raises(ValueError, match="adapter_config.json"):
        ServerArgs(lora_paths=[f"a={tmp_path}"])  # --lora-paths alone turns LoRA on and checks the folders
    with pytest.raises(ValueError, match="triton needs a CUDA device"):
        import os

        saved = os.environ.pop("TRITON_INTERPRET", None)
        try:
            ServerArgs(enable_lora=True, lora_backend="triton", device="cpu")
        finally:
            if saved is not None:
                os.environ["TRITON_INTERPRET"] = saved


def test_segments_merge_neighbours_and_skip_base_rows():
    info = LoRABatchInfo.build([-1, 2, 2, 0, -1, 0], [3, 1, 4, 2, 5, 1], "cpu")
    assert info is not None
    assert info.segments == [(2, 3, 5), (0, 8, 2), (0, 15, 1)]
    assert info.seg_start.tolist() == [3, 8, 15] and info.seg_slot.tolist() == [2, 0, 0] and info.max_len == 5
    assert LoRABatchInfo.build([-1, -1], [4, 1], "cpu") is None
    assert LoRABatchInfo.build(None or [], [], "cpu") is None


def _delta_reference(x, A, B, slots_per_row):
    out = torch.zeros(x.shape[0], B.shape[1])
    for r, s in enumerate(slots_per_row):
        if s >= 0:
            out[r] = (x[r] @ A[s].T) @ B[s].T
    return out


@pytest.mark.parametrize("backend_name", ["torch_native", "triton"])
def test_backends_add_each_rows_adapter_delta(backend_name):
    from srt.lora.backend import make_backend

    if backend_name == "triton":
        pytest.importorskip("triton")
    backend = make_backend(backend_name)
    g = torch.Generator().manual_seed(0)
    slots, rows = [1, -1, 3, 3, 0], [5, 2, 1, 3, 1]
    per_row = [s for s, n in zip(slots, rows) for _ in range(n)]
    x = torch.randn(len(per_row), 48, generator=g)
    A = torch.randn(4, 24, 48, generator=g) * 0.2
    B = torch.randn(4, 40, 24, generator=g) * 0.2
    base = torch.randn(len(per_row), 40, generator=g)
    info = LoRABatchInfo.build(slots, rows, "cpu")
    assert info is not None
    out = base.clone()
    backend.apply(x, A, B, info, out)
    torch.testing.assert_close(out, base + _delta_reference(x, A, B, per_row), atol=1e-4, rtol=1e-4)
    # the two-phase form (tensor-parallel row layers reduce xa in between) gives the same
    out2 = base.clone()
    backend.expand(backend.shrink(x, A, info), B, info, out2)
    torch.testing.assert_close(out2, out, atol=1e-5, rtol=1e-5)
    assert isinstance(TorchNativeBackend().shrink(x, A, info), torch.Tensor)


def test_pool_layout_matches_dense_delta(tiny_model_factory, runner_factory, tmp_path):
    """Every fused projection's output, with the adapter's slot, equals base + scaling * B @ A of the
    PEFT module(s) it fuses (q/k/v and gate/up parts in their own blocks), at a rank below the pool's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from srt.lora.adapter import load_adapter

    path = tiny_model_factory()
    torch.manual_seed(3)
    pm = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=12, target_modules="all-linear", init_lora_weights=False),
    )
    pm.save_pretrained(str(tmp_path / "ad"))
    runner = runner_factory(path, enable_lora=True, max_lora_rank=8, max_loaded_loras=2, max_loras_per_batch=2)
    manager = runner.lora_manager
    adapter = load_adapter(str(tmp_path / "ad"), manager.base, manager.max_rank, manager.targets)
    manager.load(1, adapter)
    layer = runner.model.model.layers[1]
    hf_layer = pm.base_model.model.model.layers[1]
    x = torch.randn(3, 64)
    manager.begin([1], [3])
    try:
        qkv = layer.self_attn.qkv_proj(x)
        gate_up = layer.mlp.gate_up_proj(x)
        down = layer.mlp.down_proj(torch.randn(3, 128))
    finally:
        manager.end()
    with torch.no_grad():
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        want_qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
        want_gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
    torch.testing.assert_close(qkv, want_qkv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gate_up, want_gate_up, atol=1e-5, rtol=1e-5)
    assert down.shape == (3, 64)
    # without a batch set, the layers are the base model's
    with torch.no_grad():
        torch.testing.assert_close(layer.self_attn.o_proj(x), attn.o_proj.base_layer(x), atol=1e-5, rtol=1e-5)

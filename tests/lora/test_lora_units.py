"""LoRA pieces without a server: --lora-paths forms and server-argument checks, batch segments, the two
backends against each other, and the pool's layout (fused parts, tensor-parallel shards) against a
dense reference of the adapter's delta."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from srt.lora.adapter import LoRAError, LoRARef, parse_lora_paths
from srt.lora.backend import CpuBackend, LoRABatchInfo
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
    assert (args.max_lora_rank, args.max_loaded_loras, args.lora_backend) == (16, 8, "auto")
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
    start, _, slot = info.seg_tensors
    assert start.tolist() == [3, 8, 15] and slot.tolist() == [2, 0, 0] and info.max_len == 5
    assert LoRABatchInfo.build([-1, -1], [4, 1], "cpu") is None
    assert LoRABatchInfo.build(None or [], [], "cpu") is None


def _delta_reference(x, A, Bt, slots_per_row):
    out = torch.zeros(x.shape[0], Bt.shape[2])
    for r, s in enumerate(slots_per_row):
        if s >= 0:
            out[r] = (x[r].float() @ A[s].float().T) @ Bt[s].float()
    return out


@pytest.mark.parametrize("backend_name", ["cpu", "torch_native", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_add_each_rows_adapter_delta(backend_name, dtype, request):
    """Segments of several slots (a gap of base rows, rows past a 4-row block, one segment long enough
    for the C++ backend to hand it to torch's GEMMs), a fused projection of 3 parts (each part's rank
    block of Bt only feeds its own output features), one call per form."""
    from srt.lora.backend import make_backend

    if backend_name == "triton":
        pytest.importorskip("triton")
    ops = request.getfixturevalue("ops") if backend_name == "cpu" else None
    backend = make_backend(backend_name, "cpu", ops)
    pool_dtype = backend.pool_dtype or dtype
    g = torch.Generator().manual_seed(0)
    slots, rows = [1, -1, 3, 3, 0, 2], [6, 2, 1, 3, 1, 70]
    per_row = [s for s, n in zip(slots, rows) for _ in range(n)]
    parts, rank = [16, 12, 12], 8  # q, k, v of one fused projection, K = 3 x 8
    x = torch.randn(len(per_row), 48, generator=g).to(dtype)
    A = (torch.randn(4, 24, 48, generator=g) * 0.2).to(pool_dtype)
    Bt = torch.zeros(4, 24, 40)
    for p, (start, size) in enumerate(zip([0, 16, 28], parts)):
        Bt[:, p * rank : (p + 1) * rank, start : start + size] = torch.randn(4, rank, size, generator=g) * 0.2
    Bt = Bt.to(pool_dtype)
    base = torch.randn(len(per_row), 40, generator=g).to(dtype)
    info = LoRABatchInfo.build(slots, rows, "cpu")
    assert info is not None and [s for s in info.segments if s[2] >= CpuBackend.LONG_SEGMENT] == [(2, 13, 70)]
    tol: dict[str, Any] = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    out = base.clone()
    backend.apply(x, A, Bt, info, out, parts)
    want = base.float() + _delta_reference(x, A, Bt, per_row)
    torch.testing.assert_close(out.float(), want, **tol)
    assert torch.equal(out[6:8], base[6:8])  # base rows untouched
    # the two-phase form (tensor-parallel row layers reduce xa in between) gives the same
    out2 = base.clone()
    backend.expand(backend.shrink(x, A, info), Bt, info, out2, parts)
    torch.testing.assert_close(out2.float(), want, **tol)


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
    model: Any = runner.model
    peft_base: Any = pm.base_model
    layer, hf_layer = model.model.layers[1], peft_base.model.model.layers[1]
    x = torch.randn(3, 64)
    manager.batch = LoRABatchInfo.build([1], [3], "cpu")  # one extend of 3 rows under slot 1
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


class _StubPool:
    """A LoRAManager's interface to the registry, without weights."""

    def __init__(self, slots: int):
        self.slots, self.max_rank, self.targets, self.base = slots, 16, frozenset(), None
        self.backend = SimpleNamespace(name="stub")
        self.loaded: list[tuple[int, str]] = []

    def read(self, path: str):
        from srt.lora.adapter import LoRAAdapter

        return LoRAAdapter(path, 4, frozenset(), path, {})

    def load(self, slot, adapter) -> None:
        self.loaded.append((slot, adapter.path))


def _registry(slots: int, policy: str, monkeypatch):
    from srt.lora.registry import LoRARegistry

    return LoRARegistry(_StubPool(slots), 2, policy)  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_eviction_policy_spares_running_and_pinned(policy, monkeypatch):
    r = _registry(3, policy, monkeypatch)
    r.register(LoRARef("p", "/p", pinned=True), set())
    r.register(LoRARef("x", "/x"), set())
    r.register(LoRARef("y", "/y"), set())
    assert r.slot_for("x", set()) == 1  # x is now the most recently used
    r.register(LoRARef("z", "/z"), set())  # evicts y under LRU (x was used later), x under FIFO
    victim = "y" if policy == "lru" else "x"
    assert r.entries[victim].slot is None and r.entries["z"].slot is not None and r.entries["p"].slot == 0
    other = "x" if policy == "lru" else "y"
    # every unpinned slot's adapter is running: nothing can be evicted, the request waits
    assert r.slot_for(victim, {"z", other}) is None
    assert r.slot_for(victim, {"z"}) is not None and r.entries[other].slot is None
    r.request_unload("z", "rid-1")
    with pytest.raises(LoRAError, match="not loaded"):
        r.accepts("z")
    assert r.finish_unloads({"z"}) == []  # still running
    assert r.finish_unloads(set()) == [("z", "rid-1")] and "z" not in r.entries
    r.register(LoRARef("q", "/q", pinned=True), set())  # into z's freed slot: 2 of 3 slots pinned
    with pytest.raises(LoRAError, match="at least one slot must stay free"):
        r.register(LoRARef("q2", "/q2", pinned=True), set())
    assert r.status(set())["evictions"] == 2


def test_fused_decode_layer_adds_lora_like_python_layers(runner_factory, default_model_path, tmp_path):
    """The default model's quantized decode step runs one C++ op per layer (kernels/csrc/
    cpu_decode_layer.cpp); with adapters in the batch it adds their deltas in the same places as the
    Python layers: same tokens and logprobs, for a batch of two adapters and a base row."""
    import dataclasses

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from srt.lora.adapter import load_adapter
    from srt.model_executor.static_batch import StaticBatchGenerator
    from srt.model_loader.default_model import default_gguf_path, resolve_model_path
    from srt.sampling.sampling_params import SamplingParams

    for seed in (0, 1):
        torch.manual_seed(seed)
        pm = get_peft_model(
            AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32),
            LoraConfig(r=8, lora_alpha=32, target_modules="all-linear", init_lora_weights=False),
        )
        pm.save_pretrained(str(tmp_path / f"ad{seed}"))
    runner = runner_factory(
        resolve_model_path(default_gguf_path()),
        quantization="gguf",
        enable_lora=True,
        max_loaded_loras=2,
        max_loras_per_batch=2,
        max_lora_rank=8,
    )
    manager = runner.lora_manager
    assert manager.backend.name == "cpu"
    for slot in (0, 1):
        manager.load(slot, load_adapter(str(tmp_path / f"ad{slot}"), manager.base, manager.max_rank, manager.targets))
    layers = list(runner.model.model.layers)
    fused = [layer.fused_decode for layer in layers]
    assert all(f is not None for f in fused)
    prompts = [[1, 504, 3067, 314, 260], [1, 2524, 4340], [1, 79, 2313, 23, 9080, 282, 1116]]

    def generate(slots):
        def forward(fb):
            return runner.forward(dataclasses.replace(fb, lora_slots_cpu=slots))

        params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
        return StaticBatchGenerator(runner, forward).generate(prompts, params, return_logprob=True)

    with_op = generate([0, -1, 1])
    for layer in layers:
        layer.fused_decode = None
    without = generate([0, -1, 1])
    for layer, f in zip(layers, fused):
        layer.fused_decode = f
    base = generate([-1, -1, -1])
    assert [r.output_ids for r in with_op] == [r.output_ids for r in without]
    for a, b in zip(with_op, without):
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-5
    assert with_op[1].output_ids == base[1].output_ids
    assert (
        with_op[0].output_logprobs != base[0].output_logprobs and with_op[2].output_logprobs != base[2].output_logprobs
    )

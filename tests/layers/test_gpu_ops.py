"""Fused GPU norm/activation ops in the layers: which provider is chosen, and that the layers give
the torch results through either (the Triton kernels under the interpreter without a GPU; a
stand-in with sgl-kernel's documented in-place contract, since sgl-kernel needs CUDA)."""

import importlib.machinery
import importlib.util
import os
import sys
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read at the kernels' first launch

from kernels import reference  # noqa: E402
from srt.layers import gpu_ops  # noqa: E402
from srt.layers.activation import SiluAndMul  # noqa: E402
from srt.layers.layernorm import RMSNorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fake_sgl_kernel() -> types.ModuleType:
    mod = types.ModuleType("sgl_kernel")
    mod.__spec__ = importlib.machinery.ModuleSpec("sgl_kernel", None)
    mod.rmsnorm = lambda x, w, eps: reference.rms_norm(x, w, eps)

    def fused_add_rmsnorm(x, residual, w, eps):  # in place: residual += x; x = norm(residual) * w
        normed, summed = reference.rms_norm(x, w, eps, residual)
        residual.copy_(summed)
        x.copy_(normed)

    mod.fused_add_rmsnorm = fused_add_rmsnorm
    mod.silu_and_mul = reference.silu_and_mul
    return mod


def providers():
    out = [gpu_ops.SglKernelOps(fake_sgl_kernel())]
    try:
        import triton  # noqa: F401

        from kernels import triton_ops

        out.append(gpu_ops.TritonOps(triton_ops))
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("ops", providers(), ids=lambda o: o.name)
def test_layers_match_torch(ops):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, eps=1e-6).to(DEVICE)
    norm.weight.data = torch.randn(64, generator=g).to(DEVICE)
    x, res = (torch.randn(5, 64, generator=g).to(DEVICE) for _ in range(2))
    act, gate_up = SiluAndMul(), torch.randn(5, 96, generator=g).to(DEVICE)
    expect_plain, (expect_normed, expect_sum), expect_act = norm(x), norm(x, res), act(gate_up)
    norm.gpu_ops = act.gpu_ops = ops
    plain = norm(x.clone())
    normed, summed = norm(x.clone(), res.clone())
    torch.testing.assert_close(plain, expect_plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(normed, expect_normed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(summed, expect_sum, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(act(gate_up), expect_act, atol=1e-5, rtol=1e-5)


def test_provider_choice(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_DISABLE_GPU_OPS", "1")
    assert gpu_ops.load() is None
    monkeypatch.delenv("RADIXSERVE_DISABLE_GPU_OPS")
    monkeypatch.setitem(sys.modules, "sgl_kernel", fake_sgl_kernel())
    assert gpu_ops.load().name == "sgl-kernel"
    monkeypatch.delitem(sys.modules, "sgl_kernel")
    if importlib.util.find_spec("sgl_kernel") is None:
        expect = "triton" if importlib.util.find_spec("triton") is not None else None
        assert getattr(gpu_ops.load(), "name", None) == expect

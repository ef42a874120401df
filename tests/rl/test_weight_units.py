"""The pieces of weight updates without a server: what is refused before anything is written, the
payload reader's allow-list, and an update's round trip through packed (oneDNN) weights."""

import os
import pickle
import re

import pytest
import torch

from srt.rl import serialization
from srt.rl.weights import WeightUpdateError, check_named, load_named, manifest_of, read_weight, refuse_reason


@pytest.fixture(scope="module")
def runner(tiny_model_factory, runner_factory):
    return runner_factory(tiny_model_factory())


def test_manifest_checks_names_shapes_and_dtypes(runner):
    manifest = manifest_of(runner.model)
    name = "model.layers.0.mlp.gate_proj.weight"
    shape = manifest[name][0]
    check_named(manifest, [(name, torch.zeros(shape))])
    for named, words in [
        ([("model.layers.0.mlp.gate.weight", torch.zeros(shape))], "did you mean model.layers.0.mlp.gate_proj.weight"),
        ([(name, torch.zeros(1, 1))], "shape [1, 1]"),
        ([(name, torch.zeros(shape, dtype=torch.int64))], "int64"),
        ([], "no tensors"),
    ]:
        with pytest.raises(WeightUpdateError, match=re.escape(words)):
            check_named(manifest, named)


def test_an_update_through_packed_weights_reads_back(runner):
    """A fused (packed) projection takes one of its parts; the others keep their values."""
    model = runner.model
    q, k = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"
    k_before = torch.tensor(read_weight(model, k, 1000))
    new_q = torch.randn(manifest_of(model)[q][0])
    load_named(model, [(q, new_q)], partial=True)
    assert torch.allclose(torch.tensor(read_weight(model, q, 1000)), new_q)
    assert torch.equal(torch.tensor(read_weight(model, k, 1000)), k_before)


def test_quantized_weights_are_refused(tiny_model_factory, runner_factory, ops):
    if ops is None:
        pytest.skip("the C++ CPU kernels are not built here")
    quantized = runner_factory(tiny_model_factory(), quantization="w8a8_int8")
    reason = refuse_reason(quantized.model)
    assert reason is not None and "quantized" in reason and "--quantization none" in reason


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_payloads_hold_only_tensors():
    named = [("a", torch.arange(6.0).view(2, 3)), ("b", torch.ones(2, dtype=torch.bfloat16))]
    back = serialization.named_tensors(serialization.loads(serialization.dumps_b64(named)))
    assert [n for n, _ in back] == ["a", "b"] and all(torch.equal(x, y) for (_, x), (_, y) in zip(named, back))
    with pytest.raises(ValueError, match="posix.system"):
        serialization.loads(pickle.dumps(Evil()))
    with pytest.raises(ValueError, match="builtins.eval"):
        serialization.loads(pickle.dumps(eval))
    with pytest.raises(ValueError, match="base64"):
        serialization.loads("%%%")
    with pytest.raises(ValueError, match="pair"):
        serialization.named_tensors([("a",)])

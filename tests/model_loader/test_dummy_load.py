"""--load-format dummy: random weights from config.json alone, small and finite, the same every
time, built where the model lives."""

import pytest
import torch
from transformers import AutoConfig

from srt.configs.model_config import ModelConfig, ModelLoadError
from srt.model_executor.static_batch import StaticBatchGenerator
from srt.model_loader.loader import DUMMY_STD, load_model
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs


@pytest.fixture
def config_only(tmp_path) -> str:
    cfg = AutoConfig.for_model(
        "llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        attention_bias=True,
        architectures=["LlamaForCausalLM"],
    )
    cfg.save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    return str(tmp_path)


def test_dummy_weights(config_only):
    model = load_model(ModelConfig.from_path(config_only), torch.float32, "cpu", load_format="dummy")
    params = dict(model.named_parameters())
    for name, p in params.items():
        assert torch.isfinite(p).all(), name
        if p.dim() >= 2:
            assert abs(p.std().item() - DUMMY_STD) < 0.1 * DUMMY_STD, name
        elif name.endswith("bias"):
            assert not p.any(), name
        else:
            assert (p == 1).all(), name  # norm scales
    again = dict(
        load_model(ModelConfig.from_path(config_only), torch.float32, "cpu", load_format="dummy").named_parameters()
    )
    assert all(torch.equal(params[n], again[n]) for n in params)  # fixed seed


def test_dummy_model_runs(config_only, runner_factory):
    gen = StaticBatchGenerator(runner_factory(config_only, load_format="dummy"))
    logits = gen.prefill_logits([[1, 2, 3, 4], [5, 6]])
    assert torch.isfinite(logits).all() and logits.std() > 0
    out = gen.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].output_ids) == 4


def test_auto_format_needs_the_checkpoint(config_only):
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(ModelConfig.from_path(config_only), torch.float32, "cpu")
    with pytest.raises(ValueError, match="--load-format"):
        ServerArgs(load_format="pt")

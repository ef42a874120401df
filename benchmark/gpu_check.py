"""Helpers of benchmark/gpu_check.sh, the prepared device check of the GPU path (read its header).

    python benchmark/gpu_check.py prepare        # here: the default model's config + tokenizer -> .gpu_check/
    python benchmark/gpu_check.py test-model     # device: a model folder for the GPU tests (printed last)
    python benchmark/gpu_check.py bench OUT.json # device: Llama-3.1-8B-shaped dummy model, bf16, through the Engine
    python benchmark/gpu_check.py summary DIR    # the compact summary of a run's stage results

The default model (SmolLM2-135M-Instruct) ships in a 94 MB package, too large to travel to the
device machine; `prepare` copies its config and tokenizer (a few MB) instead, and `test-model` then
builds the same shape with random weights, so the GPU tests run the same code at the same shapes
(the summary says which model was used).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BUNDLE = os.path.join(ROOT, ".gpu_check", "default-model")  # config + tokenizer of the default model
WORK = os.environ.get("GPU_CHECK_WORK", "/tmp/gpu_check")
HBM_BYTES_PER_S = 4.8e12  # H200

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
}
TOKENIZER_FILES = ("tokenizer", "special_tokens", "chat_template")


def default_model_or_none() -> str | None:
    from srt.configs.model_config import ModelLoadError
    from srt.model_loader.default_model import resolve_default_model

    try:
        return resolve_default_model(progress=False)
    except ModelLoadError:
        return None


def copy_tokenizer(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name.startswith(TOKENIZER_FILES):
            shutil.copy(os.path.join(src, name), dst)


def tokenizer_source() -> str:
    src = default_model_or_none() or (BUNDLE if os.path.isfile(os.path.join(BUNDLE, "config.json")) else None)
    if src is None:
        sys.exit(
            "no default model and no .gpu_check/default-model: run `bash benchmark/gpu_check.sh prepare` "
            "on a machine with the project's .venv and carry .gpu_check"
        )
    return src


def prepare() -> None:
    src = default_model_or_none()
    if src is None:
        sys.exit("the default model is not installed here (make install)")
    shutil.rmtree(BUNDLE, ignore_errors=True)
    copy_tokenizer(src, BUNDLE)
    for name in ("config.json", "generation_config.json"):
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), BUNDLE)
    size = sum(os.path.getsize(os.path.join(BUNDLE, f)) for f in os.listdir(BUNDLE))
    print(f"{BUNDLE}: {len(os.listdir(BUNDLE))} files, {size / 2**20:.1f} MiB")


def test_model() -> None:
    """The default model when it is installed, else its shape with random weights (N(0, 0.05),
    fixed seed) saved as safetensors next to its config and tokenizer."""
    path = default_model_or_none()
    kind = "default model (SmolLM2-135M-Instruct)"
    if path is None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        src = tokenizer_source()
        path = os.path.join(WORK, "default-shape-random")
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            config = AutoConfig.from_pretrained(src)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() > 1:
                        p.normal_(0, 0.05)
            model.save_pretrained(path)
            copy_tokenizer(src, path)
        kind = "random weights in the default model's shape (its package is not installed here)"
    with open(os.path.join(WORK, "test_model.json"), "w") as f:
        json.dump({"path": path, "kind": kind}, f)
    print(path)


def weight_bytes(cfg: dict, dtype_bytes: int = 2) -> tuple[int, int]:
    """(all parameters, those a decode step reads: all but the embedding table) in bytes."""
    h, i, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    embed = v * h
    total = embed + layers * per_layer + h + (0 if cfg["tie_word_embeddings"] else v * h)
    return total * dtype_bytes, (total - embed) * dtype_bytes


def bench(out_path: str) -> None:
    from srt.entrypoints.engine import Engine

    model_dir = os.path.join(WORK, "llama-3.1-8b-shape")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(LLAMA_31_8B, f, indent=1)
    copy_tokenizer(tokenizer_source(), model_dir)
    total_bytes, read_bytes = weight_bytes(LLAMA_31_8B)
    result: dict = {"model": "Llama-3.1-8B shape, dummy weights, bfloat16", "weight_gb": round(total_bytes / 1e9, 2)}

    def save() -> None:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)

    rng = random.Random(0)

    def prompts(n: int, length: int = 256) -> list[list[int]]:
        return [[rng.randrange(1000, 30000) for _ in range(length)] for _ in range(n)]

    def params(n_out: int) -> dict:
        return {"temperature": 0, "max_new_tokens": n_out, "ignore_eos": True}

    start = time.perf_counter()
    engine = Engine(
        model_path=model_dir,
        load_format="dummy",
        dtype="bfloat16",
        cuda_graph_max_bs=256,
        max_running_requests=256,
        grammar_backend="none",
        log_level="warning",
    )
    try:
        result["startup_s"] = round(time.perf_counter() - start, 1)
        state = engine.get_server_info()["internal_states"][0]
        result["attention_backend"] = state.get("attention_backend")
        result["cuda_graph"] = state.get("cuda_graph")
        result["kv_capacity_tokens"] = state.get("kv_capacity")
        save()
        engine.generate(input_ids=prompts(4, 64), sampling_params=params(8))  # warm-up: prefill kernels

        # batch 1: decode time = (latency of 256 new tokens - latency of 1) / 255
        t = time.perf_counter()
        engine.generate(input_ids=prompts(1)[0], sampling_params=params(1))
        first = time.perf_counter() - t
        t = time.perf_counter()
        out = engine.generate(input_ids=prompts(1)[0], sampling_params=params(256))  # a fresh prompt: no cache hit
        full = time.perf_counter() - t
        assert out["meta_info"]["completion_tokens"] == 256
        tok_s = 255 / max(full - first, 1e-9)
        ceiling = HBM_BYTES_PER_S / read_bytes
        result["batch1"] = {
            "decode_tok_s": round(tok_s, 1),
            "ttft_s": round(first, 4),
            "hbm_ceiling_tok_s": round(ceiling, 1),
            "fraction_of_ceiling": round(tok_s / ceiling, 3),
            "bytes_per_step_gb": round(read_bytes / 1e9, 2),
        }
        save()

        for n in (64, 256):
            batch = prompts(n)
            t = time.perf_counter()
            outs = engine.generate(input_ids=batch, sampling_params=params(256))
            wall = time.perf_counter() - t
            generated = sum(o["meta_info"]["completion_tokens"] for o in outs)
            result[f"concurrency_{n}"] = {
                "output_tok_s": round(generated / wall, 1),
                "wall_s": round(wall, 2),
                "requests": n,
                "input_len": 256,
                "output_len": 256,
            }
            save()
        state = engine.get_server_info()["internal_states"][0]
        result["cuda_graph"] = state.get("cuda_graph")
        save()
    finally:
        engine.shutdown()


def summary(run_dir: str) -> None:
    def load(name: str):
        path = os.path.join(run_dir, name)
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return json.load(f) if name.endswith(".json") else f.read()

    print("=" * 72)
    print("radixserve GPU check")
    env = load("env.txt")
    if env:
        print(env.strip())
    for line in (load("stages.txt") or "").splitlines():
        print(f"stage {line}")
    model = load("test_model.json")
    if model:
        print(f"test model: {model['kind']}")
    log = (load("pytest.log") or "").splitlines()
    final = [ln for ln in log if ln.startswith("=") and (" passed" in ln or " failed" in ln or " error" in ln)]
    failed = [ln for ln in log if ln.startswith(("FAILED ", "ERROR "))]
    if not log:
        print("tests: no result")
    elif final:
        print("tests: " + final[-1].strip("= "))
    else:  # cut off: count the results -v printed so far
        counts = {
            w: sum(1 for ln in log if "::" in ln and f" {w}" in ln) for w in ("PASSED", "FAILED", "SKIPPED", "ERROR")
        }
        print("tests: no final line (timed out?); so far " + ", ".join(f"{n} {w.lower()}" for w, n in counts.items()))
    for ln in failed[:12]:
        print(f"  {ln[:160]}")
    b = load("bench.json")
    if b:
        print(
            f"bench: {b.get('model')}, {b.get('weight_gb')} GB of weights, start-up {b.get('startup_s')} s, "
            f"backend {b.get('attention_backend')}, KV capacity {b.get('kv_capacity_tokens')} tokens"
        )
        g = b.get("cuda_graph") or {}
        if g:
            print(
                f"  cuda graphs: enabled={g.get('enabled')} sizes={len(g.get('batch_sizes') or [])} "
                f"capture {g.get('capture_seconds')} s, {(g.get('memory_bytes') or 0) / 2**30:.2f} GiB "
                f"(reserved {(g.get('reserved_bytes') or 0) / 2**30:.2f}), replays {g.get('replays')}"
                + (f", off: {g.get('reason')}" if g.get("reason") else "")
            )
        if "batch1" in b:
            x = b["batch1"]
            print(
                f"  batch 1: {x['decode_tok_s']} tok/s decode = {100 * x['fraction_of_ceiling']:.0f}% of the HBM "
                f"ceiling {x['hbm_ceiling_tok_s']} tok/s ({x['bytes_per_step_gb']} GB/step at 4.8 TB/s); "
                f"TTFT {x['ttft_s']} s"
            )
        for n in (64, 256):
            x = b.get(f"concurrency_{n}")
            if x:
                print(f"  {n} concurrent (256 in, 256 out): {x['output_tok_s']} output tok/s, {x['wall_s']} s")
    else:
        print("bench: no result")
    print("=" * 72)


if __name__ == "__main__":
    cmd, args = (sys.argv[1] if len(sys.argv) > 1 else ""), sys.argv[2:]
    if cmd == "prepare":
        prepare()
    elif cmd == "test-model":
        os.makedirs(WORK, exist_ok=True)
        test_model()
    elif cmd == "bench" and args:
        os.makedirs(WORK, exist_ok=True)
        bench(args[0])
    elif cmd == "summary" and args:
        summary(args[0])
    else:
        sys.exit(__doc__)

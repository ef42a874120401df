"""Capacity: does an 8B model, kept quantized, fit and run? A Llama-3-8B-shaped GGUF with random weights,
served by our engine (--quantization gguf) next to llama-bench on the same file.

    python benchmark/bench_capacity.py                        # write (temp dir), serve, llama-bench, delete
    python benchmark/bench_capacity.py --write-only /tmp/llama3-8b-random-q4_0.gguf
    python benchmark/bench_capacity.py --model-path /tmp/llama3-8b-random-q4_0.gguf   # an existing file
    python benchmark/bench_capacity.py --keep --json capacity.json
    python benchmark/bench_capacity.py --shape qwen3-30b-a3b --layers 8 --write-only /tmp/qwen3-moe-8l.gguf

The file: hidden 4096, 32 layers, 32 query / 8 KV heads (head dim 128), FFN 14336, vocab 128256, context
8192, rope theta 500000, RMS eps 1e-5, like Meta-Llama-3-8B. Linear weights are Q4_0, token_embd and
output Q8_0, norms F32 ones: about 4.9 GB (4.3 GB with --vocab 49152). No fp32 array is ever quantized:
each tensor's blocks are random bytes (uniform nibbles / int8) with fp16 scales of random sign chosen so
the weights have std 0.02, so activations stay finite; tensors are generated and written one at a time,
so memory stays at one tensor (~60 MB).

`--shape qwen3-30b-a3b` writes a Qwen3-30B-A3B-shaped mixture of experts instead (architecture qwen3moe:
hidden 2048, 48 layers, 32 query / 4 KV heads of 128 with per-head Q / K norms, 128 experts of width
768 and 8 used a token, each projection's experts one 3-D Q4_0 tensor, a random F32 router so tokens
spread over the experts, vocab 151936); `--layers N` keeps the first N layers (the full 48 are ~17 GB).
It is what `bench_roofline.py --model-path` takes for the MoE roofline.

The tokenizer is the default model's (SmolLM2, byte-level BPE, 49152 tokens) copied from its GGUF,
padded to the real vocabulary with unreachable `<|reserved_N|>` tokens of type UNUSED, so the embedding
and output tensors have Llama 3's 128256 rows and both llama.cpp and our loader accept the file (neither
takes a tokenizer smaller than the embedding). --vocab 49152 writes the unpadded tokenizer instead.

Reported: load time (server process start to /health 200), the server's memory once ready and while
decoding: RSS summed over its processes (a page the server and its forked workers share counts once per
process) and PSS summed (each shared page split between its sharers: the memory the server really holds;
goal: < 6.5 GB), batch-1 decode tok/s of our /generate (max_new_tokens 32, EOS ignored, timed; prefill
excluded by subtracting a 1-token request; the median of --decode-reps runs, as llama-bench averages its
-r repetitions), and llama-bench tg32 on the same file with
the same threads. The server part needs ServerArgs' `quantization` field (without it the GGUF would
be dequantized into a ~32 GB fp32 folder first, which this machine class cannot hold); it is skipped
with a note when the field is missing. --rss-limit-gb (default 16) kills our server if it grows past it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from bench_quant import (  # noqa: E402
    RssSampler,
    cpu_busy,
    cpu_line,
    cpu_summary,
    err,
    gguf_tensor_bytes,
    our_server,
    server_supports_quantization,
    tree_pss,
    tree_rss,
    weight_bytes_of,
)
from tqdm import tqdm  # noqa: E402

WEIGHT_STD = 0.02
RSS_GOAL_BYTES = int(6.5 * 10**9)


@dataclass(frozen=True)
class Shape:
    """A model's shape as a GGUF file states it (llama.cpp's architecture name and sizes)."""

    arch: str  # GGUF general.architecture
    title: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense FFN width (MoE files state it too; their layers use expert_ffn)
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float
    experts: int = 0  # > 0: every layer's FFN is a mixture of this many experts
    experts_used: int = 0
    expert_ffn: int = 0
    qk_norm: bool = False  # per-head RMS norms of Q and K (Qwen3)


SHAPES = {
    "llama3-8b": Shape("llama", "Llama-3-8B", 4096, 32, 32, 8, 128, 14336, 128256, 8192, 500000.0, 1e-5),
    # Qwen3-30B-A3B: 128 experts of width 768, 8 routed a token; fewer layers with --layers
    "qwen3-30b-a3b": Shape(
        "qwen3moe",
        "Qwen3-30B-A3B",
        2048,
        48,
        32,
        4,
        128,
        6144,
        151936,
        32768,
        1000000.0,
        1e-6,
        experts=128,
        experts_used=8,
        expert_ffn=768,
        qk_norm=True,
    ),  # fmt: skip
}
LLAMA3_8B = SHAPES["llama3-8b"]
VOCAB = LLAMA3_8B.vocab


# -- writing the file ------------------------------------------------------------------------------


def tensor_plan(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, shape as rows x cols (numpy order; ne0 = cols; experts outermost), kind) of every
    tensor, in file order. Kinds: Q4_0 / Q8_0 blocks, F32 ones (norms), F32R random (the MoE router)."""
    h, kv, q = shape.hidden, shape.kv_heads * shape.head_dim, shape.heads * shape.head_dim
    plan: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab, h), "Q8_0")]
    for i in range(shape.layers):
        b = f"blk.{i}"
        plan += [
            (f"{b}.attn_norm.weight", (h,), "F32"),
            (f"{b}.attn_q.weight", (q, h), "Q4_0"),
            (f"{b}.attn_k.weight", (kv, h), "Q4_0"),
            (f"{b}.attn_v.weight", (kv, h), "Q4_0"),
            (f"{b}.attn_output.weight", (h, q), "Q4_0"),
        ]
        if shape.qk_norm:
            plan += [(f"{b}.attn_q_norm.weight", (shape.head_dim,), "F32"),
                     (f"{b}.attn_k_norm.weight", (shape.head_dim,), "F32")]  # fmt: skip
        plan.append((f"{b}.ffn_norm.weight", (h,), "F32"))
        if shape.experts:
            e, f = shape.experts, shape.expert_ffn
            plan += [
                (f"{b}.ffn_gate_inp.weight", (e, h), "F32R"),
                (f"{b}.ffn_gate_exps.weight", (e, f, h), "Q4_0"),
                (f"{b}.ffn_up_exps.weight", (e, f, h), "Q4_0"),
                (f"{b}.ffn_down_exps.weight", (e, h, f), "Q4_0"),
            ]
        else:
            plan += [
                (f"{b}.ffn_gate.weight", (shape.ffn, h), "Q4_0"),
                (f"{b}.ffn_up.weight", (shape.ffn, h), "Q4_0"),
                (f"{b}.ffn_down.weight", (h, shape.ffn), "Q4_0"),
            ]
    plan += [("output_norm.weight", (h,), "F32"), ("output.weight", (vocab, h), "Q8_0")]
    return plan


def _byte_shape(shape: tuple[int, ...], kind: str) -> tuple[int, ...]:
    if kind.startswith("F32"):
        return shape
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    assert shape[-1] % block == 0
    return (*shape[:-1], shape[-1] // block * size)


def _nbytes(shape: tuple[int, ...], kind: str) -> int:
    return int(np.prod(_byte_shape(shape, kind))) * (4 if kind.startswith("F32") else 1)


def random_blocks(shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF bytes of a Q4_0 / Q8_0 tensor with random values of std WEIGHT_STD (ones for F32 norms;
    F32R, a router: normal with std 1 / sqrt(cols), so its logits over a unit-RMS input have std ~1 and
    tokens spread over the experts)."""
    if kind == "F32":
        return np.ones(shape, dtype=np.float32)
    if kind == "F32R":
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    byte_shape = _byte_shape(shape, kind)
    size = 18 if kind == "Q4_0" else 34
    n_blocks = int(np.prod(byte_shape)) // size
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    # Q4_0: w = d * (q - 8), q a uniform nibble: std |d| * sqrt((16^2 - 1) / 12). Q8_0: w = d * int8, uniform
    # over [-128, 127]: std |d| * sqrt((256^2 - 1) / 12). A random sign per block keeps the mean at zero.
    spread = np.sqrt((16**2 - 1) / 12) if kind == "Q4_0" else np.sqrt((256**2 - 1) / 12)
    d = np.float16(WEIGHT_STD / spread)
    scales = np.where(rng.random(n_blocks) < 0.5, -d, d).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(byte_shape)


def _tokenizer_fields(vocab: int) -> list[tuple[str, object, object, object]]:
    """(key, value, GGUFValueType, sub type) of the default model's tokenizer.* fields, tokens padded to vocab."""
    from gguf import GGUFReader, GGUFValueType, TokenType

    from srt.model_loader.default_model import default_gguf_path

    reader = GGUFReader(default_gguf_path(), "r")
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        value = field.contents()
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        if key == "tokenizer.ggml.tokens":
            if len(value) > vocab:
                raise ValueError(f"--vocab {vocab} is smaller than the tokenizer's {len(value)} tokens")
            value = list(value) + [f"<|reserved_{i}|>" for i in range(vocab - len(value))]
        elif key == "tokenizer.ggml.token_type":
            value = list(value) + [int(TokenType.UNUSED)] * (vocab - len(value))
        out.append((key, value, vtype, sub))
    return out


def write_shaped_gguf(
    path: str, shape: Shape = LLAMA3_8B, vocab: int | None = None, seed: int = 0, progress: bool = True
) -> dict:
    """Write a random GGUF of `shape` to path, streaming tensor by tensor; returns what was written."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

    vocab = vocab or shape.vocab
    plan = tensor_plan(shape, vocab)
    total = sum(_nbytes(dims, kind) for _, dims, kind in plan)
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    if free < total + 2**30:
        raise OSError(f"{path}: {free / 1e9:.1f} GB free, {total / 1e9:.1f} GB needed (+1 GB margin)")
    start = time.monotonic()
    w = GGUFWriter(path, shape.arch)
    w.add_name(f"{shape.title}-shaped random Q4_0, {shape.layers} layers (radixserve bench_capacity)")
    w.add_type("model")
    w.add_vocab_size(vocab)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    if shape.arch == "llama":
        w.add_rope_dimension_count(shape.head_dim)
    else:
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.expert_ffn)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_file_type(int(LlamaFileType.MOSTLY_Q4_0))
    w.add_quantization_version(2)
    for key, value, vtype, sub in _tokenizer_fields(vocab):
        w.add_key_value(key, value, vtype, sub_type=sub)  # type: ignore[arg-type]
    for name, dims, kind in plan:
        if kind.startswith("F32"):
            w.add_tensor_info(name, dims, np.dtype(np.float32), _nbytes(dims, kind))
        else:
            w.add_tensor_info(
                name, _byte_shape(dims, kind), np.dtype(np.uint8), _nbytes(dims, kind), GGMLQuantizationType[kind]
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    with tqdm(total=total, desc="writing GGUF", unit="B", unit_scale=True, disable=not progress) as bar:
        for _, dims, kind in plan:
            data = random_blocks(dims, kind, rng)
            w.write_tensor_data(data)
            bar.update(data.nbytes)
            del data
    w.close()
    return {
        "path": path,
        "file_bytes": os.path.getsize(path),
        "tensor_bytes": total,
        "tensors": len(plan),
        "vocab": vocab,
        "write_s": time.monotonic() - start,
    }


# -- serving it ------------------------------------------------------------------------------------


def _generate(url: str, n: int) -> tuple[float, int]:
    body = {
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
    }
    start = time.perf_counter()
    r = httpx.post(url + "/generate", json=body, timeout=3600)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    meta = r.json().get("meta_info", {})
    return elapsed, int(meta.get("completion_tokens") or n)


def bench_ours(path: str, threads: int, args) -> dict:
    flags = ["--quantization", "gguf", *args.server_args.split()]
    limit = int(args.rss_limit_gb * 2**30)
    with our_server(path, flags, threads, timeout=args.load_timeout, rss_limit=limit) as server:
        rss_ready, pss_ready = tree_rss(server.proc.pid), tree_pss(server.proc.pid)
        sampler = RssSampler(server.proc.pid)
        info = httpx.get(server.url + "/server_info", timeout=60).json()
        _generate(server.url, 2)  # warm-up
        runs = []  # (decode tok/s, e2e seconds, tokens) of each repeat; the median is reported
        for _ in range(args.decode_reps):
            t1, _ = _generate(server.url, 1)
            tn, n = _generate(server.url, args.decode_tokens)
            runs.append(((n - 1) / (tn - t1) if tn > t1 and n > 1 else None, tn, n))
        pss_decoding = tree_pss(server.proc.pid)
        peak = sampler.stop()
        rates = sorted(r for r, _, _ in runs if r is not None)
        _, tn, n = runs[len(runs) // 2]
        return {
            "flags": flags,
            "load_s": server.ready_s,
            "load_peak_rss_bytes": server.load_peak_rss,
            "rss_bytes": rss_ready,
            "rss_peak_bytes": max(peak, rss_ready),
            "pss_bytes": pss_ready,
            "pss_decoding_bytes": pss_decoding,
            "weight_bytes": weight_bytes_of(info),
            **{k: info[k] for k in ("quantization", "weight_formats", "kernel_isa", "dtype") if k in info},
            "decode_tokens": n,
            "e2e_s": tn,
            "e2e_tok_s": n / tn,
            "decode_tok_s": rates[len(rates) // 2] if rates else None,
            "decode_tok_s_runs": [r for r, _, _ in runs],
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write-only", metavar="PATH", default=None, help="write the GGUF to PATH and stop")
    p.add_argument("--model-path", default=None, help="use this existing GGUF instead of writing one")
    p.add_argument("--tmp-dir", default=None, help="where the temp folder goes (default: the system's)")
    p.add_argument("--keep", action="store_true", help="keep the written file (its path is printed)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b", help="the written file's shape")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (a smaller file)")
    p.add_argument("--vocab", type=int, default=None, help="rows of token_embd/output (default: the shape's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="default: all usable cores")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--decode-reps", type=int, default=3, help="timed decode runs of ours (the median is reported)")
    p.add_argument("--bench-reps", type=int, default=2, help="llama-bench -r")
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--server-args", default="", help="extra flags for our server")
    p.add_argument("--load-timeout", type=float, default=1800)
    p.add_argument("--rss-limit-gb", type=float, default=16.0, help="kill our server past this RSS (GiB)")
    p.add_argument("--json", default=None, help="write all figures here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args()

    shape = SHAPES[args.shape]
    if args.layers:
        shape = dataclasses.replace(shape, layers=args.layers)
    if args.write_only:
        info = write_shaped_gguf(os.path.abspath(args.write_only), shape, args.vocab, args.seed, not args.quiet)
        print(json.dumps(info, indent=2))
        return

    cpu = cpu_summary()
    threads = args.threads or cpu["cores"]
    print(cpu_line(cpu), flush=True)
    cpu["busy_percent_before"] = busy = cpu_busy()
    if busy > 10:
        print(f"warning: the CPUs were {busy:.0f}% busy before the run (other load): figures will be noisy", flush=True)
    res: dict = {"cpu": cpu, "threads": threads}
    tmp = None
    try:
        if args.model_path:
            path = os.path.abspath(args.model_path)
            res["file"] = {"path": path, "file_bytes": os.path.getsize(path), "tensor_bytes": gguf_tensor_bytes(path)}
        else:
            tmp = tempfile.mkdtemp(prefix="radixserve-capacity-", dir=args.tmp_dir)
            path = os.path.join(tmp, f"{args.shape}-shaped-random-q4_0.gguf")
            res["file"] = write_shaped_gguf(path, shape, args.vocab, args.seed, not args.quiet)
        print(f"file {path}: {res['file']['file_bytes'] / 1e9:.2f} GB", flush=True)

        if args.skip_serving:
            res["ours"] = "skipped (--skip-serving)"
        elif not server_supports_quantization():
            res["ours"] = "skipped: ServerArgs has no `quantization` field yet (needs --quantization gguf)"
        else:
            try:
                res["ours"] = bench_ours(path, threads, args)
            except Exception as e:  # one part failing must not stop the other
                traceback.print_exc()
                res["ours"] = err(e)

        if not args.skip_llama_cpp:
            import llama_cpp

            # as it runs by default, and with its weights on huge pages as ours are (llama_cpp.py)
            for key, huge in (("llama_cpp", False), ("llama_cpp_huge_pages", True)):
                try:
                    res[key] = llama_cpp.run_llama_bench(
                        path,
                        threads,
                        n_prompt=0,
                        n_gen=args.decode_tokens,
                        reps=args.bench_reps,
                        progress=not args.quiet,
                        huge_pages=huge,
                    )
                except Exception as e:
                    traceback.print_exc()
                    res[key] = err(e)
    finally:
        if tmp is not None:
            if args.keep:
                print(f"kept {tmp}", flush=True)
            else:
                shutil.rmtree(tmp, ignore_errors=True)

    print("\n" + report(res, args), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
        print(f"\nwrote {args.json}")


def _formats(ours: dict) -> str:
    formats = ours.get("weight_formats") or {}
    text = "/".join(dict.fromkeys(str(v) for k, v in formats.items() if k != "lm_head")) or "n/a"
    return text + (f", {ours['kernel_isa']}" if ours.get("kernel_isa") else "")


def report(res: dict, args) -> str:
    f = res["file"]
    ours, ll = res.get("ours"), res.get("llama_cpp")
    lines = [
        f"file: {f['file_bytes'] / 1e9:.2f} GB ({f['tensor_bytes'] / 1e9:.2f} GB tensors), {res['threads']} threads",
        "",
        "| figure | ours (--quantization gguf) | llama.cpp |",
        "|---|---:|---:|",
    ]
    tg = ll.get("tg_tok_s") if isinstance(ll, dict) else None
    ll_cell = ll if isinstance(ll, str) else "n/a" if ll is None else f"{tg:.2f} ± {ll.get('tg_stddev', 0):.2f}"
    if isinstance(ours, dict):
        pss = max(ours.get("pss_bytes") or 0, ours.get("pss_decoding_bytes") or 0)
        mem_ok = (pss or ours["rss_peak_bytes"]) < RSS_GOAL_BYTES
        ratio = f" ({ours['decode_tok_s'] / tg:.2f}x)" if tg and ours.get("decode_tok_s") else ""
        dec = ours.get("decode_tok_s")
        lines += [
            f"| weights (format, kernels) | {_formats(ours)} | "
            + (f"{ll.get('model_type')} |" if isinstance(ll, dict) else "- |"),
            f"| load time (start to /health), peak RSS while loading | {ours['load_s']:.1f} s, "
            f"{ours['load_peak_rss_bytes'] / 1e9:.2f} GB | - |",
            f"| RSS ready / peak (summed over the processes) | {ours['rss_bytes'] / 1e9:.2f} / "
            f"{ours['rss_peak_bytes'] / 1e9:.2f} GB | - |",
            "| PSS ready / decoding (the memory the processes hold) | "
            + (f"{ours['pss_bytes'] / 1e9:.2f} / {ours['pss_decoding_bytes'] / 1e9:.2f} GB" if pss else "n/a")
            + f" (goal < 6.5 GB: {'PASS' if mem_ok else 'FAIL'}) | - |",
            "| weight bytes (/server_info) | "
            + (f"{ours['weight_bytes'] / 1e9:.2f} GB" if isinstance(ours.get("weight_bytes"), int) else "n/a")
            + " | - |",
            f"| decode bs=1 tok/s ({args.decode_tokens} tokens, median of {len(ours.get('decode_tok_s_runs') or [])})"
            + " | "
            + (f"{dec:.2f}{ratio}" if dec else "n/a")
            + f" (e2e {ours['e2e_tok_s']:.2f}) | tg{args.decode_tokens} {ll_cell} |",
        ]
        hp = res.get("llama_cpp_huge_pages")
        if isinstance(hp, dict) and hp.get("tg_tok_s"):
            hp_tg = hp["tg_tok_s"]
            load = " ".join(hp.get("load_args") or [])
            lines.append(
                "| decode bs=1 against llama.cpp with its weights on huge pages "
                f"(`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, `{load}`) | "
                + (f"{dec / hp_tg:.2f}x" if dec else "n/a")
                + f" | tg{args.decode_tokens} {hp_tg:.2f} ± {hp.get('tg_stddev', 0):.2f} |"
            )
    else:
        lines += [
            f"| our server | {str(ours)[:100]} | - |",
            f"| decode bs=1 tok/s ({args.decode_tokens} tokens) | n/a | tg{args.decode_tokens} {ll_cell} |",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

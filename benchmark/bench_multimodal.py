"""Images served from the caches (issue 40): requests that share a few images vs requests with an image
each, on a SmolVLM-256M-shaped model with random weights, the image caches on and off.

    python benchmark/bench_multimodal.py                                  # 64 prompts, 8 shared images
    python benchmark/bench_multimodal.py --longest-edge 1024 --out mm.json --plot mm.png   # 2 x 2 tiles
    python benchmark/bench_multimodal.py --num-prompts 4 --num-shared-images 2 --max-tokens 2 --longest-edge 512

The model folder is built locally once (under $RADIXSERVE_CACHE_DIR or ~/.cache/radixserve/bench): an
`Idefics3Config` at SmolVLM-256M-Instruct's sizes (SigLIP: hidden 768, 12 layers, 512 px tiles of
16 px patches; pixel shuffle 4, so 64 tokens a tile; text: SmolLM2-135M), the default model's tokenizer
with SmolVLM's image tokens and a chat template that renders image parts as `<image>`, and SmolVLM's
image processor config (images resized to `--longest-edge`, 2048 as SmolVLM ships, and split into
512 px tiles plus the whole image as one more: 4 x 4 + 1 = 17 tiles, 1088 tokens; 1024: 5 tiles; 512:
the global tile alone). No weights: the servers run `--load-format dummy`.

Workloads, `--num-prompts` chat requests each (an image then a question, OpenAI chat API, streamed,
`--max-tokens` tokens, greedy, ignore_eos, `--concurrency` in flight, in order):
- shared: `--num-shared-images` photo-like images (JPEG data URLs), prompt i shows image i % N with the
  same question (a repeat is then the same prompt: the radix cache holds all but its last token), or
  with `--distinct-questions` a question of its own (only the text up to the image's end is shared);
- distinct: an image of its own per prompt.
Configurations, one server each (started, warmed up with another image, stopped in turn):
- cache on: the default flags (radix cache; encoder-output and preprocessed-pixel caches of 512 MiB);
- cache off: `--mm-cache-size-mb 0 --disable-radix-cache`.
The radix cache is flushed before each workload. Reported: requests/s, output and input tok/s, TTFT
mean / median (first streamed chunk), the share of prompt tokens served from the cache, the ratio
shared / distinct in requests/s, and the tokens the servers really took and gave (their usage).
Goal (issue 40): shared >= 3x the throughput of distinct with the cache on.

The encoder's share of a prefill is measured in process (the runtime's model runner, no server): one
image prompt's prefill with the encoder output not cached, the encoder alone on the same image, and
the prefill with the encoder output cached (the text model's part), medians of `--repeats`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import io
import json
import os
import shlex
import shutil
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from bench_quant import cpu_busy, cpu_line, cpu_summary, our_server  # noqa: E402
from PIL import Image  # noqa: E402
from tqdm import tqdm  # noqa: E402

GOAL = 3.0  # shared / distinct requests/s with the cache on
MODEL_VERSION = 1  # part of the cached folder's name: bump when the folder's contents change
QUESTION = "Describe this picture in one sentence."
CONFIGS = {"cache on": [], "cache off": ["--mm-cache-size-mb", "0", "--disable-radix-cache"]}

# SmolVLM-256M-Instruct: a SigLIP base (patch 16, 512 px) over SmolLM2-135M, pixel shuffle 4
VISION = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=512, patch_size=16
)
TEXT = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
SCALE_FACTOR = 4
TILE_EDGE = 512
# SmolVLM's chat template, in short: a user turn's parts in order, an image part as <image>
TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]


# -- the model folder and the images -------------------------------------------------------------


def build_model(longest_edge: int, root: str | None = None) -> str:
    """The SmolVLM-shaped folder for this resize edge (config, tokenizer, image processor config; no
    weights), built once under `root` (default: the cache dir's bench/); written to a temporary folder,
    then renamed into place."""
    import transformers

    from srt.configs.runtime_choices import cache_root
    from srt.model_loader.default_model import resolve_default_model

    path = os.path.join(
        root or os.path.join(cache_root(), "bench"), f"smolvlm-256m-random-v{MODEL_VERSION}-edge{longest_edge}"
    )
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    # the folder's own tokenizer class, named directly: AutoTokenizer takes seconds longer to the same tokenizer
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(resolve_default_model(progress=False, weights=False))
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tok.chat_template = TEMPLATE
    end = tok.convert_tokens_to_ids("<end_of_utterance>")
    cfg = transformers.Idefics3Config(
        vision_config=VISION,
        text_config=dict(TEXT, vocab_size=len(tok), eos_token_id=end),
        scale_factor=SCALE_FACTOR,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
    )
    cfg.architectures = ["Idefics3ForConditionalGeneration"]
    tmp = f"{path}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    cfg.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    pixels = transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": longest_edge}, max_image_size={"longest_edge": TILE_EDGE}
    )
    pixels.save_pretrained(tmp)
    try:
        os.replace(tmp, path)
    except OSError:  # another run built it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def photo(size: int, seed: int) -> Image.Image:
    """A photo-like random picture: smooth colour fields (a coarse random grid, upscaled) plus grain."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
    smooth = np.asarray(coarse.resize((size, size), Image.Resampling.BICUBIC), dtype=np.float32)
    grain = rng.normal(0.0, 10.0, smooth.shape)
    return Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8))


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


@dataclasses.dataclass
class Workload:
    name: str
    images: list[str]  # data URLs
    prompts: list[tuple[int, str]]  # (image index, question) per request, in sending order


def workloads(args) -> list[Workload]:
    n = args.num_prompts

    def question(i: int) -> str:
        return f"Question {i}: {QUESTION}" if args.distinct_questions else QUESTION

    shared = [data_url(photo(args.image_size, args.seed * 10_000 + k)) for k in range(args.num_shared_images)]
    distinct = [data_url(photo(args.image_size, args.seed * 10_000 + 5_000 + k)) for k in range(n)]
    return [
        Workload("shared", shared, [(i % len(shared), question(i)) for i in range(n)]),
        Workload("distinct", distinct, [(i, question(i)) for i in range(n)]),
    ]


# -- requests ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Reply:
    ttft: float  # seconds from sending to the first streamed chunk
    latency: float
    prompt_tokens: int
    image_tokens: int
    cached_tokens: int
    completion_tokens: int


async def chat(client: httpx.AsyncClient, image: str, question: str, max_tokens: int) -> Reply:
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": question}]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, usage = None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/v1/chat/completions answered {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    if ttft is None or usage is None:
        raise RuntimeError(f"a stream without {'a choice' if ttft is None else 'usage'}")
    details = usage.get("prompt_tokens_details") or {}
    return Reply(
        ttft=ttft,
        latency=time.perf_counter() - start,
        prompt_tokens=usage["prompt_tokens"],
        image_tokens=details.get("image_tokens", 0),
        cached_tokens=details.get("cached_tokens") or 0,
        completion_tokens=usage["completion_tokens"],
    )


async def run_workload(url: str, work: Workload, args, bar) -> dict:
    limit = asyncio.Semaphore(args.concurrency)  # FIFO: the requests start in order
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=1000)) as client:

        async def one(image: int, question: str) -> Reply:
            async with limit:
                reply = await chat(client, work.images[image], question, args.max_tokens)
            bar.update()
            return reply

        start = time.perf_counter()
        replies = await asyncio.gather(*(one(i, q) for i, q in work.prompts))
        wall = time.perf_counter() - start
    counts = ("prompt_tokens", "image_tokens", "cached_tokens", "completion_tokens")
    total = {k: sum(getattr(r, k) for r in replies) for k in counts}
    ttfts = [r.ttft for r in replies]
    return {
        "requests": len(replies),
        "wall_s": wall,
        "req_s": len(replies) / wall,
        "output_tok_s": total["completion_tokens"] / wall,
        "input_tok_s": total["prompt_tokens"] / wall,
        "ttft_mean_s": statistics.mean(ttfts),
        "ttft_median_s": statistics.median(ttfts),
        "latency_median_s": statistics.median(r.latency for r in replies),
        "cached_share": total["cached_tokens"] / total["prompt_tokens"],
        **total,
        "distinct_images": len({i for i, _ in work.prompts}),
        "image_bytes_sent": sum(len(work.images[i]) for i, _ in work.prompts),
    }


def serve(name: str, model: str, args, works: list[Workload], results: dict) -> None:
    flags = ["--load-format", "dummy", "--dtype", args.dtype, *CONFIGS[name], *shlex.split(args.server_args)]
    with our_server(model, flags, args.threads) as server:
        info = httpx.get(server.url + "/server_info", timeout=60).json()
        warm = data_url(photo(args.image_size, 10**6))  # an image no workload shows
        asyncio.run(
            run_workload(server.url, Workload("warm-up", [warm], [(0, QUESTION)] * 2), args, tqdm(disable=True))
        )
        rows = {}
        for work in works:
            httpx.post(server.url + "/flush_cache", timeout=60).raise_for_status()
            bar = tqdm(total=len(work.prompts), desc=f"{name}, {work.name}", disable=args.quiet)
            rows[work.name] = asyncio.run(run_workload(server.url, work, args, bar))
            bar.close()
    results["configs"][name] = {
        "flags": flags,
        "ready_s": server.ready_s,
        "server": {k: info.get(k) for k in ("dtype", "device", "kernel_isa", "chunked_prefill_size")},
        "workloads": rows,
        "shared_over_distinct": rows["shared"]["req_s"] / rows["distinct"]["req_s"],
    }


# -- the encoder's share of a prefill, in process ------------------------------------------------


def encoder_share(model: str, args) -> dict:
    """Median seconds of: one image prompt's prefill (encoder output not cached), the encoder alone on
    its image, and the prefill again with the encoder output cached; the image's preprocessing."""
    import torch
    import transformers

    from srt.configs.model_config import ModelConfig
    from srt.lora.manager import build_lora_manager
    from srt.model_executor.model_runner import ModelRunner
    from srt.model_executor.static_batch import StaticBatchGenerator
    from srt.models.idefics3 import Idefics3ForConditionalGeneration
    from srt.models.multimodal import EncoderCache
    from srt.multimodal.processors import image_prompts_for
    from srt.server_args import ServerArgs

    torch.set_num_threads(args.threads)
    server_args = ServerArgs(
        model_path=model, load_format="dummy", dtype=args.dtype, max_total_tokens=8192, max_running_requests=4
    )
    runner = ModelRunner(
        ModelConfig.from_path(model, server_args.context_length), server_args, build_lora=build_lora_manager
    )
    gen, vlm = StaticBatchGenerator(runner), runner.model
    assert isinstance(vlm, Idefics3ForConditionalGeneration), type(vlm)
    tok = transformers.AutoTokenizer.from_pretrained(model)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    prompts = image_prompts_for(server_args, tok)
    prompts.cache.capacity = 0  # time the resize and normalization on every repeat
    image = data_url(photo(args.image_size, 2 * 10**6))

    def timed(fn) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            fn()
        return time.perf_counter() - start

    def cold_prefill() -> None:
        vlm.encoder_cache = EncoderCache(vlm.encoder_cache.capacity)
        gen.prefill_logits([full], [items])

    full, items = prompts.expand(ids, [image], ["image"])
    times: dict[str, list[float]] = {"preprocess": [], "prefill": [], "encoder": [], "prefill_encoder_cached": []}
    for k in tqdm(range(args.repeats + 1), desc="encoder share", disable=args.quiet):  # the first is a warm-up
        sample = {
            "preprocess": timed(lambda: prompts.expand(ids, [image], ["image"])),
            "prefill": timed(cold_prefill),
            "encoder": timed(lambda: vlm.encode_images(items)),
            "prefill_encoder_cached": timed(lambda: gen.prefill_logits([full], [items])),  # cached by cold_prefill
        }
        for key, t in sample.items():
            if k:
                times[key].append(t)
    med = {f"{key}_s": statistics.median(ts) for key, ts in times.items()}
    return {
        **med,
        "encoder_share": med["encoder_s"] / med["prefill_s"],
        "prompt_tokens": len(full),
        "image_tokens": sum(it.num_rows for it in items),
        "tiles": int(items[0].data["pixel_values"].shape[0]),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "samples": times,
    }


# -- report --------------------------------------------------------------------------------------


def report(results: dict) -> None:
    a = results["args"]
    print(f"\n{a['num_prompts']} prompts a workload, {a['concurrency']} in flight, {a['max_tokens']} tokens out each;")
    print(
        f"shared: {a['num_shared_images']} images, {'a question each' if a['distinct_questions'] else 'one question'}"
        f"; distinct: an image a prompt; {a['image_size']} px images resized to {a['longest_edge']} px\n"
    )
    for name, c in results["configs"].items():
        s = c["server"]
        print(f"{name}: {shlex.join(c['flags'])} (ready in {c['ready_s']:.0f} s; {s['dtype']} on {s['device']})")
    print()
    print("| config | workload | req/s | output tok/s | input tok/s | TTFT mean / median (ms) | cached share |")
    print("|---|---|---|---|---|---|---|")
    for name, c in results["configs"].items():
        for work, r in c["workloads"].items():
            print(
                f"| {name} | {work} | {r['req_s']:.2f} | {r['output_tok_s']:.1f} | {r['input_tok_s']:.0f} | "
                f"{1000 * r['ttft_mean_s']:.0f} / {1000 * r['ttft_median_s']:.0f} | {100 * r['cached_share']:.1f}% |"
            )
    print()
    for name, c in results["configs"].items():
        print(f"shared / distinct (req/s), {name}: {c['shared_over_distinct']:.2f}x")
    print("\ntokens really sent and received (the servers' usage):")
    for name, c in results["configs"].items():
        for work, r in c["workloads"].items():
            print(
                f"  {name}, {work}: {r['requests']} requests ({_size(r['image_bytes_sent'])} of data URLs, "
                f"{r['distinct_images']} distinct images); prompt {r['prompt_tokens']:,} tokens "
                f"(image {r['image_tokens']:,}, cached {r['cached_tokens']:,}); completion {r['completion_tokens']:,} "
                f"({r['requests']} x {a['max_tokens']} asked)"
            )
    if "cache on" in results["configs"]:
        ratio = results["configs"]["cache on"]["shared_over_distinct"]
        results["goal"] = {
            "target": f"shared >= {GOAL}x distinct req/s, cache on",
            "ratio": ratio,
            "met": ratio >= GOAL,
        }
        print(
            f"\ngoal (issue 40): shared >= {GOAL:.0f}x distinct with the cache on: "
            f"{'met' if ratio >= GOAL else 'NOT met'} ({ratio:.2f}x)"
        )
    e = results.get("encoder")
    if e:
        tiles = f"{e['tiles']} tile{'s' * (e['tiles'] > 1)}"
        print(
            f"\nencoder share of a prefill (in process, {e['dtype']}; one image prompt: {tiles}, "
            f"{e['image_tokens']} image tokens of {e['prompt_tokens']}):\n"
            f"  prefill {1000 * e['prefill_s']:.0f} ms, of which the encoder {1000 * e['encoder_s']:.0f} ms: "
            f"{100 * e['encoder_share']:.0f}%\n"
            f"  prefill with the encoder output cached {1000 * e['prefill_encoder_cached_s']:.0f} ms; "
            f"preprocessing (tokenizer side, before the prefill) {1000 * e['preprocess_s']:.0f} ms"
        )


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(results["configs"])
    works = ["shared", "distinct"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label, scale in (
        (axes[0], "req_s", "requests/s", 1),
        (axes[1], "ttft_median_s", "median TTFT (ms)", 1000),
    ):
        for j, work in enumerate(works):
            values = [scale * results["configs"][c]["workloads"][work][key] for c in configs]
            xs = [i + (j - 0.5) * 0.38 for i in range(len(configs))]
            bars = ax.bar(xs, values, width=0.38, label=work)
            ax.bar_label(bars, fmt="%.2f" if scale == 1 else "%.0f", fontsize=8)
        ax.set_xticks(range(len(configs)), configs)
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(True, axis="y", alpha=0.3)
    a = results["args"]
    fig.suptitle(
        f"SmolVLM-256M shape, random weights: {a['num_prompts']} prompts, {a['num_shared_images']} shared images "
        f"vs distinct, edge {a['longest_edge']} px"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64, help="requests per workload")
    p.add_argument("--num-shared-images", type=int, default=8, help="the shared workload's images")
    p.add_argument("--distinct-questions", action="store_true", help="a question of its own per prompt")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens out per request (ignore_eos)")
    p.add_argument("--image-size", type=int, default=512, help="the images' width and height in pixels")
    p.add_argument(
        "--longest-edge",
        type=int,
        default=2048,
        help="the image processor's resize edge: 2048 (SmolVLM's) 17 tiles, 1024 5, 512 one (multiples of 512)",
    )
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU multiplies it fast, else float32")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="OMP threads (servers, encoder)")
    p.add_argument("--repeats", type=int, default=3, help="timed prefills for the encoder share (median)")
    p.add_argument("--skip-encoder-share", action="store_true")
    p.add_argument("--configs", default="on,off", help="the image caches: on, off or both (comma-separated)")
    p.add_argument("--server-args", default="", help="more flags for every server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write every figure here (JSON)")
    p.add_argument("--plot", help="a bar chart of requests/s and TTFT (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args()
    configs = [f"cache {c.strip()}" for c in args.configs.split(",") if c.strip()]
    if not configs or any(c not in CONFIGS for c in configs):
        p.error(f"--configs {args.configs!r}: on, off or on,off")
    if args.longest_edge % TILE_EDGE:
        p.error(f"--longest-edge {args.longest_edge}: a multiple of the {TILE_EDGE} px tile")
    if args.num_prompts < 1 or args.num_shared_images < 1 or args.concurrency < 1:
        p.error("--num-prompts, --num-shared-images and --concurrency must be >= 1")
    # SIGTERM as Ctrl-C: the finally blocks stop the server (its own process group)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    cpu = cpu_summary()
    print(cpu_line(cpu), flush=True)
    cpu["busy_percent_before"] = busy = cpu_busy()
    if busy > 10:
        print(f"warning: the CPUs were {busy:.0f}% busy before the run (other load): figures will be noisy", flush=True)
    model = build_model(args.longest_edge)
    print(f"model folder (SmolVLM-256M shape, random weights): {model}", flush=True)
    results: dict = {
        "command": shlex.join([os.path.basename(sys.executable), *sys.argv]),
        "cpu": cpu,
        "model": model,
        "args": vars(args),
        "configs": {},
    }
    works = workloads(args)
    for name in configs:
        serve(name, model, args, works, results)
    if not args.skip_encoder_share:
        results["encoder"] = encoder_share(model, args)
    report(results)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.out}")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()

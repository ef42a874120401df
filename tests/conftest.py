"""Shared fixtures: tiny random HF models per architecture, and a model runner over them."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under its interpreter on CPU tensors. Set before anything imports triton:
    # triton.language decorates its own helpers (tl.sum, tl.sigmoid, ...) at import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_CONFIGS = {
    "LlamaForCausalLM": dict(model_type="llama", tie_word_embeddings=False),
    "MistralForCausalLM": dict(model_type="mistral", sliding_window=None),
    "Qwen2ForCausalLM": dict(model_type="qwen2", tie_word_embeddings=True),
    "Qwen3ForCausalLM": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=True),
    # mixture of experts: 4-8 experts of intermediate 32-64, top-2
    "MixtralForCausalLM": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "Qwen2MoeForCausalLM": dict(
        model_type="qwen2_moe",
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        tie_word_embeddings=True,
    ),
    "Qwen3MoeForCausalLM": dict(
        model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32
    ),
    # MLA + MoE: a dense first layer, 8 routed experts in 4 groups, one shared expert
    "DeepseekV2ForCausalLM": dict(
        model_type="deepseek_v2",
        num_hidden_layers=3,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=24,
        head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.0,
    ),
    "DeepseekV3ForCausalLM": dict(
        model_type="deepseek_v3",
        num_hidden_layers=3,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=24,
        head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
}


def build_tiny_model(
    path: str, architecture: str = "LlamaForCausalLM", vocab_size: int = 512, seed: int = 0, **overrides
) -> str:
    """A 2-layer model with random weights, saved as an HF folder (config.json + safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        architectures=[architecture],
    )
    kwargs = {**base, **TINY_CONFIGS[architecture], **overrides}
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; scale up so logits are not all near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
        for name, b in model.named_buffers():  # DeepSeek-V3's routing bias: zeros would test nothing
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


def hf_greedy(path: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF transformers' greedy continuations (float32, no EOS) of each prompt: the oracle."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(
                torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            out.append(ids[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    made: dict[tuple, str] = {}

    def make(architecture: str = "LlamaForCausalLM", **overrides) -> str:
        key = (architecture, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            made[key] = build_tiny_model(str(tmp_path_factory.mktemp(architecture)), architecture, **overrides)
        return made[key]

    return make


def make_runner(model_path: str, **args):
    from srt.configs.model_config import ModelConfig
    from srt.lora.manager import build_lora_manager
    from srt.model_executor.model_runner import ModelRunner
    from srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path=model_path, **{"dtype": "float32", "max_total_tokens": 8192, "max_running_requests": 32, **args}
    )
    return ModelRunner(
        ModelConfig.from_path(model_path, server_args.context_length), server_args, build_lora=build_lora_manager
    )


@pytest.fixture(scope="session")
def runner_factory():
    return make_runner


@pytest.fixture(scope="module")
def ops():
    """The compiled C++ CPU kernels, built (or loaded from the on-disk cache) on first use, not at
    collection; skipped without a compiler (the runtime then falls back to torch_native attention
    and dequantized weights)."""
    from kernels import cpu as cpu_kernels
    from srt.configs.runtime_choices import cache_root

    loaded = cpu_kernels.load(cache_root())
    if loaded is None:
        pytest.skip("no C++ compiler: the runtime falls back to torch_native and dequantized weights")
    return loaded


KERNEL_ISAS = ["scalar", "avx2", "avx512", "avx512_bf16"]


def random_tree_mask(n: int, rng) -> torch.Tensor:
    """The ancestor mask ([n, n] bool) of a random draft tree of n nodes (BFS order: each node's parent
    comes before it), for the tree-verify attention tests."""
    from srt.speculative.draft_tree import DraftTree

    tree = DraftTree()
    for i in range(1, n):
        tree.add(rng.randrange(i), 0)
    return torch.tensor(tree.ancestors_mask(), dtype=torch.bool)


@contextlib.contextmanager
def isa_variants(ops, highest: str = "avx512_bf16"):
    """Iterate over the C++ kernel ISAs this CPU can run, up to `highest` (each set while its turn
    lasts); the best one is restored on exit, whatever the test did."""
    best = ops.quant_isa("")
    top = min(KERNEL_ISAS.index(best), KERNEL_ISAS.index(highest))

    def each():
        for isa in KERNEL_ISAS[: top + 1]:
            ops.quant_isa(isa)
            yield isa

    try:
        yield each()
    finally:
        ops.quant_isa(best)


@pytest.fixture(scope="session")
def idefics3_path(tmp_path_factory) -> str:
    """A tiny random SmolVLM-shaped (Idefics3) model with its tokenizer and image processor."""
    from multimodal.vlm_models import build_idefics3

    return build_idefics3(str(tmp_path_factory.mktemp("idefics3")))


@pytest.fixture(scope="session")
def llava_path(tmp_path_factory) -> str:
    """A tiny random LLaVA-1.5-shaped model with its tokenizer and image processor."""
    from multimodal.vlm_models import build_llava

    return build_llava(str(tmp_path_factory.mktemp("llava")))


@pytest.fixture(scope="session")
def qwen2_vl_path(tmp_path_factory) -> str:
    """A tiny random Qwen2-VL-shaped model (M-RoPE) with its tokenizer and image processor."""
    from multimodal.vlm_models import build_qwen2_vl

    return build_qwen2_vl(str(tmp_path_factory.mktemp("qwen2_vl")))


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The embedded SmolLM2-135M-Instruct, converted once into the user's cache."""
    from srt.model_loader.default_model import resolve_default_model

    return resolve_default_model(progress=False, weights=True)


# -- teacher forcing: one server's top-1 next token against another's on the same token sequence --

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is.",
    "List three uses of a paperclip.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a short motivational quote.",
    "What is 17 times 3?",
]


def chat_prompt_ids(model_path: str, texts: list[str] = CHAT_PROMPTS) -> list[list[int]]:
    """Each text as one user turn through the model's chat template, with the generation prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for t in texts
    ]


def forcing_body(ids: list[int], start: int) -> dict:
    """A /generate body scoring every token of `ids` from position `start` (top-1 alternative and
    the token's own logprob) without generating."""
    return dict(
        input_ids=ids,
        sampling_params={"temperature": 0, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=1,
    )


def top1_agreement(ours: dict, ref: dict) -> tuple[int, int, list[float]]:
    """(positions whose top-1 tokens agree, positions compared, |delta logprob| of the forced token
    at each) between two forcing_body answers' meta_info."""
    agree = total = 0
    deltas: list[float] = []
    for mine, theirs, mine_lp, ref_lp in zip(
        ours["input_top_logprobs"], ref["input_top_logprobs"], ours["input_token_logprobs"], ref["input_token_logprobs"]
    ):
        if theirs is None or theirs[0] is None:  # a sequence's first token has no prediction
            continue
        total += 1
        agree += mine[0][1] == theirs[0][1]
        deltas.append(abs(mine_lp[0] - ref_lp[0]))
    return agree, total, deltas


def write_eagle_head(
    path: str,
    target: str,
    kind: str,
    seed: int = 0,
    copy_layer: bool = False,
    hot_tokens: list[int] | None = None,
    **config_overrides,
) -> str:
    """An EAGLE ("eagle") or EAGLE-3 ("eagle3") head for the model at `target`, saved in SGLang's
    checkpoint layout: random, or (`copy_layer`, EAGLE) the target's layer 0 behind an `fc` that
    passes the token's embedding through (for a target whose attention adds nothing, see
    `build_bigram_model`, such a head predicts exactly what the target does). An EAGLE-3 head's
    vocabulary is `hot_tokens` (default: every third of the first 192 ids)."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.08

    config = {**cfg, "num_hidden_layers": 1, "tie_word_embeddings": False}
    qkv_in = h if kind == "eagle" else 2 * h
    prefix = "layers.0" if kind == "eagle" else "midlayer"
    tensors = {
        f"{prefix}.self_attn.q_proj.weight": rnd(heads * d, qkv_in),
        f"{prefix}.self_attn.k_proj.weight": rnd(kv_heads * d, qkv_in),
        f"{prefix}.self_attn.v_proj.weight": rnd(kv_heads * d, qkv_in),
        f"{prefix}.self_attn.o_proj.weight": rnd(h, heads * d),
        f"{prefix}.mlp.gate_proj.weight": rnd(inter, h),
        f"{prefix}.mlp.up_proj.weight": rnd(inter, h),
        f"{prefix}.mlp.down_proj.weight": rnd(h, inter),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(h),
        "embed_tokens.weight": rnd(cfg["vocab_size"], h),  # ignored: the target's is used
    }
    if kind == "eagle":
        config["architectures"] = ["LlamaForCausalLM"]  # as SafeAILab's checkpoints say
        tensors |= {"fc.weight": rnd(h, 2 * h), "fc.bias": rnd(h)}
        if copy_layer:
            weights = load_file(os.path.join(target, "model.safetensors"))
            for name in list(tensors):
                if name.startswith("layers.0."):
                    tensors[name] = weights["model." + name]
            tensors["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
            tensors["fc.bias"] = torch.zeros(h)
    else:
        hot = torch.tensor(hot_tokens if hot_tokens is not None else [3 * i for i in range(64)])
        config |= {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": len(hot)}
        tensors |= {
            "fc.weight": rnd(h, 3 * h),
            f"{prefix}.input_layernorm.weight": torch.ones(h),
            f"{prefix}.hidden_norm.weight": torch.ones(h),
            "norm.weight": torch.ones(h),
            "lm_head.weight": rnd(len(hot), h),
            "d2t": hot - torch.arange(len(hot)),
            "t2d": torch.zeros(cfg["vocab_size"], dtype=torch.bool).index_fill_(0, hot, True),
        }
    config |= config_overrides
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return path


def build_bigram_model(path: str, source: str) -> str:
    """The first layer of the Llama at `source` alone, with its attention output zeroed: each next
    token is a function of the current one (tokenizer files copied along)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(source, "model.safetensors"))
    kept = {n: t for n, t in weights.items() if not n.startswith("model.layers.") or n.startswith("model.layers.0.")}
    kept["model.layers.0.self_attn.o_proj.weight"] = torch.zeros_like(kept["model.layers.0.self_attn.o_proj.weight"])
    os.makedirs(path, exist_ok=True)
    save_file(kept, os.path.join(path, "model.safetensors"))
    with open(os.path.join(source, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "num_hidden_layers": 1}, f)
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(os.path.join(source, name), path)
    return path


def add_mtp_layer(path: str, bigram: bool = False) -> str:
    """Give the tiny DeepSeek-V3 at `path` a multi-token-prediction layer, as its checkpoints carry
    one: layer n (n = num_hidden_layers), a copy of layer n - 1 with `enorm`, `hnorm`, `eh_proj`,
    `shared_head` (the model's final norm and LM head) and its own copy of the embedding. With
    `bigram`, every layer's attention and MLP outputs are zeroed (each next token is a function of
    the current one) and `eh_proj` passes the token's embedding through: the MTP layer then predicts
    exactly what the model does."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    last = f"model.layers.{n - 1}."
    mtp = f"model.layers.{n}."
    weights |= {mtp + k.removeprefix(last): t.clone() for k, t in weights.items() if k.startswith(last)}
    g = torch.Generator().manual_seed(n)
    weights |= {
        mtp + "enorm.weight": torch.ones(h),
        mtp + "hnorm.weight": torch.ones(h),
        mtp + "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * 0.08,
        mtp + "shared_head.norm.weight": weights["model.norm.weight"].clone(),
        mtp + "shared_head.head.weight": weights["lm_head.weight"].clone(),
        mtp + "embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
    }
    if bigram:
        for k in weights:
            if k.endswith(("self_attn.o_proj.weight", "down_proj.weight")):
                weights[k] = torch.zeros_like(weights[k])
        weights[mtp + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    save_file({k: v.contiguous() for k, v in weights.items()}, file)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "num_nextn_predict_layers": 1}, f)
    return path


# -- live servers -------------------------------------------------------------------------------

import atexit  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import Counter, OrderedDict  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from typing import IO, cast  # noqa: E402

import requests  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Pooled servers kept alive at once besides `tiny_server` and `default_server` (each is 1-2 GB of RAM);
# beyond it, or when memory runs low, an idle one is stopped before another starts.
# Under pytest-xdist the cores are split among the workers: each worker's tests and servers compute
# with its share of the threads (two servers each spinning two OpenMP threads on two cores run far
# slower than with one each). An explicit OMP_NUM_THREADS wins.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Under pytest-xdist every worker has a pool of its own.
MAX_POOLED_SERVERS = int(
    os.environ.get("RADIXSERVE_TEST_MAX_SERVERS", "3" if os.environ.get("PYTEST_XDIST_WORKER") else "4")
)
SERVER_STARTS: Counter = Counter()  # cold starts by kind ("pooled", "private"), reported at the end
STARTUP_SECONDS: Counter = Counter()  # their time from launch to healthy, by kind


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float = 30, interval: float = 0.05, what: str = ""):
    """Poll `predicate` until it returns something truthy and return that; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not observed within {timeout} s: {what or predicate}")
        time.sleep(interval)


class ZygoteProcess:
    """The part of `subprocess.Popen` the tests use, for a server forked by the zygote."""

    def __init__(self, client: ZygoteClient, pid: int):
        self.client, self.pid, self.returncode = client, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.client.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"server pid {self.pid}", timeout or 0)
            self.client.wait_exit(0.05)
        return cast(int, self.returncode)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ZygoteClient:
    """This test process's server zygote (tests/zygote.py), started on first use; None-safe:
    `spawn` returns None when a real subprocess must be used instead (the zygote is off or broken,
    or the environment changes what an import sets up)."""

    # read by the server while it runs, not when a module is imported: safe to differ from the zygote's
    RUNTIME_ENV_PREFIXES = ("RADIXSERVE_", "OMP_NUM_THREADS")

    def __init__(self):
        self.lock = threading.Lock()
        self.changed = threading.Condition()
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.broken = os.environ.get("RADIXSERVE_TEST_ZYGOTE", "1") == "0"
        self.next_id = 0
        self.pids: dict[int, int] = {}  # request id -> pid (or -1: the fork failed)
        self.exits: dict[int, int] = {}  # pid -> returncode

    def usable_for(self, env: dict[str, str]) -> bool:
        return all(k.startswith(self.RUNTIME_ENV_PREFIXES) or self.env.get(k) == v for k, v in env.items())

    def _ensure(self) -> bool:
        if self.proc is not None and self.proc.poll() is None:
            return True
        if self.broken:
            return False
        self.env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "zygote.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
        )
        first = cast(IO[bytes], self.proc.stdout).readline()
        if not first.startswith(b'{"ready"'):
            self.broken = True
            self.proc.kill()
            return False
        threading.Thread(target=self._read, args=(self.proc,), name="zygote-reader", daemon=True).start()
        return True

    def _read(self, proc: subprocess.Popen) -> None:
        for line in cast(IO[bytes], proc.stdout):
            msg = json.loads(line)
            with self.changed:
                if "exited" in msg:
                    self.exits[msg["exited"]] = msg["code"]
                else:
                    self.pids[msg["id"]] = msg.get("pid", -1)
                self.changed.notify_all()
        with self.changed:  # the zygote is gone: nothing more will be reported
            self.broken = True
            self.changed.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], log_path: str) -> ZygoteProcess | None:
        with self.lock:
            if not self._ensure() or not self.usable_for(env):
                return None
            request_id, self.next_id = self.next_id, self.next_id + 1
            request = {"id": request_id, "argv": argv, "env": {**self.env, **env}, "cwd": ROOT, "log": log_path}
            stdin = cast(IO[bytes], cast(subprocess.Popen, self.proc).stdin)
            stdin.write((json.dumps(request) + "\n").encode())
            stdin.flush()
        with self.changed:
            self.changed.wait_for(lambda: request_id in self.pids or self.broken, timeout=60)
            pid = self.pids.pop(request_id, -1)
        return ZygoteProcess(self, pid) if pid > 0 else None

    def exit_code(self, pid: int) -> int | None:
        with self.changed:
            if pid in self.exits:
                return self.exits[pid]
            if self.broken:  # not reported, and will not be: look for the process itself
                return None if psutil_alive(pid) else -signal.SIGKILL
            return None

    def wait_exit(self, timeout: float) -> None:
        with self.changed:
            self.changed.wait(timeout)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            cast(IO[bytes], self.proc.stdin).close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def psutil_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


ZYGOTE = ZygoteClient()
atexit.register(ZYGOTE.close)


class ServerStartError(RuntimeError):
    """A server that exited or never became healthy during start-up; `log` is its whole log."""

    def __init__(self, message: str, log: str):
        super().__init__(message)
        self.log = log


class ServerProcess:
    """`python -m srt.launch_server` in its own process group, with its log in a file."""

    def __init__(
        self, args: list[str], log_path: str, timeout: float = 300, env: dict | None = None, kind: str = "private"
    ):
        SERVER_STARTS[kind] += 1
        self.pooled = kind == "pooled"
        self.api_key: str | None = None  # sent with state() when the server requires keys
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        cmd = [
            sys.executable,
            "-m",
            "srt.launch_server",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--debug-integrity-check",
            *args,
        ]
        # forked from this worker's zygote (imports already done) where it can be, else a subprocess
        proc = ZYGOTE.spawn(cmd[3:], env or {}, log_path)
        if proc is None:
            proc = subprocess.Popen(
                cmd,
                stdout=self.log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        self.proc: subprocess.Popen | ZygoteProcess = proc
        started = time.monotonic()
        deadline = started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                why = f"server exited with {self.proc.returncode} during start-up"
                raise ServerStartError(f"{why}:\n{self.tail()}", self.log_text())
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    STARTUP_SECONDS[kind] += time.monotonic() - started
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self._stop()
        raise ServerStartError(f"server did not become healthy in {timeout} s:\n{self.tail()}", self.log_text())

    def log_text(self) -> str:
        """The whole log, start-up lines included (a shared server's tail is other tests' traffic)."""
        if not self.log.closed:  # closed once the server is stopped; the file stays
            self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def tail(self, n: int = 60) -> str:
        return "".join(self.log_text().splitlines(keepends=True)[-n:])

    def post(self, path: str, json=None, **kw) -> requests.Response:
        return requests.post(self.url + path, json=json, timeout=kw.pop("timeout", 300), **kw)

    def generate(self, **body) -> dict | list:
        r = self.post("/generate", body)
        assert r.status_code == 200, r.text
        return r.json()

    def state(self) -> dict:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        return requests.get(self.url + "/server_info", headers=headers, timeout=30).json()["internal_states"][0]

    def wait_idle(self, timeout: float = 30) -> dict:
        """Wait until the scheduler is idle and has run its integrity check; returns its state."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.state()
            if s["idle"] and s["kv_available"] + s["kv_evictable"] == s["kv_capacity"] or time.monotonic() > deadline:
                return s
            time.sleep(0.1)

    def wait_for_requests(self, running: int = 1, admitted: int = 0, timeout: float = 60) -> dict:
        """Wait until at least `running` requests run and `admitted` are running or queued."""

        def seen():
            s = self.state()
            ok = s["num_running_reqs"] >= running and s["num_running_reqs"] + s["num_queue_reqs"] >= admitted
            return s if ok else None

        return wait_until(seen, timeout, what=f">= {running} running, >= {admitted} admitted requests")

    def flush_cache(self) -> None:
        """Empty the radix cache (a shared server holds other tests' prefixes)."""
        self.wait_idle()
        r = self.post("/flush_cache")
        assert r.status_code == 200, r.text
        wait_until(lambda: self.state()["kv_evictable"] == 0, 30, what="an empty radix cache")

    def stop(self) -> None:
        assert not self.pooled, "a pooled server is shared: stop a private one (server_factory) instead"
        self._stop()

    def _stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def at_baseline(server) -> None:
    """The server is idle with every KV slot free or cached, and its integrity check passed (a
    speculative server's check includes its draft KV)."""
    s = server.wait_idle()
    assert s["kv_available"] + s["kv_evictable"] == s["kv_capacity"] and s["integrity_ok"]


def check_spec_meta(out: dict) -> None:
    """A speculative answer's meta_info figures agree with each other."""
    meta = out["meta_info"]
    assert sum(meta["spec_accept_histogram"]) == meta["spec_verify_ct"] > 0
    assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
    assert 0 <= meta["spec_accept_rate"] <= 1


def accepted_drafts(outs: list[dict]) -> int:
    return sum(k * n for o in outs for k, n in enumerate(o["meta_info"]["spec_accept_histogram"]))


def generate_all(server, bodies: list[dict]) -> list[dict]:
    """Each /generate body, eight at a time."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda b: server.generate(**b), bodies))


def low_on_memory(floor_gib: float = 4) -> bool:
    import psutil

    return psutil.virtual_memory().available < floor_gib * 2**30


def server_key(args, env: dict | None, replica: int) -> tuple:
    """The flags as a set of (flag, values) groups, so their order does not matter."""
    groups: list[tuple[str, ...]] = []
    for a in args:
        if a.startswith("--") or not groups:
            groups.append((a,))
        else:
            groups[-1] += (a,)
    return tuple(sorted(groups)), tuple(sorted((env or {}).items())), replica


class ServerPool:
    """Live servers shared by the whole test run, one per configuration (flags + environment).

    Tests on a pooled server must not rely on an empty cache or on counters starting at zero (flush
    or compare deltas), and must not stop, kill or hang it: those use `server_factory`."""

    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.servers: OrderedDict[tuple, ServerProcess] = OrderedDict()  # least recently used first
        self.holders: Counter = Counter()  # modules currently holding each server
        self.uses: Counter = Counter()  # modules that have asked for each server
        self.kept: set[tuple] = set()  # outside MAX_POOLED_SERVERS; stopped only when memory runs low
        self.reuses = 0
        self.events = open(log_dir / "pool.log", "w")  # what started, was reused or stopped, and when

    def note(self, what: str, key: tuple) -> None:
        flags = " ".join(" ".join(g) for g in key[0])
        self.events.write(f"{time.strftime('%H:%M:%S')} {what}: {flags} env={dict(key[1])} replica={key[2]}\n")
        self.events.flush()

    def acquire(self, specs: list[tuple], keep: bool = False) -> list[tuple[tuple, ServerProcess]]:
        """The servers for `specs` [(args, env, replica)], starting the missing ones side by side;
        `keep` exempts them from the count limit (the configurations most modules share)."""
        keys = [server_key(*spec) for spec in specs]
        if keep:
            self.kept.update(keys)
        for key in keys:
            server = self.servers.get(key)
            if server is not None and server.proc.poll() is not None:
                del self.servers[key]  # died under some test; its failure is reported there
        missing = {key: spec for key, spec in zip(keys, specs) if key not in self.servers}
        self.reuses += len(keys) - len(missing)
        for key in keys:
            self.note("start" if key in missing else "reuse", key)
        self._make_room(len(missing), wanted=set(keys))

        def start(spec, n: int) -> ServerProcess:
            args, env, _ = spec
            log = self.log_dir / f"pooled{len(self.servers) + n}-{'-'.join(args)[-80:].replace('/', '_')}.log"
            return ServerProcess(list(args), str(log), env=env, kind="pooled")

        with ThreadPoolExecutor(max(1, len(missing))) as pool:
            futures = {key: pool.submit(start, spec, n) for n, (key, spec) in enumerate(missing.items())}
        failed = [f.exception() for f in futures.values() if f.exception() is not None]
        self.servers.update((key, f.result()) for key, f in futures.items() if f.exception() is None)
        if failed:
            raise failed[0]
        for key in keys:
            self.servers.move_to_end(key)
            self.holders[key] += 1
            self.uses[key] += 1
        return [(key, self.servers[key]) for key in keys]

    def release(self, key: tuple) -> None:
        self.holders[key] -= 1

    def _make_room(self, n: int, wanted: set[tuple]) -> None:
        # Least recently used first, never one that a running module holds or that this acquire
        # reuses (`wanted`); kept ones only when low on memory.
        def counted() -> int:
            return sum(k not in self.kept for k in self.servers)

        idle = [k for k in self.servers if self.holders[k] <= 0 and k not in wanted]
        idle.sort(key=lambda k: k in self.kept)
        while idle and n:
            if counted() + n > MAX_POOLED_SERVERS and idle[0] not in self.kept:
                self.note("stop", idle[0])
            elif low_on_memory():
                self.note("stop (low on memory)", idle[0])
            else:
                break
            self.servers.pop(idle.pop(0))._stop()

    def close(self) -> None:
        while self.servers:
            self.servers.popitem()[1]._stop()
        self.events.close()


_pool: ServerPool | None = None


@pytest.fixture(scope="session")
def server_pool(tmp_path_factory):
    global _pool
    _pool = ServerPool(tmp_path_factory.mktemp("pooled-server-logs"))
    yield _pool
    _pool.close()


class SharedServers:
    """A module's handle on the pool: what it asks for stays up until the module ends."""

    def __init__(self, pool: ServerPool):
        self.pool = pool
        self.held: list[tuple] = []

    def __call__(self, *args: str, env: dict | None = None, replica: int = 0, keep: bool = False) -> ServerProcess:
        """The run's server with these flags (and environment), started on first use."""
        return self.replicas(1, *args, env=env, first=replica, keep=keep)[0]

    def replicas(
        self, n: int, *args: str, env: dict | None = None, first: int = 0, keep: bool = False
    ) -> list[ServerProcess]:
        """n distinct servers with the same flags (e.g. two router workers), started side by side."""
        got = self.pool.acquire([(args, env, replica) for replica in range(first, first + n)], keep)
        self.held += [key for key, _ in got]
        return [server for _, server in got]

    def release(self) -> None:
        for key in self.held:
            self.pool.release(key)


@pytest.fixture(scope="module")
def shared_server(server_pool):
    """`shared_server(*flags, env=None)`: a pooled server, shared with every module using the same
    flags. Do not stop, kill or hang it, and do not assume an empty cache or zeroed counters."""
    handle = SharedServers(server_pool)
    yield handle
    handle.release()


@pytest.fixture(scope="module")
def tiny_server(shared_server, tiny_chat_model) -> ServerProcess:
    """The plain server on the tiny random model that many modules share, kept for the whole run."""
    return shared_server("--model-path", tiny_chat_model, "--max-total-tokens", "8192", keep=True)


@pytest.fixture(scope="module")
def default_server(shared_server, default_model_path) -> ServerProcess:
    """The plain server on the default model that many modules share, kept for the whole run."""
    return shared_server("--max-total-tokens", "16384", keep=True)


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory):
    """Private servers, stopped at the end of the module: for tests that stop, kill, hang or
    fault-inject a server, or that need a cold start."""
    servers: list[ServerProcess] = []
    logs = tmp_path_factory.mktemp("server-logs")

    def start(*args: str, env: dict | None = None) -> ServerProcess:
        s = ServerProcess(list(args), str(logs / f"server{len(servers)}.log"), env=env)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


# Under pytest-xdist (`--dist loadscope`) each module runs whole on one worker, handed out in
# collection order: the longest modules go first, so that none of them starts last and leaves the
# other worker idle meanwhile (ordered by their time in a serial run of `make test`, longest first).
LONGEST_MODULES = [
    "tests/server/test_torch_compile.py",
    "tests/server/test_disaggregation.py",
    "tests/server/test_hicache.py",
    "tests/model_loader/test_gguf_quantized.py",
    "tests/server/test_parallel.py",
    "tests/server/test_structured_output.py",
    "tests/server/test_tool_calls.py",
    "tests/server/test_retraction.py",
    "tests/qos/test_priority.py",
    "tests/deterministic/test_deterministic.py",
    "tests/rl/test_weight_updates.py",
    "tests/lora/test_lora_serving.py",
    "tests/server/test_speculative.py",
    "tests/server/test_lifecycle.py",
    "tests/model_loader/test_gguf_loader.py",
    "tests/server/test_moe_serving.py",
    "tests/server/test_consistency.py",
    "tests/server/test_kv_cache_dtype.py",
    "tests/server/test_attention_backends.py",
    "tests/server/test_overlap.py",
    "tests/model_loader/test_hf_quantized.py",
    "tests/frontend/test_examples.py",
    "tests/kernels/test_triton_kernels.py",
]


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {path: i for i, path in enumerate(LONGEST_MODULES)}
        # a stable sort: the other modules keep their order
        items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))


def pytest_runtest_logreport(report):
    """RADIXSERVE_INSTAFAIL=1 (benchmark/gpu_check.sh): a failure's traceback as it happens, so a
    run its stage's timeout cuts short still says why each test failed."""
    if report.failed and os.environ.get("RADIXSERVE_INSTAFAIL"):
        sys.stderr.write(f"\n--- {report.nodeid} ({report.when}) failed:\n{report.longreprtext[-3000:]}\n")
        sys.stderr.flush()


POOL_REUSES: Counter = Counter()  # reuses of pooled servers; under xdist, the workers' counts summed here


def pytest_sessionfinish(session):
    # An xdist worker hands its counts to the controller, which prints the summary line.
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["server_starts"] = dict(SERVER_STARTS)
        output["startup_seconds"] = dict(STARTUP_SECONDS)
        output["pool_reuses"] = _pool.reuses if _pool else 0


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    output = getattr(node, "workeroutput", {})
    SERVER_STARTS.update(output.get("server_starts", {}))
    STARTUP_SECONDS.update(output.get("startup_seconds", {}))
    POOL_REUSES["workers"] += output.get("pool_reuses", 0)


def pytest_terminal_summary(terminalreporter):
    if SERVER_STARTS:
        reuses = (_pool.reuses if _pool else 0) + POOL_REUSES["workers"]
        terminalreporter.write_line(
            f"live-server cold starts: {SERVER_STARTS['pooled']} pooled (reused {reuses} times), "
            f"{SERVER_STARTS['private']} private, {sum(STARTUP_SECONDS.values()):.0f} s from launch to healthy in all "
            "(pooled ones start side by side)"
        )


THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<|im_start|>system\nno thinking<|im_end|>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def think_template(tmp_path_factory) -> str:
    """A chat template that shows `enable_thinking: false` in the prompt, for reasoning tests (with
    `--reasoning-parser qwen3`; the tiny model thinks when a regex makes it write <think>...</think>)."""
    path = os.path.join(tmp_path_factory.mktemp("think"), "think.jinja")
    with open(path, "w") as f:
        f.write(THINK_TEMPLATE)
    return path


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, default_model_path) -> str:
    """A tiny random Llama with the default model's tokenizer and an 8k context, for fast server tests."""
    path = str(tmp_path_factory.mktemp("tiny-chat"))
    build_tiny_model(path, "LlamaForCausalLM", vocab_size=49152, max_position_embeddings=8192, eos_token_id=2)
    for name in os.listdir(default_model_path):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(default_model_path, name), path)
    return path

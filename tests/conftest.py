"""Shared fixtures: tiny random HF models per architecture, and a model runner over them."""

from __future__ import annotations

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
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


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
    from srt.model_executor.model_runner import ModelRunner
    from srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path=model_path, **{"dtype": "float32", "max_total_tokens": 8192, "max_running_requests": 32, **args}
    )
    return ModelRunner(ModelConfig.from_path(model_path, server_args.context_length), server_args)


@pytest.fixture(scope="session")
def runner_factory():
    return make_runner


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The embedded SmolLM2-135M-Instruct, converted once into the user's cache."""
    from srt.model_loader.default_model import resolve_default_model

    return resolve_default_model(progress=False)


# -- live servers -------------------------------------------------------------------------------

import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import requests  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m srt.launch_server` in its own process group, with its log in a file."""

    def __init__(self, args: list[str], log_path: str, timeout: float = 300, env: dict | None = None):
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
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.tail()}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not become healthy in {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def post(self, path: str, json=None, **kw) -> requests.Response:
        return requests.post(self.url + path, json=json, timeout=kw.pop("timeout", 300), **kw)

    def generate(self, **body) -> dict | list:
        r = self.post("/generate", body)
        assert r.status_code == 200, r.text
        return r.json()

    def state(self) -> dict:
        return requests.get(self.url + "/server_info", timeout=30).json()["internal_states"][0]

    def wait_idle(self, timeout: float = 30) -> dict:
        """Wait until the scheduler is idle and has run its integrity check; returns its state."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.state()
            if s["idle"] and s["kv_available"] + s["kv_evictable"] == s["kv_capacity"] or time.monotonic() > deadline:
                return s
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory):
    servers: list[ServerProcess] = []
    logs = tmp_path_factory.mktemp("server-logs")

    def start(*args: str, env: dict | None = None) -> ServerProcess:
        s = ServerProcess(list(args), str(logs / f"server{len(servers)}.log"), env=env)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, default_model_path) -> str:
    """A tiny random Llama with the default model's tokenizer and an 8k context, for fast server tests."""
    path = str(tmp_path_factory.mktemp("tiny-chat"))
    build_tiny_model(path, "LlamaForCausalLM", vocab_size=49152, max_position_embeddings=8192, eos_token_id=2)
    for name in os.listdir(default_model_path):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(default_model_path, name), path)
    return path

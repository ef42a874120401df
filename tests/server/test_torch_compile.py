"""--enable-torch-compile through a live server: decode graphs compile in the background while the
server already answers, greedy outputs (float32) are identical to an eager server, and a restart
takes its graphs from the on-disk inductor cache."""

import concurrent.futures
import re

import pytest
from conftest import wait_until

PARAMS = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "1, 2, 3, 4,", "Hello"]
COMPILE = ("--enable-torch-compile", "--torch-compile-max-bs", "4", "--max-total-tokens", "4096")


@pytest.fixture(scope="module")
def model(tiny_chat_model):
    return tiny_chat_model


@pytest.fixture(scope="module")
def inductor_env(tmp_path_factory):
    return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor"))}


def wait_compiled(server, timeout=900) -> dict:
    def compiled():
        status = server.state()["torch_compile"]
        assert status["failed"] is None, status
        return status if status["ready"] == status["buckets"] else None

    return wait_until(compiled, timeout, interval=0.5, what="decode graphs compiled")


def run_all(server) -> list[list[int]]:
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # a decode batch of 3: padded to bucket 4
        batch = list(pool.map(lambda p: server.generate(text=p, sampling_params=PARAMS)["output_ids"], PROMPTS[:3]))
    return batch + [server.generate(text=PROMPTS[3], sampling_params=PARAMS)["output_ids"]]


@pytest.fixture(scope="module")
def eager_outputs(tiny_server):
    server = tiny_server  # the same model as `model`, without --enable-torch-compile
    assert server.state()["torch_compile"] is None
    return run_all(server)


def test_compiled_server_serves_while_compiling_and_matches_eager(server_factory, model, inductor_env, eager_outputs):
    server = server_factory("--model-path", model, *COMPILE, env=inductor_env)
    # answered before (or while) the graphs compile: the server serves eagerly meanwhile
    first = server.generate(text=PROMPTS[3], sampling_params=PARAMS)["output_ids"]
    assert first == eager_outputs[3]
    status = wait_compiled(server)
    assert status["buckets"] == [1, 2, 4]
    steps = status["steps"]
    assert run_all(server) == eager_outputs
    after = server.state()["torch_compile"]
    assert after["steps"] > steps  # the decode steps ran the compiled graphs
    assert after["graphs"] == status["graphs"] == 3  # and never recompiled on the serving path
    log = server.tail(400)
    assert re.search(r"torch.compile decode batch 4 ready in [\d.]+ s \(compiled and autotuned\)", log), log
    assert "decode graphs (batch 1,2,4) ready" in log
    server.stop()

    # a restart reads the graphs from the on-disk cache
    again = server_factory("--model-path", model, *COMPILE, env=inductor_env)
    warm = wait_compiled(again)
    assert set(warm["cache"].values()) == {"kernels and autotuning from the on-disk cache"}, warm
    assert sum(warm["compile_seconds"].values()) < sum(status["compile_seconds"].values())
    assert run_all(again) == eager_outputs
    assert again.wait_idle()["integrity_ok"]


def test_bad_compile_flag_is_rejected(model):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "srt.launch_server", "--model-path", model, "--torch-compile-max-bs", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "--torch-compile-max-bs must be in [1, 1024], got 0" in proc.stderr + proc.stdout

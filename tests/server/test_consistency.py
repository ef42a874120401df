"""Greedy outputs of the default model through live servers: identical across radix cache on/off,
chunk sizes, page sizes, batched vs one by one, the Engine, and equal to HF transformers."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from srt.hf_transformers_utils import get_tokenizer

SYSTEM = (
    "You are a meticulous assistant. Answer briefly and precisely. Think about units, names and dates, "
    "and never invent facts. If a question is ambiguous, say which reading you chose, and keep every "
    "answer to a single short sentence unless the user explicitly asks for more detail."
)
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 3?",
    "Write one word that rhymes with cat.",
    "Who wrote Hamlet?",
    "What is the boiling point of water?",
]
NEW_TOKENS = 16
PARAMS = {"temperature": 0, "max_new_tokens": NEW_TOKENS}

CONFIGS = {
    "radix-off-chunk-64": ["--disable-radix-cache", "--chunked-prefill-size", "64"],
    "chunk-512-page-16": ["--chunked-prefill-size", "512", "--page-size", "16"],
    "chunk-off-page-16": ["--chunked-prefill-size", "-1", "--page-size", "16"],
    # SmolLM2's 9 heads / 3 KV heads split unevenly over 2 ranks (6 + 3 heads)
    "tp-2-chunk-64": ["--tp-size", "2", "--chunked-prefill-size", "64"],
}
QUICK_CONFIGS = ("chunk-512-page-16",)  # the others run in make test-all (radix on and off: test_radix_cache_hits_*)


@pytest.fixture(scope="module")
def prompts(default_model_path):
    tok = get_tokenizer(default_model_path)
    msgs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    out = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
    return [tok.encode(t, add_special_tokens=False) for t in out]


@pytest.fixture(scope="module")
def hf_reference(default_model_path, prompts):
    tok = get_tokenizer(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
            outs.append(ids[0, len(p) :].tolist())
    return outs


@pytest.fixture(scope="module")
def baseline(default_server):
    return default_server


def ids_of(outs):
    return [o["output_ids"] for o in outs]


def test_prompts_are_long_enough_to_be_chunked(prompts):
    assert min(len(p) for p in prompts) > 64


def test_baseline_batched_equals_hf_and_one_by_one(baseline, prompts, hf_reference):
    baseline.flush_cache()  # computed from scratch, batched
    batched = ids_of(baseline.generate(input_ids=prompts, sampling_params=PARAMS))
    assert batched == hf_reference
    single = [baseline.generate(input_ids=p, sampling_params=PARAMS)["output_ids"] for p in prompts]
    assert single == hf_reference


def test_radix_cache_hits_do_not_change_outputs(baseline, prompts, hf_reference):
    baseline.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1})  # caches the prompts
    again = baseline.generate(input_ids=prompts, sampling_params=PARAMS)
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)  # non-vacuous
    assert ids_of(again) == hf_reference


def test_mixed_batches_with_running_decodes(baseline, prompts, hf_reference):
    """Requests arriving while others decode join later prefill batches; outputs stay the same."""
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(baseline.generate, input_ids=p, sampling_params=PARAMS) for p in prompts]
        outs = [f.result()["output_ids"] for f in futs]
    assert outs == hf_reference


@pytest.mark.parametrize(
    "name", [n if n in QUICK_CONFIGS else pytest.param(n, marks=pytest.mark.full) for n in CONFIGS]
)
def test_configs_match_reference(name, shared_server, prompts, hf_reference):
    server = shared_server("--max-total-tokens", "16384", *CONFIGS[name])
    server.flush_cache()  # the first pass computes every prompt
    first = server.generate(input_ids=prompts, sampling_params=PARAMS)
    second = server.generate(input_ids=prompts, sampling_params=PARAMS)
    assert ids_of(first) == ids_of(second) == hf_reference
    cached = [o["meta_info"]["cached_tokens"] for o in second]
    if "--disable-radix-cache" in CONFIGS[name]:
        assert cached == [0] * len(prompts)
    else:
        assert all(c > 0 for c in cached)


def test_engine_equals_http(baseline, default_model_path, prompts):
    from srt import Engine

    with Engine(max_total_tokens=16384, dtype="float32", log_level="warning") as engine:
        via_engine = engine.generate(input_ids=prompts[:3], sampling_params=PARAMS)
        streamed = list(engine.generate(input_ids=prompts[0], sampling_params=PARAMS, stream=True))
        text_single = engine.generate(prompt="The capital of France is", sampling_params=PARAMS)
        assert engine.flush_cache() is True
        info = engine.get_server_info()
    # shut down, its ZeroMQ context is closed: one left to the garbage collector with open sockets
    # blocks whatever the collector interrupts
    assert engine.tokenizer_manager.zmq_ctx.closed
    for call in (  # after shutdown every call says so (they waited forever on the stopped loop)
        lambda: engine.generate(prompt="x", sampling_params=PARAMS),
        lambda: list(engine.generate(prompt="x", sampling_params=PARAMS, stream=True)),
        engine.flush_cache,
    ):
        with pytest.raises(RuntimeError, match="the Engine is shut down"):
            call()
    engine.shutdown()  # twice: nothing happens
    via_http = baseline.generate(input_ids=prompts[:3], sampling_params=PARAMS)
    assert ids_of(via_engine) == ids_of(via_http)
    assert [o["text"] for o in via_engine] == [o["text"] for o in via_http]
    assert streamed[-1]["output_ids"] == via_http[0]["output_ids"] and len(streamed) > 1
    assert (
        text_single["output_ids"]
        == baseline.generate(text="The capital of France is", sampling_params=PARAMS)["output_ids"]
    )
    assert info["max_total_num_tokens"] == 16384 and info["internal_states"][0]["idle"]

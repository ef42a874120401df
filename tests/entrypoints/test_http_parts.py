"""The HTTP layer's pure parts, without a server: load formatting from an internal state, the
Engine's keyword set, and the detokenizer passing the token output on."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from srt.entrypoints.engine import GenerateArgs, generate_request
from srt.entrypoints.http.load import full_load, load, loads_prometheus
from srt.managers.io_struct import BatchStrOutput, BatchTokenIDOutput, DecodeSettings, GenerateReqInput
from srt.managers.scheduler_state import GrammarState, SchedulerState

STATE = SchedulerState(
    dp_rank=1,
    num_running_reqs=2,
    num_queue_reqs=3,
    num_waiting_tokens=40,
    token_usage=0.123456,
    cache_hit_rate=0.25,
    total_retractions=0,
    forward_passes=0,
    kv_available=100,
    kv_evictable=20,
    kv_protected=0,
    kv_capacity=160,
    req_slots_free=30,
    integrity_ok=True,
    forward_busy_s=0.0,
    forward_wait_s=0.0,
    forward_idle_fraction=0.0,
    overlap_schedule=False,
    attention_backend="cpu",
    torch_compile=None,
    cuda_graph=None,
    metrics=None,
    idle=False,
    pid=1,
    grammar=GrammarState(queue=1, compile=None, jump_forward_tokens=0),
)


def test_used_tokens_exclude_free_and_evictable_slots():
    assert STATE.used_tokens == 40


def test_get_load_and_v1_loads_shapes():
    assert load(STATE) == {"dp_rank": 1, "num_reqs": 6, "num_waiting_reqs": 4, "num_tokens": 80}
    core = full_load(STATE, 32, {"core"})
    assert core["num_used_tokens"] == 40 and core["token_usage"] == 0.1235 and core["gen_throughput"] == 0.0
    assert "queues" not in core and "lora" not in core
    assert full_load(STATE, 32, {"all"})["queues"] == {"waiting": 3, "grammar": 1}
    text = loads_prometheus([core])
    assert 'sglang_num_used_tokens{dp_rank="1"} 40\n' in text and text.count("# TYPE") == 7


def test_engine_keywords_are_generate_req_input_fields():
    fields = {f.name for f in dataclasses.fields(GenerateReqInput)}
    assert GenerateArgs.__optional_keys__ <= fields
    obj = generate_request("generate", "hi", {"max_new_tokens": 1}, {"rid": "r", "stream": True})
    assert (obj.text, obj.rid, obj.stream, obj.sampling_params) == ("hi", "r", True, {"max_new_tokens": 1})


def test_batch_items_take_per_prompt_values_and_share_the_rest():
    obj = GenerateReqInput(
        input_ids=[[1, 2], [3]], rid=["a", "b"], priority=5, token_ids_logprob=[[7], [8]], stream=True
    )
    obj.validate()
    second = obj.item(1)
    assert (second.input_ids, second.rid, second.priority, second.token_ids_logprob) == ([3], "b", 5, [8])
    assert second.stream and not second.is_batch


def test_detokenizer_output_carries_the_token_output():
    from srt.managers.detokenizer_manager import DetokenizerManager

    class Tokenizer:
        def decode(self, ids, **kw):
            return "".join(chr(ord("a") + i) for i in ids)

    manager = DetokenizerManager.__new__(DetokenizerManager)
    manager.tokenizer, manager.decoders = cast(Any, Tokenizer()), {}
    settings = DecodeSettings(
        skip_special_tokens=True, spaces_between_special_tokens=True, stop_strs=(), no_stop_trim=False
    )
    batch = BatchTokenIDOutput(
        rids=["r"], finished_reasons=[None], new_output_ids=[[0, 1]], decode_settings=[settings], prompt_tokens=[3]
    )
    out = manager.handle(batch)
    assert isinstance(out, BatchStrOutput) and out.text_deltas == ["ab"]
    assert out.token_output.rids == ["r"] and out.token_output.prompt_tokens == [3]
    assert out.token_output.decode_settings == []  # the tokenizer manager has no use for them

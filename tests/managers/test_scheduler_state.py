"""SchedulerState: the typed scheduler state and its wire form in /server_info."""

from __future__ import annotations

from srt.managers.scheduler_state import GrammarState, SchedulerState, SpeculativeState

WIRE_KEYS = {
    "dp_rank", "num_running_reqs", "num_queue_reqs", "num_waiting_tokens", "token_usage", "cache_hit_rate",
    "total_retractions", "forward_passes", "jump_forward_tokens", "grammar_queue", "grammar_compile",
    "kv_available", "kv_evictable", "kv_protected", "kv_capacity", "req_slots_free", "integrity_ok",
    "forward_busy_s", "forward_wait_s", "forward_idle_fraction", "overlap_schedule", "avg_spec_accept_length",
    "spec_accept_rate", "speculative", "hicache", "disagg", "lora", "attention_backend", "torch_compile",
    "cuda_graph", "metrics", "idle", "pid", "pooling", "weights", "qos", "sessions",
    "prompt_tokens_total", "generated_tokens_total", "continuous_decode",
}  # fmt: skip


def make_state(**overrides) -> SchedulerState:
    core = dict(
        dp_rank=0, num_running_reqs=2, num_queue_reqs=3, num_waiting_tokens=40, token_usage=0.5,
        cache_hit_rate=0.25, total_retractions=1, forward_passes=9, kv_available=100, kv_evictable=20,
        kv_protected=8, kv_capacity=160, req_slots_free=30, integrity_ok=True, forward_busy_s=1.0,
        forward_wait_s=0.5, forward_idle_fraction=1 / 3, overlap_schedule=False, attention_backend="cpu",
        torch_compile=None, cuda_graph=None, metrics=None, idle=False, pid=1,
    )  # fmt: skip
    return SchedulerState(**{**core, **overrides})


def test_wire_form_without_features_has_every_key_with_neutral_values():
    out = make_state().to_json()
    assert set(out) == WIRE_KEYS
    assert out["grammar_queue"] == 0 and out["grammar_compile"] is None and out["jump_forward_tokens"] == 0
    assert out["avg_spec_accept_length"] == 0.0 and out["spec_accept_rate"] == 0.0 and out["speculative"] is None
    assert out["lora"] is None and out["hicache"] is None and out["disagg"] is None and out["pooling"] is None
    assert out["qos"] is None and out["sessions"] is None
    assert out["weights"] is None and out["continuous_decode"] is None


def test_feature_parts_flatten_to_sglang_keys():
    state = make_state(
        grammar=GrammarState(queue=4, compile={"compiled": 2}, jump_forward_tokens=7),
        speculative=SpeculativeState(avg_accept_length=2.5, accept_rate=0.75, proposer={"drafted_steps": 3}),
        lora={"slots": 2},
    )
    out = state.to_json()
    assert set(out) == WIRE_KEYS
    assert (out["grammar_queue"], out["grammar_compile"], out["jump_forward_tokens"]) == (4, {"compiled": 2}, 7)
    assert (out["avg_spec_accept_length"], out["spec_accept_rate"]) == (2.5, 0.75)
    assert out["speculative"] == {"drafted_steps": 3} and out["lora"] == {"slots": 2}


def test_derived_values():
    state = make_state(grammar=GrammarState(queue=4, compile=None, jump_forward_tokens=0))
    assert state.used_tokens == 160 - 100 - 20
    assert state.num_waiting_reqs == 3 + 4
    assert state.gen_throughput == 0.0
    assert make_state(metrics={"gen_throughput": 12.5}).gen_throughput == 12.5

"""The scheduler's state as the tokenizer manager, /server_info, the load routes and the metrics
collector read it: one typed record per data-parallel replica, with a part per feature (None when
the server runs without it) and the derived values as properties. `to_json` is its wire form in
/server_info's `internal_states` (SGLang's key names, flat)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class GrammarState:
    queue: int  # requests waiting for their grammar to compile
    compile: dict[str, Any] | None  # the backend's compile stats; None with --grammar-backend none
    jump_forward_tokens: int


@dataclass
class SpeculativeState:
    avg_accept_length: float  # tokens per request per verify step
    accept_rate: float  # accepted / proposed drafts
    proposer: dict[str, Any]  # the proposer's own stats (cost model, draft model KV)


@dataclass
class SchedulerState:
    dp_rank: int
    num_running_reqs: int
    num_queue_reqs: int
    num_waiting_tokens: int
    token_usage: float
    cache_hit_rate: float
    total_retractions: int
    forward_passes: int
    kv_available: int
    kv_evictable: int
    kv_protected: int
    kv_capacity: int
    req_slots_free: int
    integrity_ok: bool
    forward_busy_s: float
    forward_wait_s: float
    forward_idle_fraction: float
    overlap_schedule: bool
    attention_backend: str
    torch_compile: dict[str, Any] | None
    cuda_graph: dict[str, Any] | None
    metrics: dict[str, Any] | None  # the scheduler's metrics (--enable-metrics)
    idle: bool
    pid: int
    prompt_tokens_total: int = 0  # prompt tokens admitted so far (cached ones included)
    generated_tokens_total: int = 0  # output tokens so far
    # one part per feature, filled by its component (`SchedulerComponent.fill_state`)
    grammar: GrammarState | None = None
    speculative: SpeculativeState | None = None
    lora: dict[str, Any] | None = None
    hicache: dict[str, Any] | None = None
    disagg: dict[str, Any] | None = None
    weights: dict[str, Any] | None = None  # srt/rl: the weights' version, paused generation, updates
    pooling: dict[str, Any] | None = None  # srt/pooling: what it serves and how many requests it pooled
    sessions: dict[str, Any] | None = None  # srt/sessions: sessions with locked KV, their tokens
    qos: dict[str, Any] | None = None  # srt/qos: priorities, preemptions, queue rejections, fair shares
    # srt/continuous_decode: decode calls that took several steps, the steps they took, single-step calls
    continuous_decode: dict[str, Any] | None = None

    @property
    def used_tokens(self) -> int:
        """KV slots held by requests (neither free nor evictable cache)."""
        return self.kv_capacity - self.kv_available - self.kv_evictable

    @property
    def num_grammar_queue_reqs(self) -> int:
        return self.grammar.queue if self.grammar is not None else 0

    @property
    def num_waiting_reqs(self) -> int:
        """Queued requests: waiting to run or for their grammar."""
        return self.num_queue_reqs + self.num_grammar_queue_reqs

    @property
    def gen_throughput(self) -> float:
        return self.metrics["gen_throughput"] if self.metrics is not None else 0.0

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("grammar", "speculative")}
        grammar, spec = self.grammar, self.speculative
        out |= {
            "grammar_queue": self.num_grammar_queue_reqs,
            "grammar_compile": grammar.compile if grammar is not None else None,
            "jump_forward_tokens": grammar.jump_forward_tokens if grammar is not None else 0,
            "avg_spec_accept_length": spec.avg_accept_length if spec is not None else 0.0,
            "spec_accept_rate": spec.accept_rate if spec is not None else 0.0,
            "speculative": spec.proposer if spec is not None else None,
        }
        return out

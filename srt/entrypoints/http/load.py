"""Load reports from the schedulers' states (one SchedulerState per data-parallel replica):
/get_load, /v1/loads and its Prometheus text."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from srt.managers.scheduler_state import SchedulerState

# /v1/loads sections (SGLang's names); the ones this server has no numbers for are simply absent.
LOAD_SECTIONS = ("core", "queues", "memory", "spec", "lora", "disagg", "all")
PROMETHEUS_GAUGES = (
    "num_running_reqs",
    "num_waiting_reqs",
    "num_used_tokens",
    "max_total_num_tokens",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
)


def load(st: SchedulerState) -> dict:
    """One replica's /get_load entry (SGLang's shape; routers sum `num_tokens`)."""
    return {
        "dp_rank": st.dp_rank,
        "num_reqs": st.num_running_reqs + st.num_waiting_reqs,
        "num_waiting_reqs": st.num_waiting_reqs,
        "num_tokens": st.used_tokens + st.num_waiting_tokens,
    }


def full_load(st: SchedulerState, max_running_requests: int, include: set[str]) -> dict:
    """One replica's /v1/loads entry: the core numbers, plus the sections in `include`."""
    out = {
        "dp_rank": st.dp_rank,
        "num_running_reqs": st.num_running_reqs,
        "num_waiting_reqs": st.num_waiting_reqs,
        "num_used_tokens": st.used_tokens,
        "max_total_num_tokens": st.kv_capacity,
        "token_usage": round(st.token_usage, 4),
        "gen_throughput": round(st.gen_throughput, 2),
        "cache_hit_rate": round(st.cache_hit_rate, 4),
        "max_running_requests": max_running_requests,
    }
    if include & {"queues", "all"}:
        out["queues"] = {"waiting": st.num_queue_reqs, "grammar": st.num_grammar_queue_reqs}
    if include & {"lora", "all"} and st.lora:
        lora = st.lora
        out["lora"] = {
            "registered_adapters": len(lora["adapters"]),
            "loaded_adapters": sum(a["slot"] is not None for a in lora["adapters"]),
            "running_adapters": len(lora["running_adapters"]),
            "max_loaded_loras": lora["slots"],
            "max_loras_per_batch": lora["max_loras_per_batch"],
        }
    if include & {"disagg", "all"} and st.disagg:
        out["disagg"] = dict(st.disagg)
    return out


def loads_prometheus(loads: list[dict]) -> str:
    """/v1/loads?format=prometheus: one gauge per core number, labelled by dp_rank."""
    lines = []
    for key in PROMETHEUS_GAUGES:
        lines.append(f"# TYPE sglang_{key} gauge")
        lines += [f'sglang_{key}{{dp_rank="{x["dp_rank"]}"}} {x[key]}' for x in loads]
    return "\n".join(lines) + "\n"

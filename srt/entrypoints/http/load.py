"""Load reports from the schedulers' internal states: /get_load, /v1/loads and its Prometheus text.

This is the one place in the HTTP layer that reads the state's keys (GetInternalStateReqOutput.state,
one per data-parallel replica)."""

from __future__ import annotations

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


def dp_rank(st: dict) -> int:
    return st.get("dp_rank", 0)


def used_tokens(st: dict) -> int:
    """KV tokens held by requests (cached prefixes that could be evicted are free)."""
    return st["kv_capacity"] - st["kv_available"] - st["kv_evictable"]


def _waiting(st: dict) -> int:
    return st["num_queue_reqs"] + st["grammar_queue"]


def load(st: dict) -> dict:
    """One replica's /get_load entry (SGLang's shape; routers sum `num_tokens`)."""
    return {
        "dp_rank": dp_rank(st),
        "num_reqs": st["num_running_reqs"] + _waiting(st),
        "num_waiting_reqs": _waiting(st),
        "num_tokens": used_tokens(st) + st["num_waiting_tokens"],
    }


def full_load(st: dict, max_running_requests: int, include: set[str]) -> dict:
    """One replica's /v1/loads entry: the core numbers, plus the sections in `include`."""
    out = {
        "dp_rank": dp_rank(st),
        "num_running_reqs": st["num_running_reqs"],
        "num_waiting_reqs": _waiting(st),
        "num_used_tokens": used_tokens(st),
        "max_total_num_tokens": st["kv_capacity"],
        "token_usage": round(st["token_usage"], 4),
        "gen_throughput": round((st["metrics"] or {}).get("gen_throughput", 0.0), 2),
        "cache_hit_rate": round(st["cache_hit_rate"], 4),
        "max_running_requests": max_running_requests,
    }
    if include & {"queues", "all"}:
        out["queues"] = {"waiting": st["num_queue_reqs"], "grammar": st["grammar_queue"]}
    if include & {"lora", "all"} and st.get("lora"):
        lora = st["lora"]
        out["lora"] = {
            "registered_adapters": len(lora["adapters"]),
            "loaded_adapters": sum(a["slot"] is not None for a in lora["adapters"]),
            "running_adapters": len(lora["running_adapters"]),
            "max_loaded_loras": lora["slots"],
            "max_loras_per_batch": lora["max_loras_per_batch"],
        }
    if include & {"disagg", "all"} and st.get("disagg"):
        out["disagg"] = dict(st["disagg"])
    return out


def loads_prometheus(loads: list[dict]) -> str:
    """/v1/loads?format=prometheus: one gauge per core number, labelled by dp_rank."""
    lines = []
    for key in PROMETHEUS_GAUGES:
        lines.append(f"# TYPE sglang_{key} gauge")
        lines += [f'sglang_{key}{{dp_rank="{x["dp_rank"]}"}} {x[key]}' for x in loads]
    return "\n".join(lines) + "\n"

"""Per-tenant budgets at the door: requests per minute, tokens per minute and concurrent requests
for each API key (or --tenant-header value), from --tenant-config and the --tenant-* flags.

Each rate is a token bucket that holds one minute's budget and refills continuously. A request is
admitted while its tenant has a request left in the minute, is not in token debt, and is under its
concurrency cap; its prompt tokens are charged on admission and its generated tokens when it ends
(a long answer may run the bucket into debt: the next request waits until it refills). A refusal
is an HTTP 429 whose Retry-After says when the budget allows the request again.

The file (JSON):

    {"default": {"rpm": 600, "tpm": 200000, "max_concurrency": 16},
     "tenants": {"alice": {"api_key": "sk-alice", "rpm": 60, "tpm": 20000, "max_concurrency": 4},
                 "bob": {"api_key": "sk-bob"}}}

A tenant's key is accepted like an --api-key; its name labels /metrics and the dashboard (the key
itself never appears). With --tenant-header, "tenants" are keyed by the header's value and need no
api_key. "default" applies to every other tenant (each --api-key, each header value, or everyone
when the server has no keys); a limit left out is unlimited. The flags --tenant-rpm, --tenant-tpm
and --tenant-max-concurrency give the default's limits where the file does not.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from srt.server_args import ServerArgs

LIMIT_FIELDS = ("rpm", "tpm", "max_concurrency")
DEFAULT_TENANT = "default"


class RateLimited(Exception):
    """A tenant is over its budget: HTTP 429 with Retry-After (seconds)."""

    status = 429

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class TenantLimits:
    rpm: float | None = None
    tpm: float | None = None
    max_concurrency: int | None = None

    @property
    def unlimited(self) -> bool:
        return self.rpm is None and self.tpm is None and self.max_concurrency is None


@dataclass(frozen=True)
class TenantConfig:
    default: TenantLimits = TenantLimits()
    limits: dict[str, TenantLimits] = field(default_factory=dict)  # by tenant name
    keys: dict[str, str] = field(default_factory=dict)  # API key -> tenant name

    @property
    def enabled(self) -> bool:
        return not self.default.unlimited or any(not lim.unlimited for lim in self.limits.values())

    def limits_of(self, name: str) -> TenantLimits:
        return self.limits.get(name, self.default)


def _limits(where: str, raw: Any, fallback: TenantLimits) -> TenantLimits:
    if not isinstance(raw, dict):
        raise ValueError(f"--tenant-config: {where} must be an object, got {raw!r}")
    unknown = sorted(set(raw) - {*LIMIT_FIELDS, "api_key"})
    if unknown:
        fields = ", ".join(LIMIT_FIELDS)
        raise ValueError(f"--tenant-config: {where} has unknown field {unknown[0]!r}; fields: {fields}, api_key")
    values = {}
    for name in LIMIT_FIELDS:
        v = raw.get(name, getattr(fallback, name))
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise ValueError(f"--tenant-config: {where}.{name} = {v!r} must be a number > 0 (or left out)")
        if name == "max_concurrency" and v is not None and v != int(v):
            raise ValueError(f"--tenant-config: {where}.max_concurrency = {v!r} must be an integer")
        values[name] = int(v) if name == "max_concurrency" and v is not None else v
    return TenantLimits(**values)


def load_tenant_config(args: ServerArgs) -> TenantConfig:
    """The tenants' limits from --tenant-config and the --tenant-* flags; ValueError names the bad field."""
    flags = TenantLimits(args.tenant_rpm, args.tenant_tpm, args.tenant_max_concurrency)
    if args.tenant_config is None:
        return TenantConfig(default=flags)
    try:
        with open(args.tenant_config, "rb") as f:
            raw = orjson.loads(f.read())
    except OSError as e:
        raise ValueError(f"--tenant-config {args.tenant_config!r}: {e.strerror}") from None
    except orjson.JSONDecodeError as e:
        raise ValueError(f"--tenant-config {args.tenant_config!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or sorted(set(raw) - {"default", "tenants"}):
        raise ValueError(f"--tenant-config {args.tenant_config!r}: expected an object with 'default' and 'tenants'")
    default = _limits("default", raw.get("default", {}), flags)
    tenants = raw.get("tenants", {})
    if not isinstance(tenants, dict):
        raise ValueError("--tenant-config: 'tenants' must be an object of tenant name -> limits")
    limits, keys = {}, {}
    for name, spec in tenants.items():
        if not name or name == DEFAULT_TENANT:
            raise ValueError(f"--tenant-config: tenant name {name!r} is reserved or empty")
        limits[name] = _limits(f"tenants.{name}", spec, default)
        key = spec.get("api_key")
        if key is None:
            if args.tenant_header is None:
                raise ValueError(f"--tenant-config: tenants.{name} needs an api_key (or run with --tenant-header)")
            continue
        if not isinstance(key, str) or not key or "," in key:
            raise ValueError(f"--tenant-config: tenants.{name}.api_key must be a non-empty string without commas")
        if key in keys or key in args.api_keys:
            raise ValueError(f"--tenant-config: tenants.{name}.api_key is already another tenant's key")
        keys[key] = name
    return TenantConfig(default=default, limits=limits, keys=keys)


@dataclass
class _Bucket:
    """A minute's budget that refills continuously; `level` may go negative (debt)."""

    per_minute: float
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + (now - self.stamp) * self.per_minute / 60.0)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until the level reaches `amount`."""
        return max(0.0, (amount - self.level) * 60.0 / self.per_minute)


@dataclass
class TenantStats:
    requests: int = 0  # admitted
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LIMIT_FIELDS, 0))


class TenantLimiter:
    """Admission by tenant budgets (the HTTP process's, before a request reaches the scheduler)."""

    def __init__(self, config: TenantConfig, clock=time.monotonic):
        self.config = config
        self.clock = clock
        self.rpm: dict[str, _Bucket] = {}
        self.tpm: dict[str, _Bucket] = {}
        self.stats: dict[str, TenantStats] = {}

    def _bucket(self, table: dict[str, _Bucket], name: str, per_minute: float | None, now: float) -> _Bucket | None:
        if per_minute is None:
            return None
        b = table.get(name)
        if b is None:
            b = table[name] = _Bucket(per_minute, per_minute, now)
        b.refill(now)
        return b

    def admit(self, name: str, requests: int, prompt_tokens: int, in_flight: int) -> None:
        """Admit `requests` requests (n samples count each) of tenant `name` holding `prompt_tokens`,
        while `in_flight` of its requests run; raises RateLimited."""
        lim = self.config.limits_of(name)
        now = self.clock()
        stats = self.stats.setdefault(name, TenantStats())
        rpm = self._bucket(self.rpm, name, lim.rpm, now)
        tpm = self._bucket(self.tpm, name, lim.tpm, now)
        if lim.max_concurrency is not None and in_flight + requests > lim.max_concurrency:
            stats.rejected["max_concurrency"] += 1
            raise RateLimited(
                f"tenant {name!r} has {in_flight} requests in flight; its limit is {lim.max_concurrency} "
                f"concurrent requests (max_concurrency)",
                retry_after=1,
            )
        if rpm is not None and rpm.level < requests:
            stats.rejected["rpm"] += 1
            raise RateLimited(
                f"tenant {name!r} is over its budget of {lim.rpm:g} requests per minute (rpm)",
                retry_after=max(1, math.ceil(rpm.wait_for(requests))),
            )
        if tpm is not None and tpm.level <= 0:
            stats.rejected["tpm"] += 1
            raise RateLimited(
                f"tenant {name!r} is over its budget of {lim.tpm:g} tokens per minute (tpm): "
                f"{-tpm.level:.0f} tokens over",
                retry_after=max(1, math.ceil(tpm.wait_for(1))),
            )
        if rpm is not None:
            rpm.level -= requests
        if tpm is not None:
            tpm.level -= prompt_tokens
        stats.requests += requests
        stats.prompt_tokens += prompt_tokens

    def charge(self, name: str, completion_tokens: int) -> None:
        """A request of tenant `name` ended having generated `completion_tokens`."""
        stats = self.stats.setdefault(name, TenantStats())
        stats.completion_tokens += completion_tokens
        b = self.tpm.get(name)
        if b is not None:
            b.refill(self.clock())
            b.level -= completion_tokens

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per tenant: admitted requests, tokens, rejections by limit, and its limits."""
        out = {}
        for name, s in sorted(self.stats.items()):
            lim = self.config.limits_of(name)
            out[name] = {
                "requests": s.requests,
                "prompt_tokens": s.prompt_tokens,
                "completion_tokens": s.completion_tokens,
                "rejected": dict(s.rejected),
                "limits": {k: getattr(lim, k) for k in LIMIT_FIELDS},
            }
        return out

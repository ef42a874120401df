"""Modes, timeouts and addresses shared by the prefill and decode sides."""

from __future__ import annotations

import os
import socket
from enum import Enum


class DisaggregationMode(str, Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


TRANSFER_BACKENDS = ("mooncake", "fake")
FOLLOWER_KIND = "disagg"  # what a prefill server's rank 0 posts to its followers (a RankWrite)


def env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${name} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"${name} must be > 0 seconds, got {raw!r}")
    return value


def bootstrap_timeout() -> float:
    """How long a prefill request waits for its decode side to reserve KV (SGLang's variable)."""
    return env_seconds("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0)


def waiting_timeout() -> float:
    """How long a decode request waits for its KV to arrive (SGLang's variable)."""
    return env_seconds("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0)


# logged by every rank once its transfer endpoint, control channel and bootstrap registration are up
SETUP_DONE = "disaggregation set up"


def host_ip(bind_host: str) -> str:
    """The address peers reach this server's ranks at: $SGLANG_HOST_IP, else the address the HTTP
    server binds when it is a specific one, else the interface of the default route."""
    explicit = os.environ.get("SGLANG_HOST_IP")
    if explicit:
        return explicit
    if bind_host in ("localhost", "127.0.0.1"):
        return "127.0.0.1"
    if bind_host not in ("", "0.0.0.0", "::"):
        return bind_host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def free_tcp_port(ip: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]

"""The control channel between a prefill server's rank 0 and a decode server's rank 0: JSON
messages over ZeroMQ (each side binds a PULL socket; peers PUSH to it). KV itself moves over the
transfer engine (`transfer.py`), never over this channel.

decode -> prefill: `Prealloc` (the slots reserved for the room's prompt on every decode rank, and
where to answer) and `Abort`. prefill -> decode: `Done` (the first token and its logprobs) once
the KV is written, or `Failed`. A prefill server's follower ranks report their writes to its rank
0 over the same socket (`RankDone`). The messages and their JSON are in `messages.py`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import orjson
import zmq

from srt.disaggregation.messages import Malformed, MalformedMessage, Message, parse_message
from srt.disaggregation.transfer import KVEndpoint
from srt.managers.scheduler_component import SchedulerComponent

if TYPE_CHECKING:
    from srt.managers.schedule_batch import Req
    from srt.managers.scheduler_component import SchedulerPort

logger = logging.getLogger(__name__)

MAX_PEERS = 256  # cached PUSH sockets
POLL_MS = 5  # while requests wait on a peer: timeouts and lookups need a tick


class DisaggChannel(SchedulerComponent):
    """What both sides share: the PULL socket, PUSH sockets to peers, the KV endpoint, stats; and
    the scheduler hooks both sides take part in (a request with a bootstrap room goes to this
    side's queues instead of the waiting queue)."""

    name = "disaggregation"

    def __init__(self, scheduler: SchedulerPort, ip: str, endpoint: KVEndpoint):
        self.scheduler = scheduler
        self.kv = endpoint
        self.ctx = zmq.Context(1)
        self.recv_socket = self.ctx.socket(zmq.PULL)
        port = self.recv_socket.bind_to_random_port(f"tcp://{ip}")
        self.address = f"tcp://{ip}:{port}"
        self.peers: dict[str, zmq.Socket] = {}
        self.poll_every = 1  # scheduler loop iterations between polls of the queues
        self.iterations = 0
        # SGLang's transfer gauges: the latest transfer's speed and latency
        self.last_speed_gb_s = 0.0
        self.last_latency_ms = 0.0
        self.num_transfers = 0
        self.bytes_transferred = 0
        self.transfer_seconds = 0.0

    def send(self, address: str, msg: Message) -> None:
        """Best effort: a peer that is gone (or a bad address from a peer) is logged, never raised."""
        try:
            sock = self.peers.get(address)
            if sock is None:
                if not address.startswith("tcp://"):
                    raise zmq.ZMQError(msg=f"not a tcp:// address: {address!r}")
                if len(self.peers) >= MAX_PEERS:
                    self.peers.pop(next(iter(self.peers))).close(linger=0)
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.setsockopt(zmq.SNDHWM, 10000)
                try:
                    sock.connect(address)
                except zmq.ZMQError:
                    sock.close(linger=0)
                    raise
                self.peers[address] = sock
            sock.send(orjson.dumps(msg.to_json()), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("disaggregation: cannot send %s to %s: %s", msg.kind, address, e)

    def receive(self) -> list[Message | Malformed]:
        """The messages that arrived; one without a known type and a room is dropped here."""
        msgs: list[Message | Malformed] = []
        while True:
            try:
                raw = self.recv_socket.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                return msgs
            try:
                msgs.append(parse_message(orjson.loads(raw)))
            except (orjson.JSONDecodeError, MalformedMessage) as e:
                logger.warning("disaggregation: dropped a malformed control message (%d bytes): %s", len(raw), e)

    def note_transfer(self, nbytes: int, seconds: float) -> None:
        self.num_transfers += 1
        self.bytes_transferred += nbytes
        self.transfer_seconds += seconds
        self.last_latency_ms = seconds * 1e3
        self.last_speed_gb_s = nbytes / seconds / 1e9 if seconds > 0 else 0.0

    def due(self) -> bool:
        self.iterations += 1
        return self.iterations % self.poll_every == 0

    def end(self, req: Req, message: str, status_code: int | None = None) -> None:
        """Answer a request that leaves a disaggregation queue without running."""
        self.scheduler.fail_request(req, message, status_code)

    def sockets(self) -> list[zmq.Socket]:
        return [self.recv_socket]

    def wait_ms(self) -> int | None:
        return POLL_MS if self.pending() else None

    def transfer_state(self) -> dict:
        return {
            "control_address": self.address,
            "kv_transfer_speed_gb_s": self.last_speed_gb_s,
            "kv_transfer_latency_ms": self.last_latency_ms,
            "kv_transfers": self.num_transfers,
            "kv_transfer_bytes": self.bytes_transferred,
            "kv_transfer_seconds": self.transfer_seconds,
        }


def room_of(req: Req) -> int:
    assert req.bootstrap_room is not None, "only requests with a bootstrap_room take this path"
    return req.bootstrap_room


def now() -> float:
    return time.monotonic()

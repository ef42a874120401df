"""The data-parallel controller: one process between the tokenizer manager and N replicas.

Each replica is a whole scheduler group (its own tensor-parallel ranks, KV pool and prefix cache).
Generation requests go to one replica, chosen by `--load-balance-method`; aborts and control
requests go to all (the tokenizer manager collects one answer per replica). Replicas report their
load when it changes; the controller adds the requests it sent since a replica's last report, so a
burst does not all land on the replica that looked idle a moment ago.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import traceback
from array import array
from collections import OrderedDict

import zmq

from srt.managers.io_struct import FlushCacheReq, LoadReport, TokenizedGenerateReqInput
from srt.server_args import PortArgs, ServerArgs
from srt.utils import start_child_process, zmq_socket

logger = logging.getLogger(__name__)

BLOCK_TOKENS = 16  # the cache-aware policy tracks prefixes in blocks of this many tokens
CACHE_HIT_THRESHOLD = 0.5  # share of the prompt a replica must hold to win on cache alone
BALANCE_ABS_THRESHOLD = 8  # requests; a busier cached replica is skipped beyond this gap...
BALANCE_REL_THRESHOLD = 1.5  # ...when it also holds this many times the least-loaded one's requests


def prefix_block_hashes(input_ids: list[int], extra_key: str | None) -> list[bytes]:
    """One digest per whole block, each covering the prompt up to that block's end (and the cache
    namespace): two prompts share the first k digests exactly when they share k blocks."""
    h = hashlib.blake2b(str(extra_key).encode(), digest_size=16)
    out = []
    for end in range(BLOCK_TOKENS, len(input_ids) + 1, BLOCK_TOKENS):
        h.update(array("q", input_ids[end - BLOCK_TOKENS : end]).tobytes())
        out.append(h.copy().digest())
    return out


class ApproxPrefixCache:
    """What one replica's prefix cache probably holds: the prefix blocks of the prompts sent to it,
    least recently used dropped first beyond `capacity_blocks` (the replica's KV pool)."""

    def __init__(self, capacity_blocks: int):
        self.capacity = max(1, capacity_blocks)
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def match(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def insert(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class LoadBalancer:
    """Picks the replica for each request. `loads[i]` is replica i's estimated request count."""

    def __init__(self, method: str, dp_size: int, kv_capacity_tokens: int):
        self.method, self.dp_size = method, dp_size
        self.next = 0
        self.caches = [ApproxPrefixCache(kv_capacity_tokens // BLOCK_TOKENS) for _ in range(dp_size)]
        self.routed_by_cache = 0

    def choose(self, input_ids: list[int], extra_key: str | None, loads: list[int]) -> int:
        if self.method == "round_robin":
            choice, self.next = self.next, (self.next + 1) % self.dp_size
            return choice
        least = self._least_loaded(loads)
        if self.method == "shortest_queue":
            return least
        hashes = prefix_block_hashes(input_ids, extra_key)
        matches = [c.match(hashes) for c in self.caches]
        best = max(range(self.dp_size), key=lambda i: (matches[i], -loads[i]))
        cached = matches[best] * BLOCK_TOKENS
        overloaded = (
            loads[best] - loads[least] > BALANCE_ABS_THRESHOLD and loads[best] > BALANCE_REL_THRESHOLD * loads[least]
        )
        if matches[best] and cached >= CACHE_HIT_THRESHOLD * len(input_ids) and not overloaded:
            choice = best
            self.routed_by_cache += 1
        else:
            choice = least
        self.caches[choice].insert(hashes)
        return choice

    def forget_caches(self) -> None:
        for c in self.caches:
            c.blocks.clear()

    def _least_loaded(self, loads: list[int]) -> int:
        """The least-loaded replica; ties rotate, so an idle server spreads a burst evenly."""
        low = min(loads)
        tied = [i for i in range(self.dp_size) if loads[i] == low]
        choice = min(tied, key=lambda i: (i - self.next) % self.dp_size)
        self.next = (choice + 1) % self.dp_size
        return choice


class DataParallelController:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, kv_capacity_tokens: int):
        self.dp_size = server_args.dp_size
        self.balancer = LoadBalancer(server_args.load_balance_method, self.dp_size, kv_capacity_tokens)
        ctx = zmq.Context(2)
        self.recv_from_tokenizer = zmq_socket(ctx, zmq.PULL, port_args.scheduler_input, bind=True)
        self.recv_load = zmq_socket(ctx, zmq.PULL, port_args.controller_input, bind=True)
        self.replicas = [
            zmq_socket(ctx, zmq.PUSH, port_args.replica_input(d, self.dp_size), bind=False) for d in range(self.dp_size)
        ]
        self.reports = [
            LoadReport(dp_rank=d, num_reqs=0, num_waiting_reqs=0, num_used_tokens=0, num_received=0)
            for d in range(self.dp_size)
        ]
        self.dispatched = [0] * self.dp_size

    def loads(self) -> list[int]:
        return [r.num_reqs + self.dispatched[d] - r.num_received for d, r in enumerate(self.reports)]

    def event_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.recv_from_tokenizer, zmq.POLLIN)
        poller.register(self.recv_load, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            # Load first: the freshest reports before routing what just arrived.
            while self.recv_load in ready:
                try:
                    report = self.recv_load.recv_pyobj(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.reports[report.dp_rank] = report
            while self.recv_from_tokenizer in ready:
                try:
                    msg = self.recv_from_tokenizer.recv_pyobj(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.dispatch(msg)

    def dispatch(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            d = msg.data_parallel_rank
            if d is None:
                d = self.balancer.choose(msg.input_ids, msg.extra_key, self.loads())
            self.dispatched[d] += 1
            self.replicas[d].send_pyobj(msg)
        else:  # aborts and control requests: every replica acts on (and answers) them
            if isinstance(msg, FlushCacheReq) and not msg.storage:
                self.balancer.forget_caches()
            for sock in self.replicas:
                sock.send_pyobj(msg)


def run_data_parallel_controller_process(
    server_args: ServerArgs, port_args: PortArgs, kv_capacity_tokens: int, pipe_writer
) -> None:
    controller = start_child_process(
        pipe_writer,
        server_args.log_level,
        " DP controller",
        lambda: DataParallelController(server_args, port_args, kv_capacity_tokens),
    )
    try:
        controller.event_loop()
    except Exception:
        logger.error("the data-parallel controller crashed:\n%s", traceback.format_exc())
        sys.exit(1)

"""The scheduler process of one tensor-parallel rank: continuous batching with RadixAttention.

Loop: receive requests -> pick the next batch (a prefill of waiting requests if budgets allow,
else a decode step of the running ones) -> run it -> process the results and stream them to the
detokenizer. Admission lives in PrefillAdder, caching in the prefix cache, batch tensors in
BatchBuilder; this class only orchestrates.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING

import zmq

from srt.configs.model_config import ModelConfig
from srt.hf_transformers_utils import get_tokenizer
from srt.managers.io_struct import (
    FINISH_ABORT,
    FINISH_LENGTH,
    AbortReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    LoadReport,
    ProfileReq,
    TokenizedGenerateReqInput,
)
from srt.managers.profiler import ForwardProfiler
from srt.managers.schedule_batch import BatchBuilder, Req, ScheduleBatch
from srt.managers.schedule_policy import (
    CLIP_MAX_NEW_TOKENS,
    AddReqResult,
    InBatchPrefixes,
    PrefillAdder,
    SchedulePolicy,
)
from srt.managers.scheduler_component import DecodeStrategy, NewRequest, RequestRejected, SchedulerComponent
from srt.managers.scheduler_guard import SchedulerGuardMixin
from srt.managers.scheduler_output import SchedulerOutputProcessorMixin
from srt.managers.tp_worker import BatchResult, TpModelWorker
from srt.managers.tp_worker_overlap_thread import OverlapTpModelWorker
from srt.mem_cache.base_prefix_cache import BasePrefixCache
from srt.metrics.collector import SchedulerMetrics
from srt.model_executor.forward_batch_info import ForwardMode
from srt.model_executor.static_batch import StaticBatchGenerator
from srt.sampling.sampling_params import SamplingParams
from srt.utils import zmq_socket

if TYPE_CHECKING:
    from srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
IDLE_POLL_MS = 1000


class IntegrityError(RuntimeError):
    pass


class Scheduler(SchedulerOutputProcessorMixin, SchedulerGuardMixin):
    """The core: it owns the request lifecycle and calls its components (features) at fixed hooks;
    the composition root (`srt/managers/scheduler_process.py`) builds them."""

    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        tp_worker: TpModelWorker,
        tree_cache: BasePrefixCache,
        tp_rank: int = 0,
        dp_rank: int = 0,
    ):
        self.server_args = server_args
        self.tp_rank, self.dp_rank = tp_rank, dp_rank
        self.tp_worker = tp_worker
        runner = self.tp_worker.model_runner
        self.runner = runner
        self.model_config: ModelConfig = runner.model_config
        assert server_args.model_path is not None, "launch_subprocesses resolves the model path"
        self.tokenizer = get_tokenizer(server_args.tokenizer_path or server_args.model_path)
        self.eos_token_ids = self.model_config.eos_token_ids
        self.max_running_requests = runner.max_running_requests
        self.tree_cache = tree_cache
        self.allocator = runner.token_to_kv_pool_allocator
        self.builder = BatchBuilder(
            runner.req_to_token_pool, self.allocator, self.tree_cache, self.tp_worker.future_map, runner.device
        )
        self.overlap = server_args.overlap_schedule_enabled(runner.device)
        if runner.device == "cpu" and not self.overlap and not server_args.disable_overlap_schedule:
            logger.info(
                "Overlap schedule off on CPU: the forward already uses every core, and a worker thread "
                "sharing them (and the GIL) makes decoding slower; --enable-overlap-schedule forces it"
            )
        self.overlap_worker = OverlapTpModelWorker(self.tp_worker) if self.overlap else None
        self.tp_worker.future_map.live = self.overlap  # only its batches feed tokens still being sampled
        # readable when a message waits on the request socket (set when it opens): a continuous decode
        # call ends there. Not with the overlap scheduler, whose next batch is built on the call's steps.
        self.interrupt_fd = -1
        self.pending: deque[tuple[ScheduleBatch, Future]] = deque()  # launched, results not processed
        self.last_prefill: ScheduleBatch | None = None
        self.policy = SchedulePolicy(server_args.schedule_policy, self.tree_cache, not server_args.disable_radix_cache)
        self.metrics = SchedulerMetrics() if server_args.enable_metrics else None
        self.chunked_prefill_size = server_args.chunked_prefill_size if server_args.chunked_prefill_size > 0 else None
        self.waiting_queue: list[Req] = []
        self.running_batch = ScheduleBatch([])
        self.chunked_req: Req | None = None
        # --schedule-conservativeness (SGLang's): the share of a running request's remaining tokens that
        # admission keeps room for starts at init and decays to min over 600 steps without retraction
        c = server_args.schedule_conservativeness
        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * c, 1.0)
        self.min_new_token_ratio = min(MIN_NEW_TOKEN_RATIO * c, 1.0)
        self.new_token_ratio_decay = (
            self.init_new_token_ratio - self.min_new_token_ratio
        ) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio
        self.checked_idle = False
        self.init_stats()
        self.init_guard()
        # set by the composition root before the loop starts
        self.components: list[SchedulerComponent] = []
        self.decoder = DecodeStrategy()
        broadcaster = self.tp_worker.broadcaster
        self.profiler = ForwardProfiler(
            tp_rank,
            dp_rank,
            server_args.dp_size,
            (lambda req: broadcaster.post("profile", req)) if broadcaster is not None else None,
        )
        self.port_args = port_args
        self.num_received = 0
        self.last_load: tuple | None = None

    def add_components(self, components: list[SchedulerComponent], decoder: DecodeStrategy) -> None:
        self.components = components
        self.decoder = decoder

    def open_sockets(self) -> None:
        """After warm-up: the tokenizer manager sends requests once the scheduler reports ready."""
        server_args, port_args, dp_rank = self.server_args, self.port_args, self.dp_rank
        ctx = zmq.Context(2)
        self.recv_from_tokenizer = zmq_socket(
            ctx, zmq.PULL, port_args.replica_input(dp_rank, server_args.dp_size), bind=True
        )
        self.send_to_detokenizer = zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_input, bind=False)
        self.send_to_tokenizer = zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_input, bind=False)
        # new requests, or a component's messages (a disaggregation peer), wake an idle loop
        self.poller = zmq.Poller()
        self.poller.register(self.recv_from_tokenizer, zmq.POLLIN)
        if not self.overlap:
            self.interrupt_fd = int(self.recv_from_tokenizer.getsockopt(zmq.FD))
        for c in self.components:
            for sock in c.sockets():
                self.poller.register(sock, zmq.POLLIN)
        # With --dp-size, the controller routes by each replica's load: report it when it changes.
        self.send_to_controller = (
            zmq_socket(ctx, zmq.PUSH, port_args.controller_input, bind=False) if server_args.dp_size > 1 else None
        )

    def warmup(self) -> None:
        """One tiny prefill and decode, so lazy initialization does not land on the first request."""
        if not self.runner.generates:
            return  # an encoder: the pooling component warms it up
        start = time.perf_counter()
        StaticBatchGenerator(self.runner, self.tp_worker.forward).generate(
            [[0, 1, 2, 3, 4, 5, 6, 7]], SamplingParams(max_new_tokens=3)
        )
        logger.info("Warm-up forward passes took %.2f s", time.perf_counter() - start)

    def ready_info(self) -> dict:
        return {
            "max_total_num_tokens": self.runner.max_total_num_tokens,
            # the KV cache as allocated: stored format (auto resolved) and bytes per token on this rank
            "kv_cache_dtype": self.runner.kv_format,
            "kv_cache_bytes_per_token": self.runner.kv_bytes_per_token,
            # "mla": one latent row per token and layer (DeepSeek); "mha": K and V per KV head
            "kv_cache_layout": "mla" if self.model_config.is_mla else "mha",
            "max_running_requests": self.max_running_requests,
            "context_len": self.model_config.context_len,
            # False: an encoder, served for pooling only (embeddings, scores); no generation
            "is_generation": self.runner.generates,
            "vocab_size": self.model_config.vocab_size,
            # what prompts may carry besides text (a vision-language model: images)
            "modalities": list(getattr(self.runner.model, "modalities", ("text",))),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "device": self.runner.device,
            # the weights as loaded: method (resolved from --quantization), format per layer type,
            # bytes resident on this rank, and the CPU kernel variant multiplying them
            "quantization": self.runner.weight_report["quantization"],
            "weight_formats": self.runner.weight_report["formats"],
            "weight_bytes": self.runner.weight_report["weight_bytes"],
            "kernel_isa": self.runner.weight_report["kernel_isa"],
        }

    # -- loop ----------------------------------------------------------------------------------

    def event_loop(self) -> None:
        (self.event_loop_overlap if self.overlap else self.event_loop_normal)()

    def event_loop_normal(self) -> None:
        while True:
            self.heartbeat()
            self.report_load()
            self.process_input_requests(self.recv_requests())
            self.poll_components()
            batch = self.get_next_batch_to_run()
            if batch is None:
                self.on_idle()
                continue
            self.checked_idle = False
            fb, slots = self.builder.build(batch, self.model_config.vocab_size, self.eos_token_ids)
            self.before_forward()
            self.process_batch_result(batch, self.timed(self.tp_worker.run(fb, slots)))

    def event_loop_overlap(self) -> None:
        """Launch batch N on the worker thread, then process batch N-1's results while N runs."""
        assert self.overlap_worker is not None
        while True:
            self.heartbeat()
            self.report_load()
            self.process_input_requests(self.recv_requests())
            self.poll_components()
            batch = self.get_next_batch_to_run()
            if batch is not None:
                self.checked_idle = False
                fb, slots = self.builder.build(batch, self.model_config.vocab_size, self.eos_token_ids)
                self.before_forward()
                self.pending.append((batch, self.overlap_worker.launch(fb, slots)))
            while len(self.pending) > (1 if batch is not None else 0):
                self.process_oldest_pending()
            if batch is None and not self.pending:
                self.on_idle()

    def poll_components(self) -> None:
        self.expire_deadlines()
        for c in self.components:
            c.poll()

    def process_oldest_pending(self) -> None:
        batch, future = self.pending.popleft()
        self.process_batch_result(batch, self.timed(future.result()))

    def sync_pending(self) -> None:
        """Process every launched batch: needed before a decision that must see their tokens."""
        while self.pending:
            self.process_oldest_pending()

    def has_runnable_work(self) -> bool:
        launched = self.last_prefill.reqs if self.last_prefill is not None else []
        return bool(
            self.waiting_queue
            or self.chunked_req
            or self.pending
            or any(not r.finished for r in self.running_batch.reqs + launched)
        )

    def has_work(self) -> bool:
        return any(c.pending() for c in self.components) or self.has_runnable_work()

    def recv_requests(self) -> list:
        msgs = []
        wait_ms = 0
        # idle, paused, or only components' work pending: block briefly instead of spinning
        if not self.has_runnable_work() or self.batches_held():
            wait_ms = min([IDLE_POLL_MS] + [ms for c in self.components if (ms := c.wait_ms()) is not None])
        if wait_ms and self.recv_from_tokenizer not in dict(self.poller.poll(wait_ms)):
            return msgs
        # (asking the socket first: a failed non-blocking recv raises, and building that exception was
        # a visible part of a batch-1 CPU decode step's Python)
        while int(self.recv_from_tokenizer.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                msgs.append(self.recv_from_tokenizer.recv_pyobj(zmq.NOBLOCK))
            except zmq.ZMQError:
                break
        return msgs

    def process_input_requests(self, msgs: list) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReqInput):
                self.handle_generate_request(msg)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg)
            elif isinstance(msg, GetInternalStateReq):
                self.reply(GetInternalStateReqOutput(rid=msg.rid, state=self.internal_state()))
            elif isinstance(msg, ProfileReq):
                self.reply(self.profiler.handle(msg, self.forward_passes))
            elif any(c.handle_message(msg) for c in self.components):
                continue
            elif isinstance(msg, FlushCacheReq):
                self.reply(self.flush_cache(msg))
            else:
                logger.error("scheduler got an unknown message %r", type(msg))

    def reply(self, out) -> None:
        """An answer to the tokenizer manager's control message."""
        self.send_to_tokenizer.send_pyobj(out)

    def report_load(self) -> None:
        if self.send_to_controller is None:
            return
        load = self.load()
        if load != self.last_load:
            self.last_load = load
            num_reqs, num_waiting_reqs, num_used_tokens, num_received = load
            self.send_to_controller.send_pyobj(
                LoadReport(
                    dp_rank=self.dp_rank,
                    num_reqs=num_reqs,
                    num_waiting_reqs=num_waiting_reqs,
                    num_used_tokens=num_used_tokens,
                    num_received=num_received,
                )
            )

    def load(self) -> tuple[int, int, int, int]:
        """(requests held, of which waiting, KV tokens in use, requests received so far)."""
        running = len(self.running_batch.reqs) + (1 if self.chunked_req else 0)
        waiting = len(self.waiting_queue) + len(self.held_reqs())
        return running + waiting, waiting, self.used_tokens(), self.num_received

    def used_tokens(self) -> int:
        return self.allocator.size - self.allocator.available_size() - self.tree_cache.evictable_size()

    def handle_generate_request(self, recv: TokenizedGenerateReqInput) -> None:
        self.num_received += 1
        req = Req(
            rid=recv.rid,
            origin_input_ids=recv.input_ids,
            sampling_params=recv.sampling_params,
            return_logprob=recv.return_logprob,
            logprob_start_len=recv.logprob_start_len,
            top_logprobs_num=recv.top_logprobs_num,
            token_ids_logprob=recv.token_ids_logprob,
            stream=recv.stream,
            priority=recv.priority,
            tenant=recv.tenant,
            extra_key=recv.extra_key,
            created_time=recv.created_time,
            timeout=recv.timeout,
            bootstrap_host=recv.bootstrap_host,
            bootstrap_port=recv.bootstrap_port,
            bootstrap_room=recv.bootstrap_room,
            mm_items=recv.mm_items,
        )
        self.track_deadline(req)
        try:
            for c in self.components:
                c.on_new_request(req, recv)
        except RequestRejected as e:
            self.fail_request(req, str(e), e.status_code)
            return
        for c in self.components:
            if c.on_accepted(req) is NewRequest.HELD:
                return
        self.enqueue(req)

    def enqueue(self, req: Req) -> None:
        """A new request is ready to run: to a component that takes it (a disaggregation queue), else
        to the waiting queue."""
        if not any(c.on_ready(req) for c in self.components):
            self.waiting_queue.append(req)

    def add_waiting(self, req: Req) -> None:
        self.waiting_queue.append(req)

    def fail_request(self, req: Req, message: str, status_code: int | None = 400) -> None:
        """A request that cannot run as asked: it ends before any token (HTTP 400 by default)."""
        req.finished_reason = FINISH_ABORT(message=message, status_code=status_code)
        self.stream_output([req])

    def abort_request(self, recv: AbortReq) -> None:
        def hit(r: Req) -> bool:
            return recv.abort_all or r.rid == recv.rid

        for r in [r for r in self.waiting_queue if hit(r)]:
            self.waiting_queue.remove(r)
            r.finished_reason = FINISH_ABORT(message=recv.message)
            self.stream_output([r])
        for r in self.running_reqs() + self.held_reqs():
            if hit(r) and not r.finished:
                r.to_abort = recv.message  # a component's queue ends it on its next poll

    # -- batch selection -------------------------------------------------------------------------

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        if self.last_prefill is not None:
            # Requests whose prompt is complete join the decode batch, even before their prefill
            # results are processed (their first token is then a future-map placeholder).
            self.running_batch.reqs.extend(
                r
                for r in self.last_prefill.reqs
                if not r.finished and r is not self.chunked_req and self.leaving_component(r) is None
            )
            self.last_prefill = None
        if any(r.future_slot is not None and r.needs_fresh_history for r in self.running_batch.reqs):
            self.sync_pending()
        self.running_batch.filter_finished()
        if self.batches_held():
            return None
        batch = self.get_new_batch_prefill()
        if batch is not None:
            self.last_prefill = batch
            return batch
        if self.running_batch.reqs:
            self.update_running_batch()
            if self.running_batch.reqs:
                return self.decoder.plan(list(self.running_batch.reqs))
        return None

    def batches_held(self) -> bool:
        return any(c.holds_batches() for c in self.components)

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        if self.chunked_req is not None:
            self.sync_pending()  # its next chunk starts from the KV the previous chunk committed
        running = len(self.running_batch.reqs) + (1 if self.chunked_req else 0)
        running += sum(c.num_holding_kv() for c in self.components)
        self.order_waiting()
        if running >= self.max_running_requests and self.chunked_req is None:
            if self.waiting_queue:
                self.preempt_for(self.waiting_queue[0], 0)
            return None
        adder = PrefillAdder(
            self.tree_cache,
            self.allocator,
            self.running_batch.reqs,
            self.new_token_ratio,
            self.server_args.max_prefill_tokens,
            self.chunked_prefill_size,
            self.max_running_requests - running,
        )
        if self.chunked_req is not None and adder.add_chunked_req(self.chunked_req) is AddReqResult.ADMITTED:
            self.chunked_req = None  # its last chunk runs in this batch
        admitted, failed = [], []
        blocked: tuple[Req, int] | None = None  # the first request the running ones left no room for
        in_batch = InBatchPrefixes() if self.policy.radix_enabled else None
        # Only one request is chunked at a time: while one continues, nothing new starts.
        if self.chunked_req is None:
            for c in self.components:
                c.begin_admission()
            for req in self.waiting_queue:
                error = self.component_admission(req)
                if error is not None:
                    if error:
                        failed.append((req, error))
                    continue
                req.match_prefix(self.tree_cache)  # fresh: the tree changes between rounds
                for c in self.components:
                    c.after_match(req)
                if in_batch is not None and in_batch.defer(req):
                    continue
                result = adder.add_one_req(req)
                if result.admitted:
                    admitted.append(req)
                    if in_batch is not None:
                        in_batch.add(req)
                if result is AddReqResult.NO_ROOM:
                    blocked = (req, adder.shortfall)
                elif result is AddReqResult.STOP and adder.rem_running_slots <= 0:
                    blocked = (req, 0)
                if result is not AddReqResult.ADMITTED:
                    break
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        for req, message in failed:
            self.waiting_queue.remove(req)
            self.fail_request(req, message)
        if blocked is not None:
            self.preempt_for(*blocked)
        if not adder.can_run:
            return None
        admitted_set = set(map(id, admitted))
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted_set]
        for r in admitted:
            if not r.admitted:
                self.note_cached_tokens(r)
                r.admitted = True
                if self.metrics is not None:
                    self.metrics.on_admitted(r)
                for c in self.components:
                    c.on_admitted(r)
        self.log_prefill_stats(adder.can_run, running)
        return ScheduleBatch(adder.can_run, ForwardMode.EXTEND)

    def order_waiting(self) -> None:
        """The waiting queue in admission order: --schedule-policy's, then the components' (priorities)."""
        self.policy.calc_priority(self.waiting_queue)
        for c in self.components:
            c.order_waiting(self.waiting_queue)

    def preempt_for(self, req: Req, shortfall: int) -> None:
        """req cannot be admitted for lack of room the running requests hold: the components may
        name running requests to preempt for it (retracted like under KV pressure; the next round
        admits req)."""
        candidates = [r for r in self.running_batch.reqs if not r.finished and r.to_abort is None]
        victims = [v for c in self.components for v in c.victims_for(req, candidates, shortfall)]
        if not victims:
            return
        self.sync_pending()  # retraction needs the victims' tokens on the host
        victims = [v for v in dict.fromkeys(victims) if v in self.running_batch.reqs and not v.finished]
        self.running_batch.reqs = [r for r in self.running_batch.reqs if r not in victims]
        for v in victims:
            self.park(v, retraction=True)
        self.waiting_queue[:0] = victims
        self.total_retractions += len(victims)
        logger.info("preempted %d request(s) for request %s", len(victims), req.rid)

    def component_admission(self, req: Req) -> str | None:
        """None: the components let req into this round; "": one makes it wait; else why it fails."""
        for c in self.components:
            verdict = c.admit(req)
            if not verdict.ok:
                return verdict.error or ""
        return None

    def running_reqs(self) -> list[Req]:
        launched = self.last_prefill.reqs if self.last_prefill is not None else []  # not yet in the running batch
        chunked = [self.chunked_req] if self.chunked_req is not None else []
        return self.running_batch.reqs + launched + chunked

    def held_reqs(self) -> list[Req]:
        return [r for c in self.components for r in c.queued_reqs()]

    def wait_launched(self) -> None:
        """Before slots are written from outside the forward sequence (a load back, a prefill
        server's KV write): with the overlap schedule a launched batch may still be writing a slot
        that was just freed (the dropped step of a request that finished) and that the write would
        reuse, so let launched batches finish (their results are processed later, as usual)."""
        for _, launched in self.pending:
            launched.result()

    def note_cached_tokens(self, req: Req) -> None:
        """At first admission: the prompt tokens served from cache, and from which tier."""
        total = len(req.prefix_indices)
        host = min(req.loaded_from_host, total)
        op = req.prefetch_op
        storage = min(op.new_tokens if op is not None else 0, host)
        req.cached_tokens = total
        req.cached_tokens_details = (total - host, host - storage, storage)

    def update_running_batch(self) -> None:
        """Make sure the next decode step has KV room: evict cache, then retract requests."""
        batch = self.running_batch
        needed = self.builder.decode_slots_needed(batch.reqs)
        if self.allocator.available_size() + self.tree_cache.evictable_size() >= needed:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
            return
        # Retraction needs every request's tokens: finish processing launched batches first.
        self.sync_pending()
        batch.filter_finished()
        # Retract the requests that generated the fewest tokens (cheapest to redo).
        batch.reqs.sort(key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
        retracted = []
        while batch.reqs and (
            self.allocator.available_size() + self.tree_cache.evictable_size()
            < self.builder.decode_slots_needed(batch.reqs)
        ):
            req = batch.reqs.pop()
            self.park(req, retraction=True)
            retracted.append(req)
        self.waiting_queue[:0] = retracted
        self.total_retractions += len(retracted)
        decoded = sum(len(r.output_ids) for r in batch.reqs)
        budget = sum(min(r.max_new_tokens or CLIP_MAX_NEW_TOKENS, CLIP_MAX_NEW_TOKENS) for r in batch.reqs)
        self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(batch.reqs)) / max(budget, 1))
        logger.warning(
            "KV cache full: retracted %d request(s); new_token_ratio %.2f", len(retracted), self.new_token_ratio
        )

    # -- running ---------------------------------------------------------------------------------

    def process_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        self.decoder.on_batch_result(batch, result)
        if batch.forward_mode.is_extend():
            self.process_prefill_result(batch, result)
        else:  # decode, or a verify of draft trees (as decode rows or TARGET_VERIFY)
            self.process_decode_result(batch, result)

    def process_prefill_result(self, batch: ScheduleBatch, res: BatchResult) -> None:
        assert batch.kv_ends is not None and batch.future_slots is not None, "set when the batch was launched"
        progressed = []
        for i, req in enumerate(batch.reqs):
            if req.finished:
                continue
            chunk_end = batch.kv_ends[i]
            if res.input_logprobs is not None:
                self.append_input_logprobs(req, res.input_logprobs[i], chunk_end)
            if res.last_hidden is not None and req.return_last_hidden:
                req.last_hidden = res.last_hidden[i]
            if chunk_end < req.seq_len and req.to_abort is None:  # more chunks to come
                self.tree_cache.cache_unfinished_req(req)
                continue
            progressed.append(req)
            req.input_logprobs_done = True
            if req.to_abort is None and req.max_new_tokens == 0:
                req.finished_reason = FINISH_LENGTH(length=0)
            elif req.to_abort is None:
                self.append_token(req, res.next_token_ids[i], res, i)
            self.take_future_slot(req, batch.future_slots[i])
            req.check_finished(self.eos_token_ids, self.model_config.context_len, self.tokenizer)
            if (leaving := self.leaving_component(req)) is not None:  # e.g. its KV goes to a decode server
                progressed.pop()
                if req is self.chunked_req:
                    self.chunked_req = None
                leaving.take_after_prefill(req)
            elif req.finished:
                if req is self.chunked_req:
                    self.chunked_req = None
                self.release(req)
            elif req.kv_committed_len == req.kv_len and req.to_abort is None:
                # Its prompt is shareable while it decodes (no step of it is in flight yet).
                self.tree_cache.cache_unfinished_req(req)
        self.stream_output(progressed)

    def leaving_component(self, req: Req) -> SchedulerComponent | None:
        """The component that takes req after its prefill (it does not decode here), if any."""
        for c in self.components:
            if c.leaves_after_prefill(req):
                return c
        return None

    def process_decode_result(self, batch: ScheduleBatch, res: BatchResult) -> None:
        """Each request's new tokens: its sampled one, or with speculative decoding the samples
        along its accepted draft path (see `DecodeStrategy.accepted`). The stop conditions, and a
        component's forced tokens (a grammar's jump forward), apply after each token in order as
        they would in decoding; the tokens after are dropped with their KV."""
        assert batch.future_slots is not None and batch.kv_ends is not None, "set when the batch was launched"
        progressed, generated, row = [], 0, 0
        for i, req in enumerate(batch.reqs):
            start, row = row, row + self.decoder.width(batch, i)
            if req.finished:
                continue  # finished in the previous step's results: this step's tokens are dropped
            progressed.append(req)
            path = self.decoder.accepted(batch, i, res.next_token_ids[start:row])
            self.take_future_slot(req, batch.future_slots[i])
            kept, forced = 0, None
            for node in path:
                self.append_token(req, res.next_token_ids[start + node], res, start + node)
                kept += 1
                req.check_finished(self.eos_token_ids, self.model_config.context_len, self.tokenizer)
                if req.finished:
                    break
                if forced := self.forced_tokens(req):
                    break
            generated += kept
            self.decoder.after_request(batch, i, req, path, kept)
            if req.finished:
                self.release(req)
            elif forced:
                self.jump(req, forced)
        self.decoder.after_step(batch, len(progressed), generated)
        self.stream_output(progressed)
        self.num_generated_tokens += generated
        self.total_generated_tokens += generated
        self.maybe_log_decode_stats()

    def forced_tokens(self, req: Req) -> list[int] | None:
        for c in self.components:
            if forced := c.forced_tokens(req):
                return forced
        return None

    def jump(self, req: Req, extra: list[int]) -> None:
        """Append tokens req must produce anyway, then requeue it: one extend computes their KV."""
        req.output_ids.extend(extra)
        if req in self.running_batch.reqs:  # defensive: a decode result's request is normally still running
            self.running_batch.reqs.remove(req)
        self.park(req, retraction=False)
        self.waiting_queue.insert(0, req)

    def sync_launched(self) -> None:
        self.sync_pending()

    def retract_running(self) -> list[Req]:
        self.sync_pending()
        if self.last_prefill is not None:  # launched prefills whose requests have not joined the running batch
            self.running_batch.reqs.extend(r for r in self.last_prefill.reqs if r not in self.running_batch.reqs)
            self.last_prefill = None
        if self.chunked_req is not None:
            if self.chunked_req not in self.running_batch.reqs:
                self.running_batch.reqs.append(self.chunked_req)
            self.chunked_req = None
        self.running_batch.filter_finished()
        retracted, self.running_batch.reqs = self.running_batch.reqs, []
        for req in retracted:
            self.park(req, retraction=True)
        self.waiting_queue[:0] = retracted
        self.total_retractions += len(retracted)
        return retracted

    def abort_all(self, message: str) -> None:
        self.abort_request(AbortReq(abort_all=True, message=message))

    def park(self, req: Req, retraction: bool) -> None:
        """Take a running request off the device: its computed KV goes into the prefix cache, which
        its next prefill matches, so only the tokens without KV are computed again."""
        self.tree_cache.cache_finished_req(req)
        for c in self.components:
            c.on_release(req)
        req.reset_for_retract(count=retraction)

    @staticmethod
    def take_future_slot(req: Req, slot: int) -> None:
        """The token is on the host now; a later launch may already have given req a new slot."""
        if req.future_slot == slot:
            req.future_slot = None

    def join_decoding(self, req: Req, first: BatchResult) -> None:
        """req's prompt KV arrived with its first token (and that token's logprobs): it continues
        exactly as if it had been prefilled here."""
        if self.metrics is not None:
            self.metrics.on_admitted(req)
        req.admitted = req.input_logprobs_done = True  # prompt logprobs come from the prefill server
        self.append_token(req, first.next_token_ids[0], first, 0)
        req.check_finished(self.eos_token_ids, self.model_config.context_len, self.tokenizer)
        if req.finished:
            self.release(req)
        else:
            self.tree_cache.cache_unfinished_req(req)  # its prompt is shareable while it decodes
            self.running_batch.reqs.append(req)
        self.stream_output([req])

    def live_reqs(self) -> list[Req]:
        return self.waiting_queue + self.running_reqs()

    def stream_output(self, reqs: list[Req]) -> None:
        for c in self.components:
            c.on_output(reqs)
        super().stream_output(reqs)

    def release(self, req: Req) -> None:
        self.tree_cache.cache_finished_req(req)
        for c in self.components:
            c.on_release(req)

    # -- idle, integrity, control ----------------------------------------------------------------

    def on_idle(self) -> None:
        self.tp_worker.keepalive()  # the other tensor-parallel ranks wait for work
        self.new_token_ratio = self.init_new_token_ratio
        if self.metrics is not None:
            self.metrics.gen_throughput = 0.0
        for c in self.components:
            c.on_idle()
        self.last_forward_end = None  # a gap while idle is not the scheduler's overhead
        if not self.checked_idle and not self.has_work():
            self.checked_idle = True
            self.check_integrity()

    def check_integrity(self) -> None:
        total = self.allocator.available_size() + self.tree_cache.evictable_size() + self.tree_cache.protected_size()
        slots = self.runner.req_to_token_pool
        problems = []
        if total != self.allocator.size:
            problems.append(
                f"KV slots: free {self.allocator.available_size()} + evictable "
                f"{self.tree_cache.evictable_size()} + protected {self.tree_cache.protected_size()} "
                f"!= capacity {self.allocator.size}"
            )
        locked = sum(c.locked_tokens() for c in self.components)
        if self.tree_cache.protected_size() != locked:
            problems.append(
                f"{self.tree_cache.protected_size()} cached tokens locked while idle, {locked} by components"
            )
        if slots.available_size() != slots.size:
            problems.append(f"request slots: {slots.size - slots.available_size()} still held while idle")
        for c in self.components:
            problems += c.integrity_problems()
        problems += self.tree_cache.integrity_problems()
        self.integrity_ok = not problems
        if problems:
            msg = "KV pool integrity violated: " + "; ".join(problems)
            logger.error(msg)
            if self.server_args.debug_integrity_check:
                raise IntegrityError(msg)

    def flush_cache(self, recv: FlushCacheReq) -> FlushCacheReqOutput:
        if recv.storage:  # /clear_hicache_storage_backend, when no component holds a storage backend
            message = "no hierarchical cache storage backend (--hicache-storage-backend)"
            return FlushCacheReqOutput(rid=recv.rid, success=False, message=message)
        if self.has_work():
            return FlushCacheReqOutput(
                rid=recv.rid, success=False, message="cannot flush the cache while requests are running or queued"
            )
        for c in self.components:
            c.release_cache_locks()
        self.tree_cache.reset_with_free()
        self.check_integrity()
        return FlushCacheReqOutput(rid=recv.rid, success=True)

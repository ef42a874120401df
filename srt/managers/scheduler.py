"""The scheduler process of one tensor-parallel rank: continuous batching with RadixAttention.

Loop: receive requests -> pick the next batch (a prefill of waiting requests if budgets allow,
else a decode step of the running ones) -> run it -> process the results and stream them to the
detokenizer. Admission lives in PrefillAdder, caching in the prefix cache, batch tensors in
BatchBuilder; this class only orchestrates.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections import deque
from concurrent.futures import Future

import zmq

from srt.configs.model_config import ModelConfig
from srt.constrained.grammar_backend import GrammarError, XGrammarBackend
from srt.disaggregation.prefill import PrefillDisagg
from srt.disaggregation.setup import build_disaggregation
from srt.hf_transformers_utils import get_tokenizer
from srt.lora.adapter import LoRAError, LoRARef, parse_lora_paths
from srt.lora.registry import LoRARegistry
from srt.managers.io_struct import (
    FINISH_ABORT,
    FINISH_LENGTH,
    AbortReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    LoadLoRAAdapterReq,
    LoadReport,
    LoRAUpdateOutput,
    ProfileReq,
    SchedulerCrashed,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReq,
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
from srt.managers.scheduler_guard import SchedulerGuardMixin
from srt.managers.scheduler_output import SchedulerOutputProcessorMixin
from srt.managers.tp_worker import BatchResult, TpModelWorker
from srt.managers.tp_worker_overlap_thread import OverlapTpModelWorker
from srt.mem_cache.base_prefix_cache import BasePrefixCache
from srt.mem_cache.chunk_cache import ChunkCache
from srt.mem_cache.hiradix_cache import HiRadixCache, build_hierarchical_cache
from srt.mem_cache.radix_cache import RadixCache
from srt.metrics.collector import SchedulerMetrics
from srt.model_executor.forward_batch_info import ForwardMode
from srt.model_executor.static_batch import StaticBatchGenerator
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import PortArgs, ServerArgs
from srt.speculative.draft_worker import DraftModelProposer
from srt.speculative.ngram_worker import NgramProposer
from srt.speculative.proposer import Proposer
from srt.utils import rank_log_prefix, start_child_process, zmq_socket

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
RETRACT_DECODE_STEPS = 20
IDLE_POLL_MS = 1000
IO_POLL_S = 0.002
DISAGG_POLL_MS = 5
GRAMMAR_POLL_MS = 5
# A jump-forward costs the request an extend pass of its own (outside the decode batch), so it pays
# only for forced strings of several tokens (JSON keys, enum tails), not for a ", " between items.
JUMP_FORWARD_MIN_TOKENS = 4
JUMP_FORWARD_CONTEXT_TOKENS = 2  # generated tokens re-tokenized with the forced string


class IntegrityError(RuntimeError):
    pass


class Scheduler(SchedulerOutputProcessorMixin, SchedulerGuardMixin):
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, tp_rank: int = 0, dp_rank: int = 0):
        assert server_args.model_path is not None, "launch_subprocesses resolves the model path"
        self.server_args = server_args
        self.dp_rank = dp_rank
        self.model_config = ModelConfig.from_path(server_args.model_path, server_args.context_length)
        self.tp_worker = TpModelWorker(self.model_config, server_args, tp_rank, dp_rank)
        runner = self.tp_worker.model_runner
        self.runner = runner
        self.tokenizer = get_tokenizer(server_args.tokenizer_path or server_args.model_path)
        self.eos_token_ids = self.model_config.eos_token_ids
        self.max_running_requests = runner.max_running_requests
        # prefill-decode disaggregation: rank 0's queues (decode ranks meet here once to describe their pools)
        self.disagg = build_disaggregation(self, tp_rank)
        self.hicache: HiRadixCache | None = None
        if server_args.enable_hierarchical_cache:
            broadcaster = self.tp_worker.broadcaster
            mirror = broadcaster.post_hicache if broadcaster is not None else None
            self.hicache = build_hierarchical_cache(server_args, runner, self.model_config, tp_rank, mirror)
            self.tree_cache: BasePrefixCache = self.hicache
        else:
            cache_cls = ChunkCache if server_args.disable_radix_cache else RadixCache
            self.tree_cache = cache_cls(runner.req_to_token_pool, runner.token_to_kv_pool_allocator, runner.page_size)
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
        self.pending: deque[tuple[ScheduleBatch, Future]] = deque()  # launched, results not processed
        self.last_prefill: ScheduleBatch | None = None
        self.policy = SchedulePolicy(server_args.schedule_policy, self.tree_cache, not server_args.disable_radix_cache)
        self.metrics = SchedulerMetrics() if server_args.enable_metrics else None
        self.chunked_prefill_size = server_args.chunked_prefill_size if server_args.chunked_prefill_size > 0 else None
        self.waiting_queue: list[Req] = []
        self.running_batch = ScheduleBatch([])
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.checked_idle = False
        self.grammar_backend = None
        if server_args.grammar_backend == "xgrammar":
            self.grammar_backend = XGrammarBackend(
                self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids)
            )
        self.grammar_queue: list[tuple[Req, Future, float]] = []  # (request, its compile, when it arrived)
        # the request's KV waits in the prefix cache across a jump: without a radix cache it would be recomputed
        self.jump_forward = not (server_args.disable_jump_forward or server_args.disable_radix_cache)
        self.init_stats()
        self.init_guard()
        self.proposer: Proposer | None = None
        if server_args.speculative_algorithm == "NGRAM":
            self.proposer = NgramProposer(server_args, self.model_config.context_len)
        elif server_args.speculative_algorithm == "STANDALONE":
            self.proposer = DraftModelProposer(server_args, runner, self.model_config)
        self.step_started = 0.0  # when the current decode step started drafting (speculative)
        broadcaster = self.tp_worker.broadcaster
        self.profiler = ForwardProfiler(
            tp_rank, dp_rank, server_args.dp_size, broadcaster.post if broadcaster is not None else None
        )
        self.lora: LoRARegistry | None = None
        if runner.lora_manager is not None:
            self.lora = LoRARegistry(
                runner.lora_manager,
                server_args.max_loras_per_batch,
                server_args.lora_eviction_policy,
                broadcaster.post_lora if broadcaster is not None else None,
                self.wait_launched,
            )
            for ref in parse_lora_paths(server_args.lora_paths):
                self.lora.register(ref, set())
        self.warmup()
        ctx = zmq.Context(2)
        self.recv_from_tokenizer = zmq_socket(
            ctx, zmq.PULL, port_args.replica_input(dp_rank, server_args.dp_size), bind=True
        )
        self.send_to_detokenizer = zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_input, bind=False)
        self.send_to_tokenizer = zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_input, bind=False)
        self.poller: zmq.Poller | None = None  # with disaggregation: new requests or a peer's control message
        if self.disagg is not None:
            self.poller = zmq.Poller()
            self.poller.register(self.recv_from_tokenizer, zmq.POLLIN)
            self.poller.register(self.disagg.recv_socket, zmq.POLLIN)
        # With --dp-size, the controller routes by each replica's load: report it when it changes.
        self.send_to_controller = (
            zmq_socket(ctx, zmq.PUSH, port_args.controller_input, bind=False) if server_args.dp_size > 1 else None
        )
        self.num_received = 0
        self.last_load: tuple | None = None

    def warmup(self) -> None:
        """One tiny prefill and decode, so lazy initialization does not land on the first request."""
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
            "vocab_size": self.model_config.vocab_size,
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
            if self.disagg is not None:
                self.disagg.poll()
            self.expire_deadlines()
            self.poll_grammar_queue()
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
            if self.disagg is not None:
                self.disagg.poll()
            self.expire_deadlines()
            self.poll_grammar_queue()
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
        io = self.hicache is not None and self.hicache.pending_io()
        disagg = self.disagg is not None and self.disagg.pending()
        return bool(self.grammar_queue) or io or disagg or self.has_runnable_work()

    def recv_requests(self) -> list:
        msgs = []
        if self.has_runnable_work():
            wait_ms = 0
        else:  # idle, or only grammar compiles pending: block briefly instead of spinning against them
            wait_ms = GRAMMAR_POLL_MS if self.grammar_queue else IDLE_POLL_MS
        if self.poller is not None and wait_ms:
            # the peer's control messages wake the loop too; timeouts and lookups need a tick
            if self.disagg is not None and self.disagg.pending():
                wait_ms = min(wait_ms, DISAGG_POLL_MS)
            if self.recv_from_tokenizer not in dict(self.poller.poll(wait_ms)):
                return msgs
        elif wait_ms and not self.recv_from_tokenizer.poll(wait_ms):
            return msgs
        while True:
            try:
                msgs.append(self.recv_from_tokenizer.recv_pyobj(zmq.NOBLOCK))
            except zmq.ZMQError:
                return msgs

    def process_input_requests(self, msgs: list) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReqInput):
                self.handle_generate_request(msg)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg)
            elif isinstance(msg, FlushCacheReq):
                self.send_to_tokenizer.send_pyobj(self.flush_cache(msg))
            elif isinstance(msg, GetInternalStateReq):
                self.send_to_tokenizer.send_pyobj(GetInternalStateReqOutput(rid=msg.rid, state=self.internal_state()))
            elif isinstance(msg, ProfileReq):
                self.send_to_tokenizer.send_pyobj(self.profiler.handle(msg, self.forward_passes))
            elif isinstance(msg, (LoadLoRAAdapterReq, UnloadLoRAAdapterReq)):
                self.update_lora(msg)
            else:
                logger.error("scheduler got an unknown message %r", type(msg))
        if self.lora is not None:
            self.finish_lora_unloads()

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
        waiting = len(self.waiting_queue) + len(self.grammar_queue)
        used = self.allocator.size - self.allocator.available_size() - self.tree_cache.evictable_size()
        return running + waiting, waiting, used, self.num_received

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
            extra_key=recv.extra_key,
            created_time=recv.created_time,
            timeout=recv.timeout,
            bootstrap_host=recv.bootstrap_host,
            bootstrap_port=recv.bootstrap_port,
            bootstrap_room=recv.bootstrap_room,
        )
        self.track_deadline(req)
        if recv.lora_name is not None:
            assert self.lora is not None, "the tokenizer manager refuses lora_path without --enable-lora"
            try:
                entry = self.lora.accepts(recv.lora_name)
            except LoRAError as e:
                self.fail_request(req, str(e))
                return
            req.lora_name = recv.lora_name
            # KV computed under an adapter is its own: a cache namespace per adapter's weights
            req.extra_key = f"lora:{entry.uid}\x00{req.extra_key or ''}"
        if self.hicache is not None:  # its stored pages start loading while it waits
            self.hicache.prefetch(req, req.cacheable_ids())
        key = req.sampling_params.grammar_key
        if key is None:
            self.enqueue(req)
        elif self.grammar_backend is None:
            self.fail_request(
                req,
                "structured output (json_schema / regex / ebnf) is disabled on this server (--grammar-backend none)",
            )
        else:  # the event loop polls the queue right after taking in new requests
            self.grammar_queue.append((req, self.grammar_backend.submit(key), time.monotonic()))

    def enqueue(self, req: Req) -> None:
        """A new request is ready to run: to the waiting queue, or to a disaggregation queue first."""
        if self.disagg is None or not self.disagg.admit(req):
            self.waiting_queue.append(req)

    def fail_request(self, req: Req, message: str) -> None:
        """A request that cannot run as asked: it ends before any token, answered with HTTP 400."""
        req.finished_reason = FINISH_ABORT(message=message, status_code=400)
        self.stream_output([req])

    def poll_grammar_queue(self) -> None:
        """Requests whose grammar compiled join the waiting queue; failed or timed-out ones end."""
        if not self.grammar_queue:
            return
        still, now, timeout = [], time.monotonic(), self.server_args.grammar_compile_timeout
        for req, fut, since in self.grammar_queue:
            if req.to_abort is not None:
                req.finished_reason = FINISH_ABORT(message=req.to_abort)
                self.stream_output([req])
            elif fut.done():
                result = fut.result()
                if isinstance(result, GrammarError):
                    self.fail_request(req, str(result))
                else:
                    assert self.grammar_backend is not None  # only its requests wait for a compile
                    req.grammar = self.grammar_backend.matcher(result)
                    self.enqueue(req)
            elif now - since > timeout:
                self.fail_request(req, f"the grammar did not compile within {timeout:g} s (--grammar-compile-timeout)")
            else:
                still.append((req, fut, since))
        self.grammar_queue = still

    def abort_request(self, recv: AbortReq) -> None:
        def hit(r: Req) -> bool:
            return recv.abort_all or r.rid == recv.rid

        for r in [r for r in self.waiting_queue if hit(r)]:
            self.waiting_queue.remove(r)
            r.finished_reason = FINISH_ABORT(message=recv.message)
            self.stream_output([r])
        for r, _, _ in self.grammar_queue:
            if hit(r):
                r.to_abort = recv.message  # ended by poll_grammar_queue
        queued = self.disagg.queued() if self.disagg is not None else []
        launched = self.last_prefill.reqs if self.last_prefill is not None else []
        for r in self.running_batch.reqs + launched + ([self.chunked_req] if self.chunked_req else []) + queued:
            if hit(r) and not r.finished:
                r.to_abort = recv.message  # a disaggregation queue ends it on its next poll

    # -- batch selection -------------------------------------------------------------------------

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        if self.last_prefill is not None:
            # Requests whose prompt is complete join the decode batch, even before their prefill
            # results are processed (their first token is then a future-map placeholder).
            self.running_batch.reqs.extend(
                r
                for r in self.last_prefill.reqs
                if not r.finished and r is not self.chunked_req and self.decodes_here(r)
            )
            self.last_prefill = None
        if any(r.future_slot is not None and r.needs_fresh_history for r in self.running_batch.reqs):
            self.sync_pending()
        self.running_batch.filter_finished()
        batch = self.get_new_batch_prefill()
        if batch is not None:
            self.last_prefill = batch
            return batch
        if self.running_batch.reqs:
            self.update_running_batch()
            if self.running_batch.reqs:
                return self.decode_or_verify_batch(list(self.running_batch.reqs))
        return None

    def decode_or_verify_batch(self, reqs: list[Req]) -> ScheduleBatch:
        """A decode step; with speculative decoding, a verify step when some request has a draft."""
        if self.proposer is None:
            return ScheduleBatch(reqs, ForwardMode.DECODE)
        self.step_started = time.perf_counter()
        budgets = self.proposer.plan(reqs)
        if not any(budgets):
            for r in reqs:  # the n-gram cache still learns from every token
                self.proposer.observe(r)
            return ScheduleBatch(reqs, ForwardMode.DECODE)
        # update_running_batch made room for one decode step; drafts use what is left
        spare = self.allocator.available_size() + self.tree_cache.evictable_size()
        trees = self.proposer.draft(reqs, budgets, self.builder, spare - self.builder.decode_slots_needed(reqs))
        if not any(t.num_drafts for t in trees):
            return ScheduleBatch(reqs, ForwardMode.DECODE)
        # chains verify as decode rows (the fast decode path); trees need the tree mask
        mode = ForwardMode.DECODE if all(t.is_chain for t in trees) else ForwardMode.TARGET_VERIFY
        return ScheduleBatch(reqs, mode, spec_trees=trees)

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        if self.hicache is not None:  # pages that arrived join the tree (their requests may be gone)
            self.hicache.poll_prefetches()
        if not self.waiting_queue and self.chunked_req is None:
            return None
        if self.chunked_req is not None:
            self.sync_pending()  # its next chunk starts from the KV the previous chunk committed
        running = len(self.running_batch.reqs) + (1 if self.chunked_req else 0)
        if self.disagg is not None:
            running += self.disagg.held_reqs()
        if running >= self.max_running_requests and self.chunked_req is None:
            return None
        self.policy.calc_priority(self.waiting_queue)
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
        in_batch = InBatchPrefixes() if self.policy.radix_enabled else None
        adapters = self.running_adapters()
        # Only one request is chunked at a time: while one continues, nothing new starts.
        if self.chunked_req is None:
            for req in self.waiting_queue:
                if self.hicache is not None and not self.hicache.prefetch_ready(req):
                    continue  # its pages are still coming from storage (the prefetch policy waits)
                if req.lora_name is not None:
                    try:
                        if not self.admit_lora(req, adapters):
                            continue  # its adapter waits for a place in the batch or the pool
                    except LoRAError as e:  # its files changed or went away since it was registered
                        failed.append((req, str(e)))
                        continue
                req.match_prefix(self.tree_cache)  # fresh: the tree changes between rounds
                if self.hicache is not None and req.host_hit_len:
                    self.load_back(req, self.hicache)
                if in_batch is not None and in_batch.defer(req):
                    continue
                result = adder.add_one_req(req)
                if result.admitted:
                    admitted.append(req)
                    if in_batch is not None:
                        in_batch.add(req)
                if result is not AddReqResult.ADMITTED:
                    break
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        for req, message in failed:
            self.waiting_queue.remove(req)
            self.fail_request(req, message)
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
        self.log_prefill_stats(adder.can_run, running)
        return ScheduleBatch(adder.can_run, ForwardMode.EXTEND)

    def running_adapters(self) -> set[str]:
        """Adapters of the running requests, whose pool slots must stay (a prefill batch joins them:
        the batch limit counts all)."""
        if self.lora is None:
            return set()
        chunked = [self.chunked_req] if self.chunked_req is not None else []
        launched = self.last_prefill.reqs if self.last_prefill is not None else []  # not yet in the running batch
        return {r.lora_name for r in self.running_batch.reqs + chunked + launched if r.lora_name is not None}

    def admit_lora(self, req: Req, adapters: set[str]) -> bool:
        """Give req's adapter a pool slot (loading it when needed) if --max-loras-per-batch lets it
        join the adapters already running; `adapters` gains it."""
        assert self.lora is not None and req.lora_name is not None
        if req.lora_name not in adapters and len(adapters) >= self.lora.max_per_batch:
            return False
        slot = self.lora.slot_for(req.lora_name, adapters)
        if slot is None:
            return False
        req.lora_slot = slot
        adapters.add(req.lora_name)
        return True

    def update_lora(self, msg: LoadLoRAAdapterReq | UnloadLoRAAdapterReq) -> None:
        """A load is answered at once; an unload once the adapter's requests have finished."""
        assert self.lora is not None, "the tokenizer manager refuses LoRA updates without --enable-lora"
        try:
            if isinstance(msg, LoadLoRAAdapterReq):
                ref = LoRARef(msg.lora_name, msg.lora_path, msg.pinned)
                self.lora.register(ref, self.running_adapters())
            else:
                self.lora.request_unload(msg.lora_name, msg.rid)
                return  # answered by finish_lora_unloads
        except LoRAError as e:
            self.send_to_tokenizer.send_pyobj(LoRAUpdateOutput(rid=msg.rid, success=False, message=str(e)))
            return
        out = LoRAUpdateOutput(rid=msg.rid, success=True, loaded_adapters=self.lora.adapters())
        self.send_to_tokenizer.send_pyobj(out)

    def finish_lora_unloads(self) -> None:
        assert self.lora is not None
        if not self.lora.unloading():
            return
        reqs = self.all_live_reqs() + [r for r, _, _ in self.grammar_queue]
        for name, rid in self.lora.finish_unloads({r.lora_name for r in reqs if r.lora_name is not None}):
            out = LoRAUpdateOutput(
                rid=rid, success=True, message=f"unloaded {name}", loaded_adapters=self.lora.adapters()
            )
            self.send_to_tokenizer.send_pyobj(out)

    def load_back(self, req: Req, hicache: HiRadixCache) -> None:
        """Move the host part of req's match to the device, so its extend starts after it."""
        assert req.last_host_node is not None, "match_prefix sets it with host_hit_len"
        self.wait_launched()  # the copy writes device slots now, from this thread
        moved = hicache.load_back(req.last_host_node)
        if moved:
            req.loaded_from_host += moved
            req.match_prefix(self.tree_cache)

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
        if self.hicache is not None:
            self.hicache.note_hits(*req.cached_tokens_details)

    def update_running_batch(self) -> None:
        """Make sure the next decode step has KV room: evict cache, then retract requests."""
        batch = self.running_batch
        needed = self.builder.decode_slots_needed(batch.reqs)
        if self.allocator.available_size() + self.tree_cache.evictable_size() >= needed:
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
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
            if not self.decodes_here(req):  # prefill server: the KV goes to the decode server
                assert isinstance(self.disagg, PrefillDisagg)
                progressed.pop()
                if req is self.chunked_req:
                    self.chunked_req = None
                self.disagg.start_transfer(req)
            elif req.finished:
                if req is self.chunked_req:
                    self.chunked_req = None
                self.release(req)
            elif req.kv_committed_len == req.kv_len and req.to_abort is None:
                # Its prompt is shareable while it decodes (no step of it is in flight yet).
                self.tree_cache.cache_unfinished_req(req)
        self.stream_output(progressed)

    def process_decode_result(self, batch: ScheduleBatch, res: BatchResult) -> None:
        """Each request's new tokens: its sampled one, or with a draft tree the samples along the
        accepted path (see `DraftTree.accepted_path`: each is a sample of the target's distribution
        after the tokens before it, exactly as decoding draws it; with deterministic drafts this is
        speculative rejection sampling, a draft x accepted with probability p(x), else the token
        drawn from p without the rejected drafts). The stop conditions, and a grammar's jump
        forward, apply after each token in order as they would in decoding; the tokens after are
        dropped with their KV."""
        assert batch.future_slots is not None and batch.kv_ends is not None, "set when the batch was launched"
        trees = batch.spec_trees
        progressed, generated, row = [], 0, 0
        for i, req in enumerate(batch.reqs):
            tree = trees[i] if trees is not None else None
            start, row = row, row + (len(tree) if tree is not None else 1)
            if req.finished:
                continue  # finished in the previous step's results: this step's tokens are dropped
            progressed.append(req)
            drafts = tree.num_drafts if tree is not None else 0
            path = [0]  # a request without drafts keeps its sampled token
            if tree is not None and drafts:
                path = tree.accepted_path(res.next_token_ids[start : start + len(tree)])
            self.take_future_slot(req, batch.future_slots[i])
            kept, jump = 0, None
            for node in path:
                self.append_token(req, res.next_token_ids[start + node], res, start + node)
                kept += 1
                req.check_finished(self.eos_token_ids, self.model_config.context_len, self.tokenizer)
                if req.finished:
                    break
                if req.grammar is not None and self.jump_forward and (jump := self.jump_forward_tokens(req)):
                    break
            generated += kept
            if tree is not None and drafts:  # the kept tokens' KV: the path's first `kept` nodes
                self.keep_verified_rows(req, batch.kv_ends[i] - len(tree), path[:kept], len(tree))
            if self.proposer is not None:
                self.note_spec_step(req, drafts, kept - 1)
                if tree is not None:
                    self.proposer.adapt(req, drafts, len(path) - 1, max(tree.depths))
            if req.finished:
                self.release(req)
            elif jump:
                self.jump(req, jump)
        if self.proposer is not None:
            self.spec_req_steps += len(progressed)
            self.spec_step_tokens += generated
            seconds = time.perf_counter() - self.step_started
            rows = sum(len(t) for t in trees) if trees is not None else len(batch.reqs)
            self.proposer.record(len(batch.reqs), rows, seconds)
        self.stream_output(progressed)
        self.num_generated_tokens += generated
        self.maybe_log_decode_stats()

    def note_spec_step(self, req: Req, proposed: int, accepted: int) -> None:
        """SGLang's speculative stats of one decode step of req (a step without drafts accepts 0)."""
        assert self.proposer is not None
        req.spec_proposed += proposed
        req.spec_histogram += [0] * (accepted + 1 - len(req.spec_histogram))
        req.spec_histogram[accepted] += 1
        self.spec_proposed += proposed
        self.spec_accepted += accepted

    def keep_verified_rows(self, req: Req, kv_start: int, path: list[int], rows: int) -> None:
        """Rows `path` of the `rows` written from position kv_start on hold the accepted tokens'
        KV: move them to positions kv_start, kv_start + 1, ... and free the pages past them."""
        table = self.runner.req_to_token_pool.req_to_token[req.req_pool_idx]
        moved = [(kv_start + node, kv_start + j) for j, node in enumerate(path) if node != j]
        if moved:
            src = table[[a for a, _ in moved]].long()
            dst = table[[b for _, b in moved]].long()
            self.runner.token_to_kv_pool.move_kv(src, dst)
            if self.tp_worker.broadcaster is not None:  # every rank holds a shard of this KV
                self.tp_worker.broadcaster.post_kv_move(src, dst)
        keep_end = kv_start + len(path)
        page = self.allocator.page_size
        first_free = -(-keep_end // page) * page  # the kept tail's page stays with the request
        if first_free < kv_start + rows:
            self.allocator.free(table[first_free : kv_start + rows].long())
        req.kv_len = keep_end

    def jump_forward_tokens(self, req: Req) -> list[int] | None:
        """The tokens of the string the grammar forces next, to append without decoding them token
        by token (the grammar has accepted them), or None.

        The forced string is tokenized together with the last generated tokens; it is used only
        when that keeps those tokens (else decoding goes on, and the next step tries again at a
        cleaner boundary). The request then leaves the decode batch with its KV in the prefix
        cache and comes back as one extend over the appended tokens (see `jump`)."""
        p, grammar = req.sampling_params, req.grammar
        assert grammar is not None, "only constrained requests jump forward"
        if req.return_logprob or p.stop_strs:  # no logprobs for jumped tokens; a stop string could fire inside
            return None
        forced = grammar.find_jump_forward_string()
        if not forced:
            return None
        out = req.output_ids
        tail = out[-JUMP_FORWARD_CONTEXT_TOKENS:]  # earlier tokens belong to finished pre-tokens
        tail_text = self.tokenizer.decode(tail, clean_up_tokenization_spaces=False)
        assert isinstance(tail_text, str)  # one sequence of ids decodes to one string
        ids = self.tokenizer.encode(tail_text + forced, add_special_tokens=False)
        if ids[: len(tail)] != tail:
            return None
        # The last forced token is left to the model: it may merge with the free text after it
        # (e.g. ' "' + 'S' -> ' "S'), and decoding it keeps the tokens greedy decoding would pick.
        extra = ids[len(tail) : -1]
        if len(extra) < JUMP_FORWARD_MIN_TOKENS:
            return None
        if (
            p.max_new_tokens is not None
            and len(out) + len(extra) >= p.max_new_tokens
            or req.seq_len + len(extra) >= self.model_config.context_len
        ):
            return None
        if set(extra) & (set(p.stop_token_ids or ()) | self.eos_token_ids):
            return None  # a stop token inside the forced string: decode it normally
        for k, t in enumerate(extra):
            if not grammar.accept_token(t):
                grammar.rollback(k)
                return None
        return extra

    def jump(self, req: Req, extra: list[int]) -> None:
        req.output_ids.extend(extra)
        self.total_jump_forward_tokens += len(extra)
        if req in self.running_batch.reqs:  # defensive: a decode result's request is normally still running
            self.running_batch.reqs.remove(req)
        self.park(req, retraction=False)
        self.waiting_queue.insert(0, req)

    def park(self, req: Req, retraction: bool) -> None:
        """Take a running request off the device: its computed KV goes into the prefix cache, which
        its next prefill matches, so only the tokens without KV are computed again."""
        self.tree_cache.cache_finished_req(req)
        if self.proposer is not None:
            self.proposer.forget(req)
        req.reset_for_retract(count=retraction)

    @staticmethod
    def take_future_slot(req: Req, slot: int) -> None:
        """The token is on the host now; a later launch may already have given req a new slot."""
        if req.future_slot == slot:
            req.future_slot = None

    def decodes_here(self, req: Req) -> bool:
        """False for a prefill server's requests whose decode side is another server."""
        return not isinstance(self.disagg, PrefillDisagg) or self.disagg.joins_decode(req)

    def join_decoding(self, req: Req, done: dict) -> None:
        """Decode server: req's prompt KV arrived with its first token (and that token's logprobs
        from the prefill side): it continues exactly as if it had been prefilled here."""
        token = int(done["token"])
        first = BatchResult([token])
        if req.return_logprob:  # the prefill side got the same body, so it sent them
            vals, ids = done.get("top_logprobs") or ([], [])
            first.next_token_logprobs = [float(done.get("logprob", float("nan")))]
            first.next_top_logprobs = [(list(vals), list(ids))]
            first.next_token_ids_logprobs = [done.get("token_ids_logprobs")]
        if self.metrics is not None:
            self.metrics.on_admitted(req)
        req.admitted = req.input_logprobs_done = True  # prompt logprobs come from the prefill server
        self.append_token(req, token, first, 0)
        req.check_finished(self.eos_token_ids, self.model_config.context_len, self.tokenizer)
        if req.finished:
            self.release(req)
        else:
            self.tree_cache.cache_unfinished_req(req)  # its prompt is shareable while it decodes
            self.running_batch.reqs.append(req)
        self.stream_output([req])

    def all_live_reqs(self) -> list[Req]:
        launched = self.last_prefill.reqs if self.last_prefill is not None else []
        chunked = [self.chunked_req] if self.chunked_req is not None else []
        return self.waiting_queue + self.running_batch.reqs + launched + chunked

    def stream_output(self, reqs: list[Req]) -> None:
        if self.disagg is not None:
            self.disagg.on_output(reqs)
        super().stream_output(reqs)

    def release(self, req: Req) -> None:
        self.tree_cache.cache_finished_req(req)
        if self.proposer is not None:
            self.proposer.forget(req)

    # -- idle, integrity, control ----------------------------------------------------------------

    def on_idle(self) -> None:
        self.tp_worker.keepalive()  # the other tensor-parallel ranks wait for work
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        if self.metrics is not None:
            self.metrics.gen_throughput = 0.0
        if self.hicache is not None and self.hicache.pending_io():
            self.hicache.wait_io(IO_POLL_S)  # requests wait for pages from storage: let the reader run
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
        if self.tree_cache.protected_size():
            problems.append(f"{self.tree_cache.protected_size()} cached tokens still locked while idle")
        if slots.available_size() != slots.size:
            problems.append(f"request slots: {slots.size - slots.available_size()} still held while idle")
        if self.proposer is not None and (held := self.proposer.stats().get("draft_kv_used")):
            problems.append(f"draft model KV: {held} slots still held while idle")
        problems += self.tree_cache.integrity_problems()
        self.integrity_ok = not problems
        if problems:
            msg = "KV pool integrity violated: " + "; ".join(problems)
            logger.error(msg)
            if self.server_args.debug_integrity_check:
                raise IntegrityError(msg)

    def flush_cache(self, recv: FlushCacheReq) -> FlushCacheReqOutput:
        if recv.storage:  # /clear_hicache_storage_backend
            if self.hicache is None or self.hicache.storage is None:
                message = "no hierarchical cache storage backend (--hicache-storage-backend)"
                return FlushCacheReqOutput(rid=recv.rid, success=False, message=message)
            n = self.hicache.clear_storage()
            return FlushCacheReqOutput(rid=recv.rid, success=True, message=f"{n} stored pages deleted")
        if self.has_work():
            return FlushCacheReqOutput(
                rid=recv.rid, success=False, message="cannot flush the cache while requests are running or queued"
            )
        self.tree_cache.reset_with_free()
        self.check_integrity()
        return FlushCacheReqOutput(rid=recv.rid, success=True)


def run_scheduler_process(
    server_args: ServerArgs, port_args: PortArgs, tp_rank: int, pipe_writer, dp_rank: int = 0
) -> None:
    scheduler = start_child_process(
        pipe_writer,
        server_args.log_level,
        rank_log_prefix(server_args, tp_rank, dp_rank),
        lambda: Scheduler(server_args, port_args, tp_rank, dp_rank),
        Scheduler.ready_info,
    )
    try:
        scheduler.event_loop()
    except Exception as e:
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
        # Tell the tokenizer manager why, so every in-flight request fails with the reason. The notice
        # goes the way outputs go (through the detokenizer, in order), so it cannot overtake the
        # final output of a request that finished before the crash.
        try:
            scheduler.send_to_detokenizer.send_pyobj(SchedulerCrashed(message=f"{type(e).__name__}: {e}"))
            time.sleep(0.2)
        finally:
            os._exit(1)

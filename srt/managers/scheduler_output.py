"""What the scheduler does with a batch's results: token and logprob accounting, streaming
deltas to the detokenizer, forward timing, stats and SGLang-style progress logs."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from srt.managers.io_struct import FINISH_ABORT, FINISH_MATCHED_TOKEN, BatchTokenIDOutput, DecodeSettings
from srt.managers.schedule_batch import Req
from srt.managers.scheduler_state import SchedulerState
from srt.managers.tp_worker import BatchResult

if TYPE_CHECKING:
    import zmq

    from srt.managers.profiler import ForwardProfiler
    from srt.managers.schedule_batch import ScheduleBatch
    from srt.managers.scheduler_component import DecodeStrategy, SchedulerComponent
    from srt.mem_cache.allocator import TokenToKVPoolAllocator
    from srt.mem_cache.base_prefix_cache import BasePrefixCache
    from srt.metrics.collector import SchedulerMetrics
    from srt.model_executor.model_runner import ModelRunner
    from srt.server_args import ServerArgs

logger = logging.getLogger("srt.managers.scheduler")


class SchedulerOutputProcessorMixin:
    # Set by the Scheduler this mixin is part of.
    server_args: ServerArgs
    dp_rank: int
    profiler: ForwardProfiler
    overlap: bool
    runner: ModelRunner
    allocator: TokenToKVPoolAllocator
    tree_cache: BasePrefixCache
    components: list[SchedulerComponent]
    decoder: DecodeStrategy
    waiting_queue: list[Req]
    running_batch: ScheduleBatch
    chunked_req: Req | None
    metrics: SchedulerMetrics | None
    send_to_detokenizer: zmq.Socket

    if TYPE_CHECKING:

        def has_work(self) -> bool: ...

        def used_tokens(self) -> int: ...

    def init_stats(self) -> None:
        self.total_retractions = 0
        self.forward_passes = 0
        self.num_generated_tokens = 0  # since the last decode log line
        self.total_generated_tokens = 0
        self.decode_steps = 0
        self.last_decode_log = time.monotonic()
        self.total_prompt_tokens = 0
        self.total_cached_tokens = 0
        self.integrity_ok = True
        # Forward worker time: busy computing vs waiting for the scheduler between batches.
        self.forward_busy_s = self.forward_wait_s = 0.0
        self.interval_busy_s = self.interval_wait_s = 0.0
        self.last_forward_end: float | None = None

    def timed(self, res: BatchResult) -> BatchResult:
        self.forward_passes += 1
        self.profiler.on_forward(self.forward_passes)
        busy = res.forward_end - res.forward_start
        wait = 0.0 if self.last_forward_end is None else max(0.0, res.forward_start - self.last_forward_end)
        self.forward_busy_s += busy
        self.forward_wait_s += wait
        self.interval_busy_s += busy
        self.interval_wait_s += wait
        self.last_forward_end = res.forward_end
        return res

    def forward_idle_fraction(self, busy: float, wait: float) -> float:
        return wait / (busy + wait) if busy + wait else 0.0

    def append_token(self, req: Req, token: int, result: BatchResult, i: int) -> None:
        req.output_ids.append(token)
        if self.metrics is not None:
            self.metrics.on_token(req, time.time())
        if req.return_logprob:  # then its batch asked for logprobs
            assert result.next_token_logprobs is not None
            req.output_token_logprobs.append((result.next_token_logprobs[i], token))
            if req.top_logprobs_num:
                assert result.next_top_logprobs is not None
                req.output_top_logprobs.append(result.next_top_logprobs[i])
            if req.token_ids_logprob:
                assert result.next_token_ids_logprobs is not None
                req.output_token_ids_logprobs.append((result.next_token_ids_logprobs[i], req.token_ids_logprob))
        if req.grammar is not None and not req.finished:
            if not req.grammar.accept_token(token):  # the mask forbids this; never continue unconstrained
                req.finished_reason = FINISH_ABORT(message=f"token {token} was sampled against the grammar")
            elif req.grammar.is_terminated():
                req.finished_reason = FINISH_MATCHED_TOKEN(matched=token)

    def append_input_logprobs(self, req: Req, rows: tuple, chunk_end: int) -> None:
        """Row at absolute position j gives the logprob of prompt token j + 1."""
        vals, top_vals, top_ids, asked = rows
        if not req.wants_input_logprobs:
            return
        prompt = req.model_ids(0, len(req.origin_input_ids)) if req.mm_items else req.origin_input_ids
        first_row = chunk_end - len(vals)
        if req.logprob_start_len == 0 and not req.input_token_logprobs:
            req.input_token_logprobs.append((None, prompt[0]))
            if req.top_logprobs_num:
                req.input_top_logprobs.append(None)
            if req.token_ids_logprob:
                req.input_token_ids_logprobs.append(None)
        for k, v in enumerate(vals):
            pos = first_row + k + 1
            if pos >= len(prompt):
                break
            req.input_token_logprobs.append((v, prompt[pos]))
            if req.top_logprobs_num:
                req.input_top_logprobs.append((top_vals[k], top_ids[k]))
            if req.token_ids_logprob:
                req.input_token_ids_logprobs.append((asked[k], req.token_ids_logprob))

    def stream_output(self, reqs: list[Req]) -> None:
        out = BatchTokenIDOutput(dp_rank=self.dp_rank)
        for r in reqs:
            if not (r.finished or r.stream):
                continue
            if r.finished and self.metrics is not None:
                self.metrics.on_finished(r)
            new_ids = r.output_ids[r.sent_output_len :]
            if not r.finished and not new_ids:
                continue
            # --stream-interval: the first token goes out at once (time to first token), then every N
            if not r.finished and r.sent_output_len and len(new_ids) < self.server_args.stream_interval:
                continue
            p = r.sampling_params
            out.rids.append(r.rid)
            out.finished_reasons.append(r.finished_reason)
            out.new_output_ids.append(new_ids)
            out.decode_settings.append(
                DecodeSettings(
                    skip_special_tokens=p.skip_special_tokens,
                    spaces_between_special_tokens=p.spaces_between_special_tokens,
                    stop_strs=tuple(p.stop_strs),
                    no_stop_trim=p.no_stop_trim,
                    stop_regex=tuple(p.stop_regex_strs),
                )
            )
            out.prompt_tokens.append(len(r.origin_input_ids))
            out.completion_tokens.append(len(r.output_ids))
            out.cached_tokens.append(r.cached_tokens)
            out.cached_tokens_details.append(r.cached_tokens_details)
            out.retractions.append(r.retractions)
            out.input_token_logprobs.append(r.input_token_logprobs[r.sent_input_logprob_len :])
            out.input_top_logprobs.append(r.input_top_logprobs[r.sent_input_logprob_len :])
            out.output_token_logprobs.append(r.output_token_logprobs[r.sent_output_logprob_len :])
            out.output_top_logprobs.append(r.output_top_logprobs[r.sent_output_logprob_len :])
            out.input_token_ids_logprobs.append(r.input_token_ids_logprobs[r.sent_input_logprob_len :])
            out.output_token_ids_logprobs.append(r.output_token_ids_logprobs[r.sent_output_logprob_len :])
            if self.decoder.reports_spec_stats:
                out.spec.append((r.spec_proposed, list(r.spec_histogram)))
            out.meta.append(r.meta if r.meta is not r.meta_sent else None)
            r.meta_sent = r.meta
            r.sent_output_len = len(r.output_ids)
            r.sent_input_logprob_len = len(r.input_token_logprobs)
            r.sent_output_logprob_len = len(r.output_token_logprobs)
        if out.rids:
            self.send_to_detokenizer.send_pyobj(out)

    # -- logs and state ----------------------------------------------------------------------------

    def token_usage(self) -> float:
        free = self.allocator.available_size() + self.tree_cache.evictable_size()
        return 1.0 - free / self.allocator.size

    def log_prefill_stats(self, can_run: list[Req], running_before: int) -> None:
        new_tokens = sum(r.extend_input_len for r in can_run)
        cached = sum(r.kv_len for r in can_run)
        self.total_prompt_tokens += new_tokens + cached
        self.total_cached_tokens += cached
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d, cache hit rate: %.1f%%",
            len(can_run),
            new_tokens,
            cached,
            self.token_usage(),
            running_before,
            len(self.waiting_queue),
            100 * self.cache_hit_rate(),
        )

    def cache_hit_rate(self) -> float:
        return self.total_cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0.0

    def maybe_log_decode_stats(self) -> None:
        self.decode_steps += 1
        if self.decode_steps % self.server_args.decode_log_interval:
            return
        now = time.monotonic()
        throughput = self.num_generated_tokens / max(now - self.last_decode_log, 1e-9)
        self.num_generated_tokens, self.last_decode_log = 0, now
        if self.metrics is not None:
            self.metrics.gen_throughput = throughput
        used = self.used_tokens()
        idle = self.forward_idle_fraction(self.interval_busy_s, self.interval_wait_s)
        self.interval_busy_s = self.interval_wait_s = 0.0
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
            "#queue-req: %d, forward idle: %.1f%%",
            len(self.running_batch.reqs),
            used,
            self.token_usage(),
            throughput,
            len(self.waiting_queue),
            100 * idle,
        )

    def internal_state(self) -> SchedulerState:
        state = SchedulerState(
            dp_rank=self.dp_rank,
            num_running_reqs=len(self.running_batch.reqs) + (1 if self.chunked_req else 0),
            num_queue_reqs=len(self.waiting_queue),
            num_waiting_tokens=sum(len(r.origin_input_ids) for r in self.waiting_queue),
            token_usage=self.token_usage(),
            cache_hit_rate=self.cache_hit_rate(),
            total_retractions=self.total_retractions,
            forward_passes=self.forward_passes,
            kv_available=self.allocator.available_size(),
            kv_evictable=self.tree_cache.evictable_size(),
            kv_protected=self.tree_cache.protected_size(),
            kv_capacity=self.allocator.size,
            req_slots_free=self.runner.req_to_token_pool.available_size(),
            integrity_ok=self.integrity_ok,
            forward_busy_s=self.forward_busy_s,
            forward_wait_s=self.forward_wait_s,
            forward_idle_fraction=self.forward_idle_fraction(self.forward_busy_s, self.forward_wait_s),
            overlap_schedule=self.overlap,
            attention_backend=self.runner.attn_backend.name,
            torch_compile=self.runner.compiled_decode.status() if self.runner.compiled_decode else None,
            cuda_graph=self.runner.cuda_graph_status(),
            metrics=self.metrics.state() if self.metrics is not None else None,
            idle=not self.has_work(),
            pid=os.getpid(),
            prompt_tokens_total=self.total_prompt_tokens,
            generated_tokens_total=self.total_generated_tokens,
        )
        for c in self.components:
            c.fill_state(state)
        return state

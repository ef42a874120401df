"""Continuous decode (--num-continuous-decode-steps N, SGLang's flag): a decode batch takes up to N
steps in one call of the model worker, each step feeding the tokens the step before sampled. The
scheduler's loop (batch building, result processing, streaming) runs once for the N steps instead of
once a step, and for greedy batches on the CPU's fused decode stack so does the forward's Python; the
tokens are those of single steps (seeded samples included: a seed hashes the token's position). The
costs: tokens reach streaming clients N at a time, and a request that a stop string ends inside a call
has the steps after its stop computed and dropped (their KV slots are freed with the request). A request
or an abort that arrives during a call ends it after the step it is in (the scheduler's request socket's
descriptor, polled between steps: `interrupt_fd`), so it waits a step, as without the flag; so does a
request's stop token or length (`stops`: the stopping request's answer does not wait for the others'
steps). Neither with the overlap scheduler, which builds the next batch on all of a call's steps.

A batch takes several steps when no request waits for admission and the KV cache has room for all
of the steps; otherwise, and for steps past the longest remaining
budget or the context length, it decodes one step at a time. Penalties, logit bias, the
min_new_tokens ban, grammars and logprobs are taken step by step inside the call (a forward and a
sample a step: penalties count the call's earlier tokens, the ban lifts at its step, each grammar
accepts the call's tokens and masks the next step, then is rolled back for the scheduler to accept
the tokens it keeps); batches without them run all their steps in one C++ call on the CPU's fused
stack.
"""

from __future__ import annotations

import select
from typing import TYPE_CHECKING

import torch

from srt.managers.schedule_batch import ScheduleBatch
from srt.managers.scheduler_component import DecodeStrategy, SchedulerComponent
from srt.model_executor.forward_batch_info import ForwardMode

if TYPE_CHECKING:
    from srt.managers.schedule_batch import Req
    from srt.managers.scheduler_component import SchedulerPort
    from srt.managers.scheduler_state import SchedulerState
    from srt.managers.tp_worker import BatchResult


AUTO_UNSTREAMED_STEPS = 32  # --num-unstreamed-decode-steps's default on the CPU (without the overlap scheduler)
# An unstreamed call's steps x requests past 8 steps: a small batch's calls are long (its Python between
# calls is a larger share of its step), a large batch's end every 8 steps at most (a deadline, or a
# request's answer ended by a stop string, waits no longer than that).
CALL_ROWS = 64


class ContinuousDecode(SchedulerComponent, DecodeStrategy):
    name = "continuous_decode"

    def __init__(self, port: SchedulerPort, steps: int, unstreamed: int | None = None):
        """`steps`: a call's most steps (--num-continuous-decode-steps); `unstreamed`: the most for a batch
        in which no request streams (--num-unstreamed-decode-steps, at least `steps`), a request's calls
        growing with its output (1, 1, 2, 4, ...) past `steps`; a streamed batch then takes up to the steps
        until one of its streams' next chunk is due (--stream-interval)."""
        self.port = port
        self.steps = steps
        self.unstreamed = max(steps, unstreamed or steps)
        self.context_len = port.runner.model_config.context_len
        args = port.server_args  # jump-forward on (srt/constrained): a call ends where a grammar forces a string
        self.jump_forward = not (args.disable_jump_forward or args.disable_radix_cache)
        self.multi_calls = self.multi_steps = self.single_calls = self.cut_calls = self.stopped_calls = 0

    @classmethod
    def build(cls, port: SchedulerPort) -> ContinuousDecode | None:
        args = port.server_args
        steps, unstreamed = args.num_continuous_decode_steps, args.num_unstreamed_decode_steps
        if unstreamed is None:  # on by default where a step's Python costs most and a call can be cut short
            device = port.runner.device
            auto = device == "cpu" and not args.overlap_schedule_enabled(device) and args.speculative_algorithm is None
            unstreamed = AUTO_UNSTREAMED_STEPS if auto else 1
        return cls(port, steps, unstreamed) if max(steps, unstreamed) > 1 else None

    @staticmethod
    def eligible(req: Req) -> bool:
        """Whether req's next tokens can be decoded several at a time: any request not being aborted.
        (Penalties, bans, logit bias, grammars and logprobs move on from step to step inside the call;
        a request with images starts from its shifted positions.)"""
        return req.to_abort is None

    def plan(self, reqs: list[Req]) -> ScheduleBatch:
        steps = self.steps_for(reqs)
        batch = ScheduleBatch(reqs, ForwardMode.DECODE, decode_steps=steps, interrupt_fd=self.port.interrupt_fd)
        if steps > 1 and self.cuttable:
            batch.stop_ids, batch.stop_steps = self.stops(reqs, steps)
            batch.end_on_jump = self.jump_forward
        return batch

    @property
    def cuttable(self) -> bool:
        """Whether a call may end before its last step (not with the overlap scheduler, which builds the
        next batch on all of a call's steps: it has no interrupt descriptor either)."""
        return self.port.interrupt_fd >= 0

    def stops(self, reqs: list[Req], steps: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What ends a call of `steps` steps after the step in which a request stops (ForwardBatch.stop_ids,
        stop_steps): each request's stop token ids (its stop_token_ids, and the model's EOS ids unless it
        ignores them: those check_finished matches; none while min_new_tokens may still hold them back)
        and the step at which it reaches max_new_tokens or the context length. Stop strings and regexes
        are matched on text, after the call."""
        eos, context_len = self.port.eos_token_ids, self.context_len
        ids: list[list[int]] = []
        ends: list[int] = []
        for r in reqs:
            p, n = r.sampling_params, len(r.output_ids)
            ids.append([*(p.stop_token_ids or ()), *(() if p.ignore_eos else eos)] if n + 1 >= p.min_new_tokens else [])
            ends.append(min(p.max_new_tokens - n if p.max_new_tokens is not None else steps, context_len - r.seq_len))
        width = max(map(len, ids))
        stop_ids = torch.tensor([row + [-1] * (width - len(row)) for row in ids]) if width else None
        return stop_ids, torch.tensor(ends) if min(ends) < steps else None

    def on_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        """A call that ended early (a waiting message, a request's stop, a grammar's jump): its requests
        keep the steps it took (the KV slots of the others go back in after_request)."""
        if result.decode_steps < batch.decode_steps:
            batch.decode_steps = result.decode_steps
            # the message that cut the call is still unread (the loop receives after the results)
            if select.select([self.port.interrupt_fd], [], [], 0)[0]:
                self.cut_calls += 1
            else:
                self.stopped_calls += 1

    def steps_for(self, reqs: list[Req]) -> int:
        if self.port.waiting_queue or not all(self.eligible(r) for r in reqs):
            return 1  # (requests waiting for room: a step at a time lets them in as soon as some finish)
        most = self.steps
        streamed = [r for r in reqs if r.stream]
        if self.unstreamed > self.steps and streamed:
            # --stream-interval N: a streamed request's next chunk is due once N tokens wait unsent (its
            # first at once); a call that ends where the first of them is due delays no chunk
            interval = self.port.server_args.stream_interval
            due = min(interval - (len(r.output_ids) - r.sent_output_len) if r.sent_output_len else 1 for r in streamed)
            most = max(self.steps, min(self.unstreamed, due))
        elif self.unstreamed > self.steps:
            # nobody reads these tokens one at a time: up to `unstreamed` steps. The call ends after a
            # request's stop token or length (stops); where a stop string or regex may end one instead,
            # which only the text after the call shows, or where no call can end early, the calls grow
            # with the youngest request's output (a largest power of two no more than its tokens so far),
            # so that an answer that stops early computes few steps past its stop.
            most = min(self.unstreamed, max(8, CALL_ROWS // len(reqs)))
            if not self.cuttable or any(r.sampling_params.stop_strs or r.sampling_params.stop_regex_strs for r in reqs):
                youngest = min(len(r.output_ids) for r in reqs)
                most = max(self.steps, min(most, 1 << max(youngest.bit_length() - 1, 0)))
        # kv_len: the positions written, those of tokens a launched batch is still computing included
        budget = max((r.max_new_tokens or most) - (r.kv_len - len(r.origin_input_ids) + 1) for r in reqs)
        room = min(self.context_len - r.kv_len for r in reqs)  # no position past the context
        steps = min(most, budget, room)
        if steps <= 1:
            return 1
        # the core made room for one step; the others need theirs without retracting anyone (fewer
        # steps where the cache is short of room for all)
        port = self.port
        spare = port.allocator.available_size() + port.tree_cache.evictable_size()
        while steps > 1 and sum(port.builder.rows_slots_needed(r, steps) for r in reqs) > spare:
            steps //= 2
        return steps

    def width(self, batch: ScheduleBatch, i: int) -> int:
        return batch.decode_steps

    def accepted(self, batch: ScheduleBatch, i: int, samples: list[int]) -> list[int]:
        return list(range(batch.decode_steps))

    def after_request(self, batch: ScheduleBatch, i: int, req: Req, path: list[int], kept: int) -> None:
        """A request that goes on with fewer tokens than the call's steps (a grammar's forced string cut
        the call; a stop ends the request instead): the slots of the steps after its last kept token
        held KV for dropped tokens; they go back (but the kept tail's page), before the forced tokens
        are appended."""
        if req.finished or (end := req.kv_committed_len) >= req.kv_len:
            return
        page = self.port.allocator.page_size
        first_free = -(-end // page) * page
        if first_free < req.kv_len:
            table = self.port.runner.req_to_token_pool.host[req.req_pool_idx]
            self.port.allocator.free(table[first_free : req.kv_len].long())
        req.kv_len = end

    def after_step(self, batch: ScheduleBatch, num_reqs: int, generated: int) -> None:
        if batch.decode_steps > 1:
            self.multi_calls += 1
            self.multi_steps += batch.decode_steps
        else:
            self.single_calls += 1

    def fill_state(self, state: SchedulerState) -> None:
        state.continuous_decode = {
            "steps": self.steps,
            "unstreamed_steps": self.unstreamed,
            "multi_step_calls": self.multi_calls,
            "multi_step_steps": self.multi_steps,
            "single_step_calls": self.single_calls,
            "interrupted_calls": self.cut_calls,
            "stopped_calls": self.stopped_calls,
        }

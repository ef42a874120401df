"""Static-batch generation straight through the model core, without the scheduler.

All prompts are prefilled together (optionally in chunks, which exercises attention over a cached
prefix), then decoded together until each one finishes. `bench_one_batch` and the model-core
tests drive the runner through this.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from srt.layers.logits_processor import LogitsProcessorOutput
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from srt.model_executor.model_runner import ModelRunner
from srt.models.multimodal import MultimodalItem, mm_runs, model_ids, mrope_positions
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.sampling_params import SamplingParams


@dataclass
class StaticReq:
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    req_pool_idx: int = -1
    prefix_len: int = 0  # tokens already in the KV cache
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    mm_items: list[MultimodalItem] | None = None  # images: pad values at their rows of origin_input_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)


class StaticBatchGenerator:
    def __init__(
        self,
        runner: ModelRunner,
        forward: Callable[[ForwardBatch], LogitsProcessorOutput] | None = None,
        decode_steps: int = 1,
    ):
        """`forward` runs a batch (default: `runner.forward`); rank 0 of a tensor-parallel group
        passes its worker's, which sends the batch to the other ranks too. `decode_steps` > 1: batches
        without logit processors or logprobs decode that many steps in one go
        (`ModelRunner.decode_steps`, as the server's --num-continuous-decode-steps), each request
        keeping its tokens up to its first stop."""
        self.runner = runner
        self.forward = forward or runner.forward
        self.decode_steps = decode_steps if forward is None else 1  # (one rank's runner alone)
        self.eos = runner.model_config.eos_token_ids
        # Wall time of the last generate(): prefill (through its first token) and the decode steps.
        self.last_timings: dict[str, float] = {}
        # (ids of a step's requests, their SamplingBatchInfo) while it holds for their later steps
        self._step_info: tuple[list[int], SamplingBatchInfo] | None = None

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        chunk_size: int | None = None,
        return_logprob: bool = False,
        mm_items: list[list[MultimodalItem] | None] | None = None,
    ) -> list[StaticReq]:
        """`mm_items[i]`: prompt i's images (its image rows hold their pad values)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        images = mm_items or [None] * len(prompts)
        reqs = [StaticReq(list(p), sp, mm_items=m) for p, sp, m in zip(prompts, params, images)]
        self._alloc_slots(reqs)
        try:
            start = time.perf_counter()
            self._prefill(reqs, chunk_size, return_logprob)
            prefilled = time.perf_counter()
            running, steps = [r for r in reqs if r.finish_reason is None], 0
            while running:
                steps += self._decode(running, return_logprob)
                running = [r for r in running if r.finish_reason is None]
            self.last_timings = {
                "prefill_s": prefilled - start,
                "decode_s": time.perf_counter() - prefilled,
                "decode_steps": steps,
            }
        finally:
            self.free(reqs)
            self._step_info = None
        return reqs

    def prefill_logits(
        self, prompts: list[list[int]], mm_items: list[list[MultimodalItem] | None] | None = None
    ) -> torch.Tensor:
        """Next-token logits [B, V] at the last position of each prompt."""
        images = mm_items or [None] * len(prompts)
        reqs = [StaticReq(list(p), SamplingParams(max_new_tokens=0), mm_items=m) for p, m in zip(prompts, images)]
        self._alloc_slots(reqs)
        try:
            fb = self._extend_batch(reqs, [len(p) for p in prompts], return_logprob=False)
            return self.forward(fb).next_token_logits
        finally:
            self.free(reqs)

    def _alloc_slots(self, reqs: list[StaticReq]) -> None:
        slots = self.runner.req_to_token_pool.alloc(len(reqs))
        if slots is None:
            raise RuntimeError(
                f"batch of {len(reqs)} exceeds {self.runner.req_to_token_pool.available_size()} request slots"
            )
        for r, s in zip(reqs, slots):
            r.req_pool_idx = s

    def free(self, reqs: list[StaticReq]) -> None:
        pool, allocator = self.runner.req_to_token_pool, self.runner.token_to_kv_pool_allocator
        for r in reqs:
            if r.req_pool_idx < 0:
                continue
            if r.prefix_len:
                allocator.free(pool.read(r.req_pool_idx, 0, r.prefix_len))
            pool.free(r.req_pool_idx)
            r.req_pool_idx, r.prefix_len = -1, 0

    def _alloc_kv(self, prefix_lens: list[int], seq_lens: list[int], reqs: list[StaticReq]) -> torch.Tensor:
        pool = self.runner.req_to_token_pool
        last = [pool.last_slot(r.req_pool_idx, p - 1) if p else 0 for r, p in zip(reqs, prefix_lens)]
        loc = self.runner.token_to_kv_pool_allocator.alloc_extend(prefix_lens, seq_lens, last)
        if loc is None:
            raise RuntimeError("KV cache is full; pass a larger --max-total-tokens or a smaller batch")
        offset = 0
        for r, p, s in zip(reqs, prefix_lens, seq_lens):
            self.runner.req_to_token_pool.write(r.req_pool_idx, p, loc[offset : offset + s - p])
            offset += s - p
            r.prefix_len = s
        return loc

    def _extend_batch(self, reqs: list[StaticReq], ends: list[int], return_logprob: bool) -> ForwardBatch:
        prefix_lens = [r.prefix_len for r in reqs]
        loc = self._alloc_kv(prefix_lens, ends, reqs)
        input_ids = [t for r, p, e in zip(reqs, prefix_lens, ends) for t in self._ids(r)[p:e]]
        extra: dict[str, Any] = {}
        runs, offset = [], 0
        for r, p, e in zip(reqs, prefix_lens, ends):
            runs += mm_runs(r.mm_items or (), p, e, offset)
            offset += e - p
        if runs:
            extra["mm_inputs"] = runs
        if any(it.grid is not None for r in reqs for it in r.mm_items or ()):
            positions = [mrope_positions(r.mm_items or (), p, e) for r, p, e in zip(reqs, prefix_lens, ends)]
            extra["mrope_positions"] = torch.cat(positions, dim=1).to(self.runner.device)
        if return_logprob:
            # Row j reads the logprob of the prompt token after it; the final row has none (its
            # next token is sampled), so any id will do there and the value is dropped.
            nxt = [t for r, p, e in zip(reqs, prefix_lens, ends) for t in (self._ids(r)[p + 1 : e + 1] + [0])[: e - p]]
            extra |= dict(
                return_logprob=True,
                top_logprobs_nums=[0] * len(reqs),
                extend_logprob_start_lens_cpu=[0] * len(reqs),
                extend_input_logprob_token_ids=torch.tensor(nxt, dtype=torch.int64).to(self.runner.device),
            )
        return ForwardBatch.build(
            ForwardMode.EXTEND,
            input_ids,
            [r.req_pool_idx for r in reqs],
            ends,
            prefix_lens,
            loc,
            self.runner.device,
            **extra,
        )

    @staticmethod
    def _ids(r: StaticReq) -> list[int]:
        return model_ids(r.origin_input_ids, r.mm_items) if r.mm_items else r.origin_input_ids

    def _prefill(self, reqs: list[StaticReq], chunk_size: int | None, return_logprob: bool) -> None:
        pending = list(reqs)
        while pending:
            ends = [
                len(r.origin_input_ids) if not chunk_size else min(len(r.origin_input_ids), r.prefix_len + chunk_size)
                for r in pending
            ]
            fb = self._extend_batch(pending, ends, return_logprob)
            out = self.forward(fb)
            done = [i for i, (r, e) in enumerate(zip(pending, ends)) if e == len(r.origin_input_ids)]
            if return_logprob:
                # an extend batch that asks for logprobs gets a row per prompt token
                assert out.input_token_logprobs is not None and fb.extend_seq_lens_cpu is not None
                values = out.input_token_logprobs.tolist()
                k = 0
                for i, (r, n) in enumerate(zip(pending, fb.extend_seq_lens_cpu)):
                    r.input_logprobs.extend(values[k : k + (n - 1 if i in done else n)])
                    k += n
            if done:
                self._sample_and_check([pending[i] for i in done], out.next_token_logits[done], return_logprob)
            pending = [r for i, r in enumerate(pending) if i not in done]

    def _decode(self, reqs: list[StaticReq], return_logprob: bool) -> int:
        """A decode step of reqs (or several: see `decode_steps`); returns how many."""
        if self.decode_steps > 1 and not return_logprob and not any(r.mm_items for r in reqs):
            info = SamplingBatchInfo.from_reqs(reqs, self.runner.model_config.vocab_size, self.eos, self.runner.device)
            left = max(
                (r.sampling_params.max_new_tokens or self.decode_steps) - len(r.output_ids) for r in reqs
            )  # no step past the longest request's budget
            room = min(self.runner.model_config.context_len - r.seq_len for r in reqs)
            steps = min(self.decode_steps, left, room)
            if info.vocab_mask is None and steps > 1:  # (penalties and bans move on inside the call)
                self._decode_steps(reqs, info, steps)
                return steps
        self._decode_one(reqs, return_logprob)
        return 1

    def _decode_steps(self, reqs: list[StaticReq], info: SamplingBatchInfo, steps: int) -> None:
        prefix_lens = [r.seq_len - 1 for r in reqs]  # the last token has no KV yet
        loc = self._alloc_kv(prefix_lens, [p + steps for p in prefix_lens], reqs)
        step_locs = loc.view(len(reqs), steps).t().contiguous()  # [steps, B]
        fb = ForwardBatch.build(
            ForwardMode.DECODE,
            [r.output_ids[-1] for r in reqs],
            [r.req_pool_idx for r in reqs],
            [p + 1 for p in prefix_lens],
            prefix_lens,
            step_locs[0],
            self.runner.device,
            sampling_info=info,
            decode_steps=steps,
            step_locs=step_locs,
        )
        ids = self.runner.decode_steps(fb).t().tolist()  # [B, steps]
        for r, row in zip(reqs, ids):
            for t in row:
                self._append(r, t)
                if r.finish_reason is not None:
                    break  # the tokens after a stop are dropped (their KV is freed with the request's)

    def _decode_one(self, reqs: list[StaticReq], return_logprob: bool) -> None:
        seq_lens = [r.seq_len for r in reqs]
        pool, allocator = self.runner.req_to_token_pool, self.runner.token_to_kv_pool_allocator
        idx, lens = torch.tensor([r.req_pool_idx for r in reqs]), torch.tensor(seq_lens)
        last = pool.host[idx, lens - 2].long() if allocator.page_size > 1 else None  # page 1: no page to continue
        loc = allocator.alloc_decode(lens, last)
        if loc is None:
            raise RuntimeError("KV cache is full; pass a larger --max-total-tokens or a smaller batch")
        pool.write_points(idx, lens - 1, loc)
        for r in reqs:
            r.prefix_len = r.seq_len
        fb = ForwardBatch.build(
            ForwardMode.DECODE,
            [r.output_ids[-1] for r in reqs],
            idx.tolist(),
            seq_lens,
            [s - 1 for s in seq_lens],
            loc,
            self.runner.device,
            positions=[s - 1 + sum(it.position_delta for it in r.mm_items or ()) for r, s in zip(reqs, seq_lens)],
            return_logprob=return_logprob,
            top_logprobs_nums=[0] * len(reqs),
        )
        self._sample_and_check(reqs, self.forward(fb).next_token_logits, return_logprob)

    def _sample_and_check(self, reqs: list[StaticReq], logits: torch.Tensor, return_logprob: bool) -> None:
        key = [id(r) for r in reqs]
        if self._step_info is not None and self._step_info[0] == key:
            info = self._step_info[1]
        else:
            info = SamplingBatchInfo.from_reqs(reqs, self.runner.model_config.vocab_size, self.eos, self.runner.device)
            # the same requests' next step samples the same way unless a processor keeps per-step state
            invariant = info.penalties is None and info.seeds is None and info.min_tokens_block is None
            self._step_info = (key, info) if invariant and info.vocab_mask is None else None
        logits_output = LogitsProcessorOutput(next_token_logits=logits)
        ids = self.runner.sampler(logits_output, info, return_logprob).tolist()
        logprobs = None
        if return_logprob:
            assert logits_output.next_token_logprobs is not None  # the sampler fills it when asked
            logprobs = logits_output.next_token_logprobs.tolist()
        for i, (r, t) in enumerate(zip(reqs, ids)):
            if r.sampling_params.max_new_tokens == 0:
                r.finish_reason = "length"
                continue
            if logprobs is not None:
                r.output_logprobs.append(logprobs[i])
            self._append(r, t)

    def _append(self, r: StaticReq, t: int) -> None:
        """r's next token t, then its stop conditions."""
        p = r.sampling_params
        r.output_ids.append(t)
        if (t in self.eos and not p.ignore_eos) or t in (p.stop_token_ids or ()):
            r.finish_reason = "stop"
        elif p.max_new_tokens is not None and len(r.output_ids) >= p.max_new_tokens:
            r.finish_reason = "length"
        elif r.seq_len >= self.runner.model_config.context_len:
            r.finish_reason = "length"

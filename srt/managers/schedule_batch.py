"""Request state (`Req`), the batch the scheduler runs (`ScheduleBatch`), and how a batch's
KV is allocated and its ForwardBatch built (`BatchBuilder`).

A request's KV lives in `req_to_token[req.req_pool_idx, :req.kv_len]`: the first
`len(req.prefix_indices)` slots belong to the prefix cache (locked through `req.last_node`), the
rest to the request until the cache takes them when it finishes. `kv_len` advances when a batch
is launched, before its results are known (the overlap scheduler builds the next batch then).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from srt.managers.io_struct import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_MATCHED_STR,
    FINISH_MATCHED_TOKEN,
    FINISHED_MATCHED_REGEX,
    BaseFinishReason,
)
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from srt.models.multimodal import MultimodalItem, mm_runs, model_ids, mrope_positions
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.sampling_params import STOP_REGEX_TAIL, SamplingParams

if TYPE_CHECKING:
    from xgrammar import GrammarMatcher

    from srt.speculative.draft_tree import DraftTree

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass(eq=False, kw_only=True)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    stream: bool = False
    priority: int | None = None
    tenant: str | None = None  # who sent it (API key or --tenant-header value); None: no tenants
    extra_key: str | None = None
    created_time: float = field(default_factory=time.time)
    # prefill-decode disaggregation (srt/disaggregation): the prefill server's bootstrap address
    # and the room naming this request on both servers; where its KV went and whether that ended
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    disagg_target: str | None = None
    disagg_done: bool = False
    # LoRA (srt/lora): the adapter it runs under (None: the base model) and, once admitted, its pool slot
    lora_name: str | None = None
    lora_slot: int = -1
    # images (a vision-language model): their rows hold pad values in origin_input_ids, the radix
    # key; the forward embeds the placeholder token there and overwrites the rows (srt/models/multimodal.py)
    mm_items: list[MultimodalItem] | None = None
    # pooling (srt/pooling): the request wants the last hidden state of its final prompt row (the
    # final norm's output) instead of tokens; the prefill result leaves it in `last_hidden`
    return_last_hidden: bool = False
    last_hidden: torch.Tensor | None = None

    # meta_info a component reports with the request's outputs (the weights' version); replaced,
    # never mutated, so an output carries it only when it changed (`meta_sent`: the one last sent)
    meta: dict | None = None
    meta_sent: dict | None = None

    output_ids: list[int] = field(default_factory=list)
    # memory
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: _EMPTY)
    last_node: object = None
    kv_len: int = 0  # slots allocated and written (or being written) by launched batches
    extend_input_len: int = 0  # tokens the next (or last launched) extend computes
    future_slot: int | None = None  # where a launched batch puts this request's next token
    # state
    finished_reason: BaseFinishReason | None = None
    to_abort: str | None = None
    cached_tokens: int = 0
    # of cached_tokens, where each part was found: (device, host, storage) (hierarchical cache)
    cached_tokens_details: tuple[int, int, int] = (0, 0, 0)
    host_hit_len: int = 0  # from match_prefix: tokens after prefix_indices cached in host memory
    last_host_node: Any = None
    prefetch_op: Any = None  # hierarchical cache: its pages being read from storage (a PrefetchOp)
    loaded_from_host: int = 0  # hierarchical cache: prompt tokens load_back moved to the device for it
    retractions: int = 0
    admitted: bool = False  # prefilled at least once (cached_tokens is from the first admission)
    last_token_time: float | None = None  # time.time() of the latest output token (metrics)
    # logprobs: lists of (logprob, token_id); top lists hold (logprobs, ids) or None
    input_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_ids_logprobs: list = field(default_factory=list)  # like the top lists
    output_token_ids_logprobs: list = field(default_factory=list)
    input_logprobs_done: bool = False
    # structured output: the xgrammar GrammarMatcher once the grammar compiled (srt/constrained)
    grammar: GrammarMatcher | None = None
    timeout: float | None = None  # seconds from arrival until the request is aborted
    # speculative decoding (srt/speculative): n-gram cache feeding, the draft model's cache,
    # adaptivity and SGLang's stats
    spec_fed: int = 0  # leading fill_ids tokens fed to the n-gram cache
    spec_open: list = field(default_factory=list)  # the cache's open n-gram nodes after them
    spec_accept_p: float = 0.6  # the proposer's estimate that its next draft is accepted
    spec_proposed: int = 0  # draft tokens verified
    draft_rows: list[int] = field(default_factory=list)  # STANDALONE: draft request-table rows, one per branch
    draft_kv_len: int = 0  # STANDALONE, EAGLE: confirmed tokens with KV in the draft cache
    # EAGLE: the target's hidden states of the positions from draft_kv_len on (tensors of rows, in
    # order), which the head has not consumed yet
    spec_hidden: list = field(default_factory=list)
    # [k] = decode steps that accepted k drafts (a step without drafts accepts 0): their sum is the
    # verify count, sum(k * [k]) the accepted drafts
    spec_histogram: list[int] = field(default_factory=list)
    # how much has been sent to the detokenizer
    sent_output_len: int = 0
    sent_input_logprob_len: int = 0
    sent_output_logprob_len: int = 0

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def position_delta(self) -> int:
        """How far positions run ahead of token indices after this request's images (M-RoPE)."""
        return sum(it.position_delta for it in self.mm_items) if self.mm_items else 0

    def model_ids(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] as the model embeds them: an image row is its placeholder token."""
        ids = self.fill_ids[start:end]
        return model_ids(ids, self.mm_items) if self.mm_items else ids

    @property
    def deadline(self) -> float | None:
        return None if self.timeout is None else self.created_time + self.timeout

    @property
    def kv_committed_len(self) -> int:
        """Leading tokens of fill_ids with KV: the last sampled token has none yet, and a step
        launched after the request finished computed KV for a token that was dropped."""
        return min(self.kv_len, len(self.origin_input_ids) + max(len(self.output_ids) - 1, 0))

    @property
    def needs_fresh_history(self) -> bool:
        """Sampling reads the output history (penalties, the min_new_tokens ban, the grammar), so the next step
        cannot be built while a token of this request is still pending."""
        p = self.sampling_params
        return (
            p.frequency_penalty != 0
            or p.presence_penalty != 0
            or p.repetition_penalty != 1
            or len(self.output_ids) < p.min_new_tokens
            or self.grammar is not None
        )

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def is_chunked(self) -> bool:
        """Still prefilling: some prompt tokens have no KV yet."""
        return self.kv_len + self.extend_input_len < self.seq_len

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and not self.input_logprobs_done

    @property
    def max_new_tokens(self) -> int | None:
        return self.sampling_params.max_new_tokens

    def cacheable_ids(self) -> list[int]:
        """The tokens whose KV may come from the cache: never the last one (its logits are
        needed), nor the rows prompt logprobs must be computed from."""
        limit = self.seq_len - 1
        if self.wants_input_logprobs:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return self.fill_ids[:limit]

    def match_prefix(self, tree_cache) -> None:
        """Look up the longest cached prefix (on the device; a hierarchical cache also reports
        the part after it in host memory)."""
        m = tree_cache.match_prefix(self.cacheable_ids(), self.extra_key)
        self.prefix_indices, self.last_node = m.device_indices, m.last_node
        self.host_hit_len, self.last_host_node = m.host_hit_len, m.last_host_node
        self.kv_len = len(self.prefix_indices)
        self.extend_input_len = self.seq_len - self.kv_len

    def check_finished(self, eos_token_ids: set[int], context_len: int, tokenizer=None) -> None:
        if self.finished:
            return
        if self.to_abort is not None:
            self.finished_reason = FINISH_ABORT(message=self.to_abort)
            return
        p = self.sampling_params
        n = len(self.output_ids)
        if n >= p.min_new_tokens and n:
            last = self.output_ids[-1]
            if last in (p.stop_token_ids or ()) or (not p.ignore_eos and last in eos_token_ids):
                self.finished_reason = FINISH_MATCHED_TOKEN(matched=last)
                return
            if p.stop_strs and tokenizer is not None:
                tail_len = max(len(s) for s in p.stop_strs) * 4 + 2
                tail = tokenizer.decode(self.output_ids[-tail_len:], skip_special_tokens=p.skip_special_tokens)
                for s in p.stop_strs:
                    if s in tail:
                        self.finished_reason = FINISH_MATCHED_STR(matched=s)
                        return
            if p.stop_regex_strs and tokenizer is not None:  # over the last STOP_REGEX_TAIL tokens' text
                tail = tokenizer.decode(self.output_ids[-STOP_REGEX_TAIL:], skip_special_tokens=p.skip_special_tokens)
                for pattern in p.stop_regex_strs:
                    if re.search(pattern, tail):
                        self.finished_reason = FINISHED_MATCHED_REGEX(matched=pattern)
                        return
        if p.max_new_tokens is not None and n >= p.max_new_tokens:
            self.finished_reason = FINISH_LENGTH(length=n)
        elif self.seq_len >= context_len:
            self.finished_reason = FINISH_LENGTH(length=n)

    def reset_for_retract(self, count: bool = True) -> None:
        self.prefix_indices, self.last_node, self.kv_len, self.extend_input_len = _EMPTY, None, 0, 0
        self.host_hit_len, self.last_host_node = 0, None
        self.retractions += count


@dataclass
class ScheduleBatch:
    reqs: list[Req]
    forward_mode: ForwardMode = ForwardMode.DECODE
    future_slots: list[int] | None = None  # set when launched
    # speculative: each request's draft tree (DECODE when they are all chains, else TARGET_VERIFY)
    spec_trees: list[DraftTree] | None = None
    kv_ends: list[int] | None = None  # each request's kv_len right after this batch was launched
    kv_starts: list[int] | None = None  # ... and right before (an extend's rows are its positions in between)
    # a DECODE batch that takes this many steps in one call of the model worker (a result row per step
    # and request: request i's rows are i * decode_steps ...; --num-continuous-decode-steps)
    decode_steps: int = 1
    # the call ends after the step in which this descriptor turns readable (ForwardBatch.interrupt_fd)
    interrupt_fd: int = -1
    # ... and after the step in which a request stops (ForwardBatch.stop_ids / stop_steps; None: not on stops)
    stop_ids: torch.Tensor | None = None
    stop_steps: torch.Tensor | None = None
    end_on_jump: bool = False  # ... and where a grammar forces a string (ForwardBatch.end_on_jump)

    def filter_finished(self) -> None:
        self.reqs = [r for r in self.reqs if not r.finished]


def _token_ids_logprobs(reqs: list[Req]) -> list[list[int] | None] | None:
    """Each request's `token_ids_logprob`, or None when no request of the batch asked."""
    if not any(r.return_logprob and r.token_ids_logprob for r in reqs):
        return None
    return [r.token_ids_logprob if r.return_logprob else None for r in reqs]


def _output_logprob_fields(reqs: list[Req]) -> dict[str, Any]:
    """The ForwardBatch fields for the logprobs of the tokens a decode or verify step samples."""
    return dict(
        return_logprob=any(r.return_logprob for r in reqs),
        top_logprobs_nums=[r.top_logprobs_num for r in reqs],
        token_ids_logprobs=_token_ids_logprobs(reqs),
    )


def _pool_indices(reqs: list[Req]) -> list[int]:
    out = []
    for r in reqs:
        assert r.req_pool_idx is not None, "a request in a batch holds a request slot"
        out.append(r.req_pool_idx)
    return out


class BatchBuilder:
    """Allocates KV for a batch, advances each request's kv_len, hands out future-token slots and
    builds the ForwardBatch. Works on the runner's pools and the prefix cache."""

    def __init__(self, req_to_token_pool, allocator, tree_cache, future_map, device: str):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.future_map = future_map
        self.device = device

    def build(self, batch: ScheduleBatch, vocab_size: int, eos_token_ids: set[int]) -> tuple[ForwardBatch, list[int]]:
        """The ForwardBatch for batch, and the future-map slot of each row's sampled token."""
        lora_slots = None
        if batch.spec_trees is None and any(r.lora_slot >= 0 for r in batch.reqs):
            # each adapter's rows in one segment (the LoRA kernels run per segment); stable: base rows first
            batch.reqs.sort(key=lambda r: r.lora_slot)
            lora_slots = [r.lora_slot for r in batch.reqs]
        batch.kv_starts = [r.kv_len for r in batch.reqs]
        if batch.spec_trees is not None:
            fb = self.prepare_for_verify(batch)
        elif batch.forward_mode.is_extend():
            fb = self.prepare_for_extend(batch)
        elif batch.decode_steps > 1:
            fb = self.prepare_for_decode_steps(batch)
        else:
            fb = self.prepare_for_decode(batch)
        fb.lora_slots_cpu = lora_slots
        if batch.spec_trees is not None:
            fb.sampling_info = SamplingBatchInfo.for_tree_rows(
                batch.reqs, batch.spec_trees, vocab_size, eos_token_ids, self.device
            )
        else:  # each row's sampled token sits right after the KV of the request's last token
            # (a continuous decode batch advanced kv_len by all its steps: its first step's position)
            positions = [r.kv_len - batch.decode_steps + 1 for r in batch.reqs]
            fb.sampling_info = SamplingBatchInfo.from_reqs(
                batch.reqs, vocab_size, eos_token_ids, self.device, positions=positions
            )
        slots = self.future_map.alloc(len(batch.reqs))
        for r, slot in zip(batch.reqs, slots):
            r.future_slot = slot
        batch.future_slots = slots
        batch.kv_ends = [r.kv_len for r in batch.reqs]
        return fb, slots

    def _input_ids(self, reqs: list[Req]) -> list[int]:
        """A decode batch's input ids: each request's last token, or -slot for one still being sampled
        by a launched batch (the overlap scheduler's; the worker swaps it in on the device)."""
        ids = [r.output_ids[-1] if r.future_slot is None else -r.future_slot for r in reqs]
        if not self.future_map.live and any(r.future_slot is not None for r in reqs):
            raise AssertionError("a decode batch feeds a token still being sampled, but no overlap worker records it")
        return ids

    def _ensure_free(self, n: int) -> None:
        if self.allocator.available_size() < n:
            self.tree_cache.evict(n - self.allocator.available_size())

    def _last_locs(self, reqs: list[Req], positions: list[int]) -> list[int]:
        if self.allocator.page_size == 1:  # no page to continue: the allocator reads none of them
            return [0] * len(reqs)
        pool = self.req_to_token_pool
        return [pool.last_slot(r.req_pool_idx, p - 1) if p > 0 else 0 for r, p in zip(reqs, positions)]

    def prepare_for_extend(self, batch: ScheduleBatch) -> ForwardBatch:
        reqs = batch.reqs
        for r in reqs:
            if r.req_pool_idx is None:
                slot = self.req_to_token_pool.alloc(1)
                assert slot is not None, "admission let in more requests than there are request slots"
                r.req_pool_idx = slot[0]
                self.req_to_token_pool.write(r.req_pool_idx, 0, r.prefix_indices)
        prefix_lens = [r.kv_len for r in reqs]
        seq_lens = [r.kv_len + r.extend_input_len for r in reqs]
        page = self.allocator.page_size
        self._ensure_free(sum(seq_lens) - sum(prefix_lens) + page * len(reqs))
        loc = self.allocator.alloc_extend(prefix_lens, seq_lens, self._last_locs(reqs, prefix_lens))
        if loc is None:
            raise RuntimeError("KV pool exhausted during extend; admission budget was wrong")
        offset = 0
        for r, p, s in zip(reqs, prefix_lens, seq_lens):
            self.req_to_token_pool.write(r.req_pool_idx, p, loc[offset : offset + s - p])
            offset += s - p
        input_ids = [t for r, p, s in zip(reqs, prefix_lens, seq_lens) for t in r.model_ids(p, s)]
        extra = self._logprob_fields(reqs, prefix_lens, seq_lens)
        if any(r.mm_items for r in reqs):
            runs, offset = [], 0
            for r, p, s in zip(reqs, prefix_lens, seq_lens):
                runs += mm_runs(r.mm_items or (), p, s, offset)
                offset += s - p
            extra["mm_inputs"] = runs or None
            if any(it.grid is not None for r in reqs for it in r.mm_items or ()):
                positions = [mrope_positions(r.mm_items or (), p, s) for r, p, s in zip(reqs, prefix_lens, seq_lens)]
                extra["mrope_positions"] = torch.cat(positions, dim=1).to(self.device)
        if any(r.return_last_hidden for r in reqs):
            extra["return_last_hidden"] = True
        for r, s in zip(reqs, seq_lens):
            r.kv_len = s
        return ForwardBatch.build(
            ForwardMode.EXTEND,
            input_ids,
            _pool_indices(reqs),
            seq_lens,
            prefix_lens,
            loc,
            self.device,
            **extra,
        )

    def _logprob_fields(self, reqs, prefix_lens, seq_lens) -> dict:
        if not any(r.return_logprob for r in reqs):
            return {}
        starts, next_tokens = [], []
        for r, p, s in zip(reqs, prefix_lens, seq_lens):
            if r.wants_input_logprobs:
                first_row = max(max(r.logprob_start_len - 1, 0), p)
            else:
                first_row = s  # no rows
            starts.append(min(first_row, s) - p)
            ids = r.model_ids(0, r.seq_len) if r.mm_items else r.fill_ids
            next_tokens.extend(ids[j + 1] if j + 1 < len(ids) else 0 for j in range(min(first_row, s), s))
        return dict(
            return_logprob=True,
            top_logprobs_nums=[r.top_logprobs_num for r in reqs],
            token_ids_logprobs=_token_ids_logprobs(reqs),
            extend_logprob_start_lens_cpu=starts,
            extend_input_logprob_token_ids=torch.tensor(next_tokens, dtype=torch.int64).to(self.device),
        )

    def rows_slots_needed(self, req: Req, rows: int) -> int:
        """Free slots (whole pages) that `rows` new positions after req's KV take."""
        p = self.allocator.page_size
        return (-(-(req.kv_len + rows) // p) - -(-req.kv_len // p)) * p

    def prepare_for_verify(self, batch: ScheduleBatch) -> ForwardBatch:
        """Each request's last token and its draft tree, in the tree's BFS order, at the positions
        of the nodes' depths. Chains (a DECODE batch) run as decode rows, one per node, each seeing
        its request's KV up to itself: the decode kernels, fused layers and graphs verify them. Trees
        (TARGET_VERIFY) run as one extend per request with the tree mask."""
        reqs, trees = batch.reqs, batch.spec_trees
        assert trees is not None and len(trees) == len(reqs), "the scheduler drafts before it launches"
        prefix_lens = [r.kv_len for r in reqs]
        seq_lens = [p + len(t) for p, t in zip(prefix_lens, trees)]
        self._ensure_free(sum(self.rows_slots_needed(r, len(t)) for r, t in zip(reqs, trees)))
        loc = self.allocator.alloc_extend(prefix_lens, seq_lens, self._last_locs(reqs, prefix_lens))
        if loc is None:
            raise RuntimeError("KV pool exhausted during verify; drafting should have fit its trees")
        offset, input_ids, row0 = 0, [], []
        for r, p, s, t in zip(reqs, prefix_lens, seq_lens, trees):
            self.req_to_token_pool.write(r.req_pool_idx, p, loc[offset : offset + s - p])
            row0.append(offset)
            offset += s - p
            input_ids += [r.output_ids[-1], *t.tokens[1:]]
            r.kv_len = s  # until the result says how many rows are kept
        # every row is sampled (as its request's token after the node's path) and gets logprobs
        common = _output_logprob_fields([r for r, t in zip(reqs, trees) for _ in range(len(t))])
        common["spec_row0"] = torch.tensor(row0, dtype=torch.int64).to(self.device, non_blocking=True)
        if batch.forward_mode.is_decode():
            rows_seq = [p + d + 1 for p, t in zip(prefix_lens, trees) for d in t.depths]
            rows_pool = [i for i, t in zip(_pool_indices(reqs), trees) for _ in range(len(t))]
            rows_prefix = [n - 1 for n in rows_seq]
            return ForwardBatch.build(
                ForwardMode.DECODE, input_ids, rows_pool, rows_seq, rows_prefix, loc, self.device, **common
            )
        positions = [p + d for p, t in zip(prefix_lens, trees) for d in t.depths]
        masks = [torch.tensor(t.ancestors_mask(), dtype=torch.bool).to(self.device, non_blocking=True) for t in trees]
        return ForwardBatch.build(
            ForwardMode.TARGET_VERIFY,
            input_ids,
            _pool_indices(reqs),
            seq_lens,
            prefix_lens,
            loc,
            self.device,
            positions=positions,
            tree_masks=masks,
            **common,
        )

    def prepare_for_decode_steps(self, batch: ScheduleBatch) -> ForwardBatch:
        """A decode batch that takes `batch.decode_steps` steps in one call: each request's KV slots
        for all of them up front (its kv_len advances by the steps; a request that stops early gives
        the rest back when it is released), step s's slots in `step_locs[s]`."""
        reqs, steps = batch.reqs, batch.decode_steps
        prefix_lens = [r.kv_len for r in reqs]
        self._ensure_free(sum(self.rows_slots_needed(r, steps) for r in reqs))
        ends = [p + steps for p in prefix_lens]
        loc = self.allocator.alloc_extend(prefix_lens, ends, self._last_locs(reqs, prefix_lens))
        if loc is None:
            raise RuntimeError("KV pool exhausted during continuous decode; planning should have fit its steps")
        for i, (r, p) in enumerate(zip(reqs, prefix_lens)):
            self.req_to_token_pool.write(r.req_pool_idx, p, loc[i * steps : (i + 1) * steps])
            r.kv_len = p + steps
        step_locs = loc.view(len(reqs), steps).t().contiguous()  # [steps, B]
        positions = None
        if any(r.mm_items for r in reqs):  # after M-RoPE images, positions run ahead of indices
            positions = [p + r.position_delta for r, p in zip(reqs, prefix_lens)]
        return ForwardBatch.build(
            ForwardMode.DECODE,
            self._input_ids(reqs),
            _pool_indices(reqs),
            [p + 1 for p in prefix_lens],
            prefix_lens,
            step_locs[0],
            self.device,
            positions=positions,
            decode_steps=steps,
            step_locs=step_locs.to(self.device, non_blocking=True),
            interrupt_fd=batch.interrupt_fd,
            stop_ids=batch.stop_ids,
            stop_steps=batch.stop_steps,
            end_on_jump=batch.end_on_jump,
            **_output_logprob_fields(reqs),
        )

    def decode_slots_needed(self, reqs: list[Req]) -> int:
        return sum(self.rows_slots_needed(r, 1) for r in reqs)

    def prepare_for_decode(self, batch: ScheduleBatch) -> ForwardBatch:
        reqs = batch.reqs
        prefix_lens = [r.kv_len for r in reqs]
        seq_lens = [p + 1 for p in prefix_lens]
        self._ensure_free(self.decode_slots_needed(reqs))
        if self.allocator.page_size == 1:  # a slot a request, nothing to continue
            loc = self.allocator.alloc(len(reqs))
        else:
            loc = self.allocator.alloc_decode(torch.tensor(seq_lens), torch.tensor(self._last_locs(reqs, prefix_lens)))
        if loc is None:
            raise RuntimeError("KV pool exhausted during decode; retraction should have made room")
        pool_indices = _pool_indices(reqs)
        self.req_to_token_pool.write_points(torch.tensor(pool_indices), torch.tensor(prefix_lens), loc)
        # A token still being sampled by a launched batch is fed as -slot; the worker swaps it in.
        input_ids = self._input_ids(reqs)
        for r in reqs:
            r.kv_len += 1
        positions = None
        if any(r.mm_items for r in reqs):  # after M-RoPE images, positions run ahead of indices
            positions = [p + r.position_delta for r, p in zip(reqs, prefix_lens)]
        return ForwardBatch.build(
            ForwardMode.DECODE,
            input_ids,
            pool_indices,
            seq_lens,
            prefix_lens,
            loc,
            self.device,
            positions=positions,
            **_output_logprob_fields(reqs),
        )

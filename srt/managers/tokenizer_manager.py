"""The TokenizerManager: runs in the HTTP (or Engine) process on asyncio.

It validates and tokenizes requests, sends them to the scheduler, and turns the detokenizer's
deltas back into each request's response: one final answer per accepted request, or a stream of
cumulative chunks ending in the final one.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncGenerator
from typing import Any, cast

import orjson
import zmq
import zmq.asyncio

from srt.hf_transformers_utils import get_tokenizer
from srt.lora.adapter import LoRARef, not_loaded, parse_lora_paths
from srt.managers.io_struct import (
    FINISH_ABORT,
    FINISH_LENGTH,
    AbortReq,
    BaseFinishReason,
    BatchEmbeddingOutput,
    BatchStrOutput,
    CloseSessionReq,
    CloseSessionReqOutput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    InvalidRequest,
    LoadLoRAAdapterReq,
    LoRAUpdateOutput,
    ProfileReq,
    ProfileReqOutput,
    SchedulerCrashed,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReq,
    WeightsReq,
    WeightsReqOutput,
    new_rid,
)
from srt.managers.scheduler_state import SchedulerState
from srt.models.multimodal import MultimodalItem
from srt.multimodal.media import MediaError
from srt.multimodal.processors import ImagePrompts, image_prompts_for
from srt.pooling.inputs import Pooled, PoolingPrompt
from srt.qos.tenants import DEFAULT_TENANT, RateLimited, TenantLimiter, load_tenant_config
from srt.sampling.sampling_params import DEFAULT_SAMPLING_SEED, SamplingParams
from srt.server_args import PortArgs, ServerArgs
from srt.sessions.store import SessionPrompt, SessionStore
from srt.utils import zmq_socket

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20
MAX_TOKEN_IDS_LOGPROB = 256  # ids per request in `token_ids_logprob`
DISCONNECT_POLL_S = 1.0


class ServiceUnavailable(RuntimeError):
    """The server cannot take the request now (draining, or a worker died); HTTP 503."""

    status = 503
    retry_after: int | None = None


class Overloaded(ServiceUnavailable):
    """Admission is full (--max-queued-requests / --max-queued-tokens); HTTP 503 with Retry-After."""

    retry_after = 1


class TooManyRequests(ServiceUnavailable):
    """The request's tenant is over a budget (--tenant-config, --tenant-*); HTTP 429 with Retry-After."""

    status = 429

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


def tenant_name(tenant: str | None) -> str:
    """A tenant's name in limits, /metrics and the dashboard: its --tenant-config name, its
    --tenant-header value, a hash of its API key, or "default"."""
    return tenant.split(":", 1)[1] if tenant else DEFAULT_TENANT


LOG_CLIP_CHARS = 1000


def _clip(text: str | None) -> str | None:
    """The first and last LOG_CLIP_CHARS characters of a long text."""
    if text is None or len(text) <= 2 * LOG_CLIP_CHARS:
        return text
    return f"{text[:LOG_CLIP_CHARS]}...({len(text) - 2 * LOG_CLIP_CHARS} characters)...{text[-LOG_CLIP_CHARS:]}"


ControlReply = (
    FlushCacheReqOutput
    | GetInternalStateReqOutput
    | ProfileReqOutput
    | LoRAUpdateOutput
    | WeightsReqOutput
    | CloseSessionReqOutput
)


def _merged(replies: list) -> dict:
    """success and message of one control call from every replica's reply (distinct failures joined)."""
    failed = [r.message for r in replies if not r.success]
    return {"success": not failed, "message": "; ".join(dict.fromkeys(failed))}


@dataclasses.dataclass
class ReqState:
    obj: GenerateReqInput
    created: float
    event: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    text: str = ""
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: BaseFinishReason | None = None
    finished: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_details: tuple[int, int, int] = (0, 0, 0)
    retractions: int = 0
    image_tokens: int = 0  # prompt rows the request's images fill
    input_token_logprobs: list = dataclasses.field(default_factory=list)
    input_top_logprobs: list = dataclasses.field(default_factory=list)
    output_token_logprobs: list = dataclasses.field(default_factory=list)
    output_top_logprobs: list = dataclasses.field(default_factory=list)
    input_token_ids_logprobs: list = dataclasses.field(default_factory=list)
    output_token_ids_logprobs: list = dataclasses.field(default_factory=list)
    dp_rank: int = 0
    meta: dict = dataclasses.field(default_factory=dict)  # what the scheduler's components report (Req.meta)
    tenant: str | None = None  # the cache tenant (API key or --tenant-header), for the dashboard
    input_len: int = 0
    spec: tuple[int, list[int]] | None = None  # speculative: drafts proposed, steps by accepted drafts
    embedding: Any = None  # a pooling request's vector (numpy float32)


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, scheduler_info: dict):
        self.server_args = server_args
        tokenizer_path = server_args.tokenizer_path or server_args.model_path
        assert tokenizer_path is not None, "ServerArgs.model_path is required"
        self.tokenizer = get_tokenizer(tokenizer_path)
        self.scheduler_info = scheduler_info
        self.context_len = scheduler_info["context_len"]
        self.max_total_num_tokens = scheduler_info["max_total_num_tokens"]
        self.vocab_size = scheduler_info["vocab_size"]
        self.modalities: list[str] = scheduler_info.get("modalities", ["text"])
        self.image_prompts: ImagePrompts | None = None
        if "image" in self.modalities:
            self.image_prompts = image_prompts_for(server_args, self.tokenizer)
        self.zmq_ctx = zmq.asyncio.Context(2)
        self.recv_from_detokenizer = zmq_socket(self.zmq_ctx, zmq.PULL, port_args.tokenizer_input, bind=True)
        self.send_to_scheduler = zmq_socket(self.zmq_ctx, zmq.PUSH, port_args.scheduler_input, bind=False)
        self.rid_to_state: dict[str, ReqState] = {}
        self.inflight_prompt_tokens = 0
        # per-tenant budgets (srt/qos/tenants.py); None when no tenant has a limit
        tenants = load_tenant_config(server_args)
        self.tenant_limiter = TenantLimiter(tenants) if tenants.enabled else None
        self.tenant_inflight: Counter[str] = Counter()
        # open sessions' token trees (srt/sessions/store.py)
        bos = self.tokenizer.bos_token_id
        self.sessions = SessionStore(server_args.dp_size, bos if isinstance(bos, int) else None)
        self.num_replicas = server_args.dp_size
        # by control request rid: the replies so far, and the future the caller awaits
        self.control_waiters: dict[str, tuple[list, asyncio.Future]] = {}
        self.draining = False
        self.dead_reason: str | None = None
        self.handle_loop_task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # LoRA adapters requests may name (name -> path), as the schedulers last reported them
        self.lora_adapters: dict[str, str] = {}
        if server_args.enable_lora:
            self.lora_adapters = {r.name: r.path for r in parse_lora_paths(server_args.lora_paths)}
        # the weights' version (--weight-version, then each update's): meta_info of outputs that
        # carry none of their own
        self.weight_version = server_args.weight_version
        # /configure_logging changes these at run time
        self.log_requests = server_args.log_requests
        self.log_requests_level = server_args.log_requests_level

    def close(self) -> None:
        """Close the sockets and the ZeroMQ context, once the receive loop has stopped (an
        in-process Engine's shutdown): a context left to the garbage collector with sockets open
        blocks whatever code the collector interrupts, forever."""
        self.recv_from_detokenizer.close(linger=0)
        self.send_to_scheduler.close(linger=0)
        self.zmq_ctx.term()

    def start(self) -> None:
        """Start receiving outputs; call from the event loop that will serve requests."""
        if self.handle_loop_task is None:
            self.loop = asyncio.get_running_loop()
            self.handle_loop_task = self.loop.create_task(self.handle_loop())

    @property
    def max_req_input_len(self) -> int:
        return min(self.context_len, self.max_total_num_tokens) - 1

    # -- requests ------------------------------------------------------------------------------

    def _admit(self, requests: int, prompt_tokens: int) -> None:
        """Bounded admission: beyond the running capacity plus --max-queued-requests (or the KV pool
        plus --max-queued-tokens of prompt tokens in flight), answer 503 at once."""
        args = self.server_args
        # with priorities the scheduler bounds its waiting queue, refusing the least urgent request
        if args.max_queued_requests is not None and not args.enable_priority_scheduling:
            limit = self.scheduler_info["max_running_requests"] * args.dp_size + args.max_queued_requests
            if len(self.rid_to_state) + requests > limit:
                raise Overloaded(
                    f"the server is at capacity: {len(self.rid_to_state)} requests in flight, limit "
                    f"{limit} (--max-running-requests + --max-queued-requests); retry later"
                )
        if args.max_queued_tokens is not None:
            limit = self.max_total_num_tokens * args.dp_size + args.max_queued_tokens
            if self.inflight_prompt_tokens + prompt_tokens > limit:
                raise Overloaded(
                    f"the server is at capacity: {self.inflight_prompt_tokens} prompt tokens in flight, "
                    f"this request adds {prompt_tokens}, limit {limit} (KV pool + --max-queued-tokens); "
                    f"retry later"
                )

    def _check_accepting(self) -> None:
        if self.dead_reason:
            raise ServiceUnavailable(f"the server is not serving: {self.dead_reason}")
        if self.draining:
            raise ServiceUnavailable("the server is shutting down and accepts no new requests")

    def prompt_ids(self, obj: GenerateReqInput) -> list[int]:
        """One prompt's token ids (an item of a validated request holds one prompt, text or ids)."""
        text = cast("str | None", obj.text)
        if text is not None:
            return self.tokenizer.encode(text)
        ids = list(cast("list[int]", obj.input_ids))
        for i, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise InvalidRequest(f"input_ids[{i}] = {t} is out of range [0, {self.vocab_size})")
        return ids

    async def expand_images(self, obj: GenerateReqInput) -> tuple[list[int], list[MultimodalItem]] | None:
        """The prompt with its images' placeholders expanded (pad values at the image rows) and the
        images' items; None for a prompt without images. Files, fetches and preprocessing run in a
        worker thread."""
        images, labels = obj.images()
        if not images:
            return None
        if self.image_prompts is None:
            raise InvalidRequest(
                f"{labels[0]}: this model ({self.server_args.served_model_name or self.server_args.model_path}) "
                "accepts text only, not images"
            )
        ids = self.prompt_ids(obj)
        try:
            return await asyncio.to_thread(self.image_prompts.expand, ids, images, labels)
        except MediaError as e:
            raise InvalidRequest(str(e)) from None

    def tokenize(
        self,
        obj: GenerateReqInput,
        tenant: str | None = None,
        prompt: tuple[list[int], list[MultimodalItem]] | None = None,
    ) -> TokenizedGenerateReqInput:
        """One prompt (obj.item(i)) -> a validated, tokenized request (`prompt`: its ids and images
        from expand_images)."""
        text = cast("str | None", obj.text)
        ids, mm_items = prompt if prompt is not None else (self.prompt_ids(obj), None)
        session: SessionPrompt | None = None
        if obj.session_params is not None:
            if mm_items:
                raise InvalidRequest("session_params cannot be combined with images")
            session = self.sessions.prompt(obj.session_params, ids, tenant)
            ids = session.input_ids
        if not ids:
            raise InvalidRequest("the prompt is empty after tokenization")
        params = SamplingParams.from_dict(cast("dict | None", obj.sampling_params))
        params.verify(self.vocab_size)
        if self.server_args.enable_deterministic_inference and params.sampling_seed is None:
            params.sampling_seed = DEFAULT_SAMPLING_SEED  # unseeded requests repeat too (SGLang's default)
        cap = self.server_args.max_new_tokens_cap
        if cap is not None and params.max_new_tokens is not None and params.max_new_tokens > cap:
            raise InvalidRequest(
                f"sampling_params.max_new_tokens = {params.max_new_tokens} exceeds this server's "
                f"cap of {cap} (--max-new-tokens-cap)"
            )
        n = len(ids)
        if n > self.max_req_input_len:
            raise InvalidRequest(f"the prompt has {n} tokens, more than the maximum of {self.max_req_input_len}")
        max_new = params.max_new_tokens
        if max_new is None:
            max_new = min(self.context_len, self.max_total_num_tokens) - n
            if cap is not None:
                max_new = min(max_new, cap)
            params.max_new_tokens = max_new
        if n + max_new > self.context_len:
            raise InvalidRequest(
                f"prompt ({n} tokens) + max_new_tokens ({max_new}) = "
                f"{n + max_new} exceeds the context length ({self.context_len})"
            )
        if n + max_new > self.max_total_num_tokens:
            raise InvalidRequest(
                f"prompt ({n} tokens) + max_new_tokens ({max_new}) = "
                f"{n + max_new} exceeds the KV cache capacity "
                f"({self.max_total_num_tokens} tokens)"
            )
        start = obj.logprob_start_len if obj.logprob_start_len is not None else -1
        if not isinstance(start, int) or isinstance(start, bool) or not -1 <= start <= n:
            raise InvalidRequest(f"logprob_start_len = {start!r} must be an integer in [-1, {n}] (prompt tokens)")
        top = obj.top_logprobs_num or 0
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs_num = {top!r} must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        asked = self._token_ids_logprob(obj.token_ids_logprob)
        if obj.priority is not None and (not isinstance(obj.priority, int) or isinstance(obj.priority, bool)):
            raise InvalidRequest(f"priority = {obj.priority!r} must be an integer")
        rid = obj.rid or new_rid()
        if not isinstance(rid, str):
            raise InvalidRequest(f"rid = {rid!r} must be a string")
        if rid in self.rid_to_state:
            raise InvalidRequest(f"rid {rid!r} is already in use by a running request")
        extra_key = obj.extra_key
        if extra_key is not None and not isinstance(extra_key, str):
            raise InvalidRequest(f"extra_key = {extra_key!r} must be a string")
        if tenant is not None:  # namespaced by the server-side tenant: a client cannot reach another's cache
            extra_key = f"{tenant}\x00{extra_key or ''}"
        dp_rank = obj.data_parallel_rank
        if dp_rank is not None and (
            not isinstance(dp_rank, int) or isinstance(dp_rank, bool) or not 0 <= dp_rank < self.server_args.dp_size
        ):
            raise InvalidRequest(
                f"data_parallel_rank = {dp_rank!r} must be an integer in [0, {self.server_args.dp_size}) (--dp-size)"
            )
        host, port, room = self._bootstrap(obj)
        lora_name = self._lora_name(obj.lora_path)
        if session is not None and self.server_args.dp_size > 1:
            dp_rank = session.dp_rank  # a session's requests run on one replica, where its KV is
        return TokenizedGenerateReqInput(
            rid=rid,
            input_text=text,
            input_ids=ids,
            sampling_params=params,
            return_logprob=bool(obj.return_logprob) or asked is not None,
            logprob_start_len=start,
            top_logprobs_num=top,
            token_ids_logprob=asked,
            stream=obj.stream,
            priority=obj.priority,
            tenant=tenant,
            extra_key=extra_key,
            created_time=time.time(),
            timeout=self._timeout(obj.timeout),
            data_parallel_rank=dp_rank,
            lora_name=lora_name,
            bootstrap_host=host,
            bootstrap_port=port,
            bootstrap_room=room,
            mm_items=mm_items,
            session_id=session.session_id if session is not None else None,
            session_parent=session.parent if session is not None else None,
            session_replace=session.replace if session is not None else False,
        )

    def _bootstrap(self, obj: GenerateReqInput) -> tuple[str | None, int | None, int | None]:
        """One prompt's (bootstrap_host, bootstrap_port, bootstrap_room), checked; all None on a
        server that is not disaggregated (routers add them to every body) or without a room."""
        host, port, room = obj.bootstrap_host, obj.bootstrap_port, obj.bootstrap_room
        if room is not None and (not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 2**64):
            raise InvalidRequest(f"bootstrap_room = {room!r} must be an integer in [0, 2**64)")
        if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535):
            raise InvalidRequest(f"bootstrap_port = {port!r} must be an integer in [1, 65535]")
        if host is not None and (not isinstance(host, str) or not host or len(host) > 255):
            raise InvalidRequest(f"bootstrap_host = {host!r} must be a host name or address")
        mode = self.server_args.disaggregation_mode
        if mode == "null" or room is None:
            return None, None, None
        if mode == "decode" and (host is None or port is None):
            raise InvalidRequest(
                "bootstrap_host and bootstrap_port (the prefill server's bootstrap server) are required with "
                "bootstrap_room on a --disaggregation-mode decode server"
            )
        return host, port, room

    def _require_lora(self, what: str) -> None:
        if not self.server_args.enable_lora:
            raise InvalidRequest(f"{what}: this server serves no LoRA adapters (start it with --enable-lora)")

    def _lora_name(self, lora_path) -> str | None:
        """The adapter a prompt runs under: `lora_path` names it (or gives its registered path)."""
        if lora_path is None:
            return None
        if not isinstance(lora_path, str):
            raise InvalidRequest(f"lora_path = {lora_path!r} must be an adapter name, or null for the base model")
        self._require_lora(f"lora_path = {lora_path!r}")
        if lora_path in self.lora_adapters:
            return lora_path
        by_path = next((n for n, p in self.lora_adapters.items() if p == lora_path), None)
        if by_path is None:
            raise InvalidRequest(not_loaded(f"LoRA adapter {lora_path!r}", self.lora_adapters))
        return by_path

    def _token_ids_logprob(self, ids) -> list[int] | None:
        """`token_ids_logprob` of one prompt: distinct-or-not token ids, at most MAX_TOKEN_IDS_LOGPROB."""
        if ids is None:
            return None
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequest(f"token_ids_logprob = {ids!r} must be a non-empty list of token ids")
        if len(ids) > MAX_TOKEN_IDS_LOGPROB:
            raise InvalidRequest(
                f"token_ids_logprob has {len(ids)} ids, more than the limit of {MAX_TOKEN_IDS_LOGPROB}"
            )
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token_ids_logprob holds {bad}, out of range [0, {self.vocab_size})")
        return list(ids)

    def _timeout(self, given) -> float | None:
        default = self.server_args.request_timeout
        if given is None:
            return default
        if not isinstance(given, (int, float)) or isinstance(given, bool) or not math.isfinite(given) or given <= 0:
            raise InvalidRequest(f"timeout = {given!r} must be a number of seconds > 0")
        return min(given, default) if default is not None else float(given)

    async def generate_request(self, obj: GenerateReqInput, request=None) -> AsyncGenerator[dict | list[dict], None]:
        """Yields outputs: for one prompt with n = 1, its stream of dicts (or the final dict);
        otherwise the final flat list, or, when streaming, each item's dicts with an `index`."""
        self._check_accepting()
        obj.validate()
        tenant = getattr(request.state, "tenant", None) if request is not None else None
        items = [obj.item(i) for i in range(obj.batch_size)]
        tokenized = [self.tokenize(item, tenant, await self.expand_images(item)) for item in items]
        n = tokenized[0].sampling_params.n
        if any(t.sampling_params.n != n for t in tokenized):
            raise InvalidRequest("all prompts of a batch must use the same sampling_params.n")
        rooms = [t.bootstrap_room for t in tokenized if t.bootstrap_room is not None]
        if rooms and n > 1:
            raise InvalidRequest(
                f"n = {n}: prefill-decode disaggregation transfers one KV per bootstrap_room; use n = 1"
            )
        if n > 1 and any(t.session_id is not None for t in tokenized):
            raise InvalidRequest(f"n = {n}: a session request continues one request; use n = 1")
        if len(set(rooms)) < len(rooms):
            raise InvalidRequest(
                f"the batch's {len(tokenized)} prompts share a bootstrap_room: give one room per prompt (a list)"
            )
        self._check_rids([f"{t.rid}_{k}" if n > 1 else t.rid for t in tokenized for k in range(n)])
        self._admit(len(tokenized) * n, sum(len(t.input_ids) for t in tokenized) * n)
        if self.tenant_limiter is not None:
            name = tenant_name(tenant)
            try:
                self.tenant_limiter.admit(
                    name, len(tokenized) * n, sum(len(t.input_ids) for t in tokenized) * n, self.tenant_inflight[name]
                )
            except RateLimited as e:
                raise TooManyRequests(str(e), e.retry_after) from None
        for t in tokenized:  # admitted: session requests join their session's tree
            if t.session_id is not None:
                self.sessions.add(
                    SessionPrompt(t.session_id, t.session_parent, t.session_replace, t.input_ids, 0), t.rid
                )
        if not obj.is_batch and n == 1:
            async for out in self._wait_one(items[0], tokenized[0], request):
                yield out
            return
        if n > 1 and not self.server_args.disable_radix_cache:
            await self._cache_prefixes(items, tokenized, request)
        jobs = []
        for item, tok in zip(items, tokenized):
            for k in range(n):
                t = copy.copy(tok)
                t.rid = f"{tok.rid}_{k}" if n > 1 else tok.rid
                t.sampling_params = copy.copy(tok.sampling_params)
                if n > 1 and t.sampling_params.sampling_seed is not None:
                    t.sampling_params.sampling_seed += k
                jobs.append((item, t))
        gens = [self._wait_one(item, t, request) for item, t in jobs]
        if not obj.stream:
            outs = await asyncio.gather(*(self._last(g) for g in gens))
            # an item is None only when the client went away, and then nobody reads the list
            yield cast("list[dict]", outs)
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, g):
            try:
                async for out in g:
                    await queue.put((i, out))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        try:
            remaining = len(tasks)
            while remaining:
                i, out = await queue.get()
                if out is None:
                    remaining -= 1
                    continue
                yield {**out, "index": i}
        finally:
            for t in tasks:
                t.cancel()

    def _check_rids(self, rids: list[str]) -> None:
        """Each of a request's rids once, and none of a request still running (outputs and aborts are
        routed by rid: a repeated one would leave one of its requests without an answer)."""
        seen: set[str] = set()
        for rid in rids:
            if rid in seen:
                raise InvalidRequest(f"rid {rid!r} appears more than once in the batch: give each prompt its own rid")
            if rid in self.rid_to_state:
                raise InvalidRequest(f"rid {rid!r} is already in use by a running request")
            seen.add(rid)

    @staticmethod
    async def _last(gen) -> dict | None:
        """The generator's last output; None when it ended without one (the client went away)."""
        last = None
        async for out in gen:
            last = out
        return last

    async def _cache_prefixes(self, items, tokenized, request) -> None:
        """Prefill each prompt once (max_new_tokens 0) so the n samples share its cached KV."""
        warmups = []
        for item, tok in zip(items, tokenized):
            t = copy.copy(tok)
            t.rid, t.stream, t.return_logprob = new_rid(), False, False
            t.sampling_params = dataclasses.replace(tok.sampling_params, max_new_tokens=0, n=1)
            warmups.append(self._last(self._wait_one(dataclasses.replace(item, stream=False), t, request)))
        await asyncio.gather(*warmups)

    async def _wait_one(
        self, obj: GenerateReqInput, tok: TokenizedGenerateReqInput, request
    ) -> AsyncGenerator[dict, None]:
        state = ReqState(obj, time.time(), image_tokens=sum(it.num_rows for it in tok.mm_items or ()))
        state.tenant = getattr(request.state, "tenant", None) if request is not None else None
        state.input_len = len(tok.input_ids)
        if tok.rid in self.rid_to_state:  # taken since the check, by a request that arrived meanwhile
            raise InvalidRequest(f"rid {tok.rid!r} is already in use by a running request")
        self.rid_to_state[tok.rid] = state
        self.inflight_prompt_tokens += len(tok.input_ids)
        name = tenant_name(state.tenant)
        self.tenant_inflight[name] += 1
        self.send_to_scheduler.send_pyobj(tok)
        try:
            while True:
                try:
                    await asyncio.wait_for(state.event.wait(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if request is not None and await request.is_disconnected():
                        logger.info("client disconnected; aborting request %s", tok.rid)
                        return
                    continue
                if self.dead_reason and not state.finished:
                    raise ServiceUnavailable(f"the server stopped serving: {self.dead_reason}")
                state.event.clear()
                reason = state.finish_reason
                if isinstance(reason, FINISH_ABORT) and reason.status_code == 400 and not state.output_ids:
                    raise InvalidRequest(reason.message)
                if isinstance(reason, FINISH_ABORT) and reason.status_code == 503 and not state.output_ids:
                    raise Overloaded(reason.message)  # refused by a full queue (srt/qos): retry later
                out = self._make_output(tok.rid, state)
                if state.finished:
                    if self.log_requests:
                        self._log_finished(tok, out)
                    if tok.session_id is not None:
                        # before the answer leaves: a client's next turn may name this request at once, and
                        # the `finally` below runs only when the caller closes this generator, maybe later
                        self.sessions.finished(tok.session_id, tok.rid, state.output_ids)
                    yield out
                    return
                if obj.stream:
                    yield out
        finally:
            if not state.finished:
                self.abort_request(tok.rid)
            if self.rid_to_state.pop(tok.rid, None) is not None:
                self.inflight_prompt_tokens -= len(tok.input_ids)
            self.tenant_inflight[name] -= 1
            if tok.session_id is not None:
                self.sessions.finished(tok.session_id, tok.rid, state.output_ids)
            if self.tenant_limiter is not None:
                self.tenant_limiter.charge(name, state.completion_tokens)

    async def pool(self, prompts: list[PoolingPrompt], request=None, tenant: str | None = None) -> list[Pooled]:
        """Pool each prompt (an embedding, or a classifier's logits), as one batch of requests: every
        one answers, or the first failure raises and the rest are aborted."""
        self._check_accepting()
        if not prompts:
            raise InvalidRequest("the input is empty")
        self._admit(len(prompts), sum(len(p.input_ids) for p in prompts))
        toks = []
        for p in prompts:
            if len(p.input_ids) > self.max_req_input_len:
                raise InvalidRequest(
                    f"an input has {len(p.input_ids)} tokens, more than the maximum of {self.max_req_input_len}"
                )
            toks.append(
                TokenizedGenerateReqInput(
                    rid=new_rid(),
                    input_text=p.text,
                    input_ids=p.input_ids,
                    sampling_params=SamplingParams(max_new_tokens=0),
                    return_logprob=False,
                    logprob_start_len=-1,
                    top_logprobs_num=0,
                    stream=False,
                    priority=p.priority,
                    extra_key=f"{tenant}\x00" if tenant is not None else None,
                    created_time=time.time(),
                    timeout=self._timeout(None),
                    pooling=True,
                    token_type_ids=p.token_type_ids,
                )
            )
        tasks = [asyncio.ensure_future(self._wait_pooled(t, request)) for t in toks]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # after a failure: the others' requests are aborted as their waits end
                t.cancel()

    async def _wait_pooled(self, tok: TokenizedGenerateReqInput, request) -> Pooled:
        state = ReqState(GenerateReqInput(input_ids=tok.input_ids), time.time())
        self.rid_to_state[tok.rid] = state
        self.inflight_prompt_tokens += len(tok.input_ids)
        self.send_to_scheduler.send_pyobj(tok)
        try:
            while not state.finished:
                try:
                    await asyncio.wait_for(state.event.wait(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if request is not None and await request.is_disconnected():
                        logger.info("client disconnected; aborting request %s", tok.rid)
                        raise asyncio.CancelledError from None
                    continue
                state.event.clear()
                if self.dead_reason and not state.finished:
                    raise ServiceUnavailable(f"the server stopped serving: {self.dead_reason}")
            reason = state.finish_reason
            if isinstance(reason, FINISH_ABORT):
                if reason.status_code == 400:
                    raise InvalidRequest(reason.message)
                raise ServiceUnavailable(f"the request was aborted: {reason.message}")
            return Pooled(state.embedding, state.prompt_tokens, state.cached_tokens)
        finally:
            if not state.finished:
                self.abort_request(tok.rid)
            if self.rid_to_state.pop(tok.rid, None) is not None:
                self.inflight_prompt_tokens -= len(tok.input_ids)

    def _make_output(self, rid: str, s: ReqState) -> dict:
        meta = {
            "id": rid,
            "finish_reason": s.finish_reason.to_json() if s.finish_reason is not None else None,
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.completion_tokens,
            "cached_tokens": s.cached_tokens,
            "cached_tokens_details": dict(zip(("device", "host", "storage"), s.cached_tokens_details)),
            "num_retractions": s.retractions,
            **({"image_tokens": s.image_tokens} if s.image_tokens else {}),
            "total_retractions": s.retractions,  # this server's earlier name
            "weight_version": self.weight_version,
            "e2e_latency": time.time() - s.created,
            **s.meta,
        }
        if self.server_args.dp_size > 1:
            meta["dp_rank"] = s.dp_rank
        if s.spec is not None:  # SGLang's speculative decoding stats
            proposed, histogram = s.spec
            verify_ct, accepted = sum(histogram), sum(k * n for k, n in enumerate(histogram))
            meta["spec_verify_ct"] = verify_ct
            meta["spec_accept_length"] = s.completion_tokens / verify_ct if verify_ct else 0.0
            meta["spec_accept_rate"] = accepted / proposed if proposed else 0.0
            meta["spec_accept_histogram"] = histogram
        if s.obj.return_logprob or s.obj.token_ids_logprob is not None:
            with_text = s.obj.return_text_in_logprobs
            meta["input_token_logprobs"] = self._lp_entries(s.input_token_logprobs, with_text)
            meta["output_token_logprobs"] = self._lp_entries(s.output_token_logprobs, with_text)
            meta["output_token_logprobs_length"] = len(s.output_token_logprobs)
            if s.obj.top_logprobs_num:
                meta["input_top_logprobs"] = [self._top_entries(t, with_text) for t in s.input_top_logprobs]
                meta["output_top_logprobs"] = [self._top_entries(t, with_text) for t in s.output_top_logprobs]
            if s.obj.token_ids_logprob is not None:
                meta["input_token_ids_logprobs"] = [self._top_entries(t, with_text) for t in s.input_token_ids_logprobs]
                meta["output_token_ids_logprobs"] = [
                    self._top_entries(t, with_text) for t in s.output_token_ids_logprobs
                ]
        return {"text": s.text, "output_ids": list(s.output_ids), "meta_info": meta}

    def _log_finished(self, tok: TokenizedGenerateReqInput, out: dict) -> None:
        """One line per finished request, as much of it as --log-requests-level says."""
        meta = out["meta_info"]
        record: dict = {
            k: meta[k] for k in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens")
        }
        record["e2e_latency"] = round(meta["e2e_latency"], 4)
        level = self.log_requests_level
        if level >= 1:
            params = dataclasses.asdict(tok.sampling_params)
            record["sampling_params"] = {k: v for k, v in params.items() if v is not None and k != "stop_strs"}
        if level == 2:
            record["input_text"] = _clip(tok.input_text)
            record["output_text"] = _clip(out["text"])
        if level >= 3:
            record["input_text"], record["output_text"] = tok.input_text, out["text"]
            record["input_ids"], record["output_ids"] = tok.input_ids, out["output_ids"]
        logger.info("request finished: %s", orjson.dumps(record).decode())

    def _token_texts(self, ids: list[int], with_text: bool) -> list:
        return self.tokenizer.batch_decode([[t] for t in ids]) if with_text else [None] * len(ids)

    def _lp_entries(self, pairs: list, with_text: bool) -> list:
        texts = self._token_texts([t for _, t in pairs], with_text)
        return [[lp, t, x] for (lp, t), x in zip(pairs, texts)]

    def _top_entries(self, top, with_text: bool):
        if top is None:
            return None
        vals, ids = top
        return [[v, t, x] for v, t, x in zip(vals, ids, self._token_texts(ids, with_text))]

    # -- outputs and control ---------------------------------------------------------------------

    async def handle_loop(self) -> None:
        while True:
            msg = await self.recv_from_detokenizer.recv_pyobj()
            if isinstance(msg, BatchStrOutput):
                self._handle_batch_output(msg)
            elif isinstance(msg, BatchEmbeddingOutput):
                self._handle_embedding_output(msg)
            elif isinstance(msg, SchedulerCrashed):
                logger.error("the scheduler crashed: %s", msg.message)
                self.fail_all(f"the scheduler crashed: {msg.message}")
            elif isinstance(msg, ControlReply):
                self._handle_control_reply(msg)

    def _handle_control_reply(self, reply: ControlReply) -> None:
        waiter = self.control_waiters.get(reply.rid)
        if waiter is None:
            return  # its call timed out (a replica was silent); a later call must not take it
        replies, fut = waiter
        replies.append(reply)
        if len(replies) == self.num_replicas and not fut.done():  # every data-parallel replica answered
            fut.set_result(replies)

    def _handle_batch_output(self, out: BatchStrOutput) -> None:
        tok = out.token_output
        for i, rid in enumerate(tok.rids):
            s = self.rid_to_state.get(rid)
            if s is None:
                continue  # the client went away and the request was aborted
            s.text += out.text_deltas[i]
            s.output_ids.extend(tok.new_output_ids[i])
            s.prompt_tokens, s.completion_tokens = tok.prompt_tokens[i], tok.completion_tokens[i]
            s.cached_tokens, s.retractions = tok.cached_tokens[i], tok.retractions[i]
            if tok.cached_tokens_details:
                s.cached_tokens_details = tok.cached_tokens_details[i]
            s.input_token_logprobs.extend(tok.input_token_logprobs[i])
            s.input_top_logprobs.extend(tok.input_top_logprobs[i])
            s.output_token_logprobs.extend(tok.output_token_logprobs[i])
            s.output_top_logprobs.extend(tok.output_top_logprobs[i])
            s.input_token_ids_logprobs.extend(tok.input_token_ids_logprobs[i])
            s.output_token_ids_logprobs.extend(tok.output_token_ids_logprobs[i])
            s.dp_rank = tok.dp_rank
            if tok.spec:
                s.spec = tok.spec[i]
            if tok.meta and (meta := tok.meta[i]) is not None:
                s.meta = meta
            if tok.finished_reasons[i] is not None:
                s.finish_reason, s.finished = tok.finished_reasons[i], True
            s.event.set()

    def _handle_embedding_output(self, out: BatchEmbeddingOutput) -> None:
        for i, rid in enumerate(out.rids):
            s = self.rid_to_state.get(rid)
            if s is None:
                continue
            s.embedding = out.embeddings[i]
            s.prompt_tokens, s.cached_tokens = out.prompt_tokens[i], out.cached_tokens[i]
            s.finish_reason, s.finished = FINISH_LENGTH(length=0), True
            s.event.set()

    def abort_request(self, rid: str = "", abort_all: bool = False, message: str = "aborted") -> None:
        self.send_to_scheduler.send_pyobj(AbortReq(rid=rid, abort_all=abort_all, message=message))

    async def _control(
        self,
        req: FlushCacheReq
        | GetInternalStateReq
        | ProfileReq
        | LoadLoRAAdapterReq
        | UnloadLoRAAdapterReq
        | WeightsReq
        | CloseSessionReq,
        timeout: float,
    ) -> list:
        """Send a control request; every data-parallel replica answers it, in any order. Raises
        asyncio.TimeoutError when some replica has not answered within timeout seconds."""
        fut = asyncio.get_running_loop().create_future()
        self.control_waiters[req.rid] = ([], fut)
        try:
            self.send_to_scheduler.send_pyobj(req)
            return await asyncio.wait_for(fut, timeout)
        finally:
            del self.control_waiters[req.rid]

    def open_session(self, body, tenant: str | None = None) -> str:
        """SGLang's /open_session: a new session's id (the given `session_id`, or a fresh one)."""
        self._check_accepting()
        return self.sessions.open(body, tenant)

    async def close_session(self, body, tenant: str | None = None, timeout: float = 60.0) -> None:
        """SGLang's /close_session: forget the session's requests and release its cached KV."""
        sid = self.sessions.close(body, tenant)
        self.sessions.pop(sid)
        await self._control(CloseSessionReq(session_id=sid), timeout)

    async def flush_cache(self, timeout: float = 60.0, storage: bool = False) -> FlushCacheReqOutput:
        """Empty every replica's prefix cache (device and host tiers), or with storage its file tier."""
        req = FlushCacheReq(storage=storage)
        replies: list[FlushCacheReqOutput] = await self._control(req, timeout)
        return FlushCacheReqOutput(rid=req.rid, **_merged(replies))

    async def profile(self, req: ProfileReq, timeout: float = 300.0) -> ProfileReqOutput:
        """Start or stop the profiler of every data-parallel replica (each tells its tensor-parallel
        ranks); a stop returns once each replica's rank 0 has written its trace."""
        replies: list[ProfileReqOutput] = await self._control(req, timeout)
        return ProfileReqOutput(rid=req.rid, traces=sorted(t for r in replies for t in r.traces), **_merged(replies))

    async def load_lora_adapter(self, ref: LoRARef, timeout: float = 300.0) -> LoRAUpdateOutput:
        """Register an adapter on every data-parallel replica (each checks and loads it)."""
        self._require_lora(f"loading LoRA adapter {ref.name!r}")
        req = LoadLoRAAdapterReq(lora_name=ref.name, lora_path=ref.path, pinned=ref.pinned)
        replies: list[LoRAUpdateOutput] = await self._control(req, timeout)
        out = LoRAUpdateOutput(rid=req.rid, **_merged(replies))
        if any(r.success for r in replies):  # requests may name it from now on
            self.lora_adapters[ref.name] = ref.path
        out.loaded_adapters = dict(self.lora_adapters)
        return out

    async def unload_lora_adapter(self, name: str, timeout: float = 600.0) -> LoRAUpdateOutput:
        """Unregister an adapter: new requests for it get 400 at once; the reply waits until its
        queued and running requests have finished."""
        self._require_lora(f"unloading LoRA adapter {name!r}")
        if name not in self.lora_adapters:
            raise InvalidRequest(not_loaded(f"lora_name = {name!r}", self.lora_adapters))
        path = self.lora_adapters.pop(name)
        req = UnloadLoRAAdapterReq(lora_name=name)
        try:
            replies: list[LoRAUpdateOutput] = await self._control(req, timeout)
        except BaseException:
            self.lora_adapters.setdefault(name, path)  # still registered where the call did not finish
            raise
        out = LoRAUpdateOutput(rid=req.rid, **_merged(replies))
        out.loaded_adapters = dict(self.lora_adapters)
        return out

    async def weights_control(self, op: str, args: dict, timeout: float = 600.0) -> WeightsReqOutput:
        """A weights call (srt/rl: updates, reads, pause, continue, memory release) on every
        data-parallel replica; it succeeds when every replica's does."""
        req = WeightsReq(op=op, args=args)
        replies: list[WeightsReqOutput] = await self._control(req, timeout)
        out = WeightsReqOutput(rid=req.rid, **_merged(replies), data=replies[0].data)
        if out.success:
            out.message = replies[0].message
        if (version := out.data.get("weight_version")) is not None:
            self.weight_version = version
        return out

    def tenant_load(self) -> dict[str, dict[str, int]]:
        """Requests in flight and their prompt tokens, by tenant ("default": no tenant)."""
        out: dict[str, dict[str, int]] = {}
        for s in self.rid_to_state.values():
            t = out.setdefault(s.tenant or "default", {"requests": 0, "prompt_tokens": 0})
            t["requests"] += 1
            t["prompt_tokens"] += s.input_len
        return out

    async def get_internal_states(self, timeout: float = 10.0) -> list[SchedulerState]:
        """One state per data-parallel replica, ordered by `dp_rank`."""
        replies: list[GetInternalStateReqOutput] = await self._control(GetInternalStateReq(), timeout)
        return sorted((r.state for r in replies), key=lambda st: st.dp_rank)

    async def get_internal_state(self) -> SchedulerState:
        """The first replica's state (the only one without --dp-size)."""
        return (await self.get_internal_states())[0]

    def fail_all(self, reason: str) -> None:
        """A worker died: every waiting request ends with an error instead of hanging. Call on the
        event loop's thread; the first reason given (the most specific) is kept."""
        if self.dead_reason is None:
            self.dead_reason = reason
        for s in self.rid_to_state.values():
            s.event.set()

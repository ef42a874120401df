"""`/v1/models`, `/v1/completions`, `/v1/chat/completions` over the TokenizerManager.

Requests become native `GenerateReqInput`s (so `n`, stop strings, logprobs, penalties, seeds and
structured output behave exactly as on `/generate`); answers and stream chunks take OpenAI's shapes,
with SGLang's `matched_stop` and `usage.prompt_tokens_details.cached_tokens`. Errors use OpenAI's
error object, also for `stream: true` when the error is known before the first chunk.
"""

from __future__ import annotations

import abc
import json
import re
import time
import uuid
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, cast

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, format_validation_error
from srt.function_call import FunctionCallParser, ToolCallStream, ToolError, check_tool_choice, check_tools
from srt.function_call.core import new_call_id
from srt.function_call.smollm2 import SmolLM2Detector
from srt.lora.adapter import not_loaded
from srt.managers.io_struct import GenerateReqInput, InvalidRequest
from srt.managers.tokenizer_manager import ServiceUnavailable, TokenizerManager
from srt.parser.reasoning_parser import ReasoningParser
from srt.sampling.sampling_params import InvalidSamplingParams

if TYPE_CHECKING:
    from typing_extensions import TypeIs

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


# The OpenAI request fields that SamplingParams' fields come from, where the names differ
_OPENAI_FIELDS = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
    "stop_strs": "stop",
}


def _openai_names(message: str) -> tuple[str, str | None]:
    """A sampling-parameter error as the OpenAI routes' clients sent the field (`stop_regex`, not
    `sampling_params.stop_regex`; `max_tokens`, not `max_new_tokens`), and that field for `param`."""
    names: list[str] = []

    def name(m: re.Match) -> str:
        field = str(m.group(1))
        names.append(_OPENAI_FIELDS.get(field, field))
        return names[-1]

    return re.sub(r"\bsampling_params\.(\w+)", name, message), (names[0] if names else None)


def openai_error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> Response:
    body = {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": code or status,
        }
    }
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


class EventStream(StreamingResponse):
    """SSE whose generator is closed as soon as the response ends, also when the client went away
    mid-stream: closing it aborts the request and frees its KV now, not whenever the garbage
    collector gets to a cancelled generator."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None]):
        super().__init__(events)
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()


def with_retry_after(response: Response, e: Exception) -> Response:
    """A 503 for overload, or a 429 for a tenant over its budget, says when to come back."""
    retry = getattr(e, "retry_after", None)
    if retry is not None:
        response.headers["Retry-After"] = str(retry)
    return response


def _sse(payload) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _is_texts(prompt: str | list[str] | list[int] | list[list[int]]) -> TypeIs[list[str]]:
    """A batch of text prompts (a list prompt is never empty: the protocol rejects that)."""
    return isinstance(prompt, list) and isinstance(prompt[0], str)


def _template_call(call: dict) -> dict:
    """An earlier assistant tool call as chat templates expect it: arguments as a mapping (OpenAI
    clients send the JSON text; templates write `arguments | tojson`)."""
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            return call
        return {**call, "function": {**fn, "arguments": args}}
    return call


def _finish_fields(reason: dict | None) -> dict:
    """OpenAI's finish_reason (stop / length / abort) and SGLang's matched_stop."""
    if reason is None:
        return {"finish_reason": None, "matched_stop": None}
    return {"finish_reason": reason.get("type"), "matched_stop": reason.get("matched")}


class OpenAIServing:
    def __init__(
        self,
        tm: TokenizerManager,
        served_model_name: str,
        model_path: str,
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ):
        self.tm = tm
        self.model_name = served_model_name
        self.aliases = {served_model_name, model_path, model_path.rstrip("/").rsplit("/", 1)[-1], "default"}
        self.chat_template = chat_template
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self.created = int(time.time())

    # -- routes ----------------------------------------------------------------------------------

    def models(self) -> dict:
        adapters = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "radixserve",
                "root": path,
                "parent": self.model_name,
                "max_model_len": self.tm.context_len,
            }
            for name, path in sorted(self.tm.lora_adapters.items())
        ]
        return {"object": "list", "data": [self.model_card(), *adapters]}

    def lora_path(self, req) -> str | None:
        """The adapter a request asks for: `lora_path`, else a `model` of "<base>:<adapter>" or an
        adapter's own name (as /v1/models lists it). Other model names mean the base model."""
        if req.lora_path is not None or not self.tm.server_args.enable_lora or not req.model:
            return req.lora_path
        if req.model in self.tm.lora_adapters:
            return req.model
        if ":" in req.model:
            adapter = req.model.split(":", 1)[1]
            if adapter not in self.tm.lora_adapters:
                what = f"model {req.model!r} names LoRA adapter {adapter!r}, which"
                raise OpenAIError(400, not_loaded(what, self.tm.lora_adapters), "model")
            return adapter
        return None

    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "radixserve",
            "root": self.model_name,
            "max_model_len": self.tm.context_len,
            "modalities": list(self.tm.modalities),  # what prompts may carry: text, and image for a VLM
        }

    async def completions(self, body: Any, request: Request) -> Response:
        return await self._serve(body, request, CompletionRequest, self._completion_input, _CompletionResponder)

    async def chat(self, body: Any, request: Request) -> Response:
        return await self._serve(body, request, ChatCompletionRequest, self.chat_input, _ChatResponder)

    # -- requests --------------------------------------------------------------------------------

    def _parse(self, cls, body: Any):
        if not isinstance(body, dict):
            raise OpenAIError(400, "request body must be a JSON object")
        try:
            req = cls.model_validate(body)
        except ValidationError as e:
            loc = e.errors()[0].get("loc") if e.errors() else None
            raise OpenAIError(400, format_validation_error(e), str(loc[0]) if loc else None) from None
        # Any `model` is accepted, as SGLang does (clients and routers send fixed names such as
        # gpt-3.5-turbo); responses name the served model.
        return req

    def _sampling(self, req, max_new_tokens: int | None) -> dict:
        try:
            return req.sampling_params(max_new_tokens)
        except ValueError as e:
            raise OpenAIError(400, str(e), "response_format") from None

    def _completion_input(self, req: CompletionRequest) -> GenerateReqInput:
        if req.suffix:
            raise OpenAIError(400, "`suffix` is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError(
                400, f"`best_of` = {req.best_of} is not supported unless it equals n ({req.n})", "best_of"
            )
        p = req.prompt
        text, ids = (p, None) if isinstance(p, str) or _is_texts(p) else (None, p)
        want_lp = req.logprobs is not None
        return GenerateReqInput(
            text=text,
            input_ids=ids,
            sampling_params=self._sampling(req, req.max_tokens),
            rid=req.rid,
            return_logprob=want_lp,
            top_logprobs_num=req.logprobs or 0,
            logprob_start_len=0 if (want_lp and req.echo) else -1,
            return_text_in_logprobs=True,
            stream=req.stream,
            timeout=req.timeout,
            priority=req.priority,
            lora_path=self.lora_path(req),
            bootstrap_host=req.bootstrap_host,
            bootstrap_port=req.bootstrap_port,
            bootstrap_room=req.bootstrap_room,
        )

    def tool_calling(self, req: ChatCompletionRequest) -> FunctionCallParser | None:
        """The request's tool calling (None: tools absent or tool_choice 'none'); bad tools are 400s."""
        try:
            tools = check_tools(req.tools) if req.tools is not None else None
            choice = check_tool_choice(req.tool_choice, tools)
        except ToolError as e:
            raise OpenAIError(400, str(e), e.param) from None
        if not tools or choice == "none":
            return None
        fcp = FunctionCallParser(self.tool_call_parser, tools, choice, req.parallel_tool_calls)
        if fcp.constraint is not None:
            given = [f for f in ("response_format", "regex", "json_schema", "ebnf") if getattr(req, f) is not None]
            if given:
                raise OpenAIError(
                    400,
                    f"tool_choice {req.tool_choice!r} constrains the output; it cannot be combined with {given[0]}",
                    given[0],
                )
        return fcp

    def chat_input(self, req: ChatCompletionRequest) -> GenerateReqInput:
        tok = self.tm.tokenizer
        template = self.chat_template or getattr(tok, "chat_template", None)
        if not template:
            raise OpenAIError(
                400,
                "this model has no chat template; start the server with --chat-template FILE or use /v1/completions",
            )
        fcp = req._tool_calling = self.tool_calling(req)
        messages = []
        images: list[str] = []
        labels: list[str] = []
        vision = self.tm.image_prompts is not None
        for i, m in enumerate(req.messages):
            try:
                if vision:
                    content, found = m.parts()
                    images += [url for _, url in found]
                    labels += [f"messages[{i}].content[{j}].image_url" for j, _ in found]
                else:
                    content = m.text() or ""
                msg: dict[str, Any] = {"role": m.role, "content": content}
            except ValueError as e:
                raise OpenAIError(400, f"messages[{i}].{e}", f"messages[{i}].content") from None
            for key in ("name", "tool_call_id"):
                if getattr(m, key) is not None:
                    msg[key] = getattr(m, key)
            if m.tool_calls is not None:
                msg["tool_calls"] = [_template_call(c) for c in m.tool_calls]
            messages.append(msg)
        tools = fcp.tools if fcp is not None else None
        if self.tool_call_parser == "smollm2" and "tools" not in template:  # SmolLM2's template cannot show tools
            messages, tools = SmolLM2Detector.adapt_messages(messages, tools), None
        try:
            prompt = tok.apply_chat_template(
                messages,
                # transformers types `tools` as a list of dicts or functions; list is invariant
                tools=tools,  # pyright: ignore[reportArgumentType]
                tokenize=False,
                chat_template=self.chat_template,
                add_generation_prompt=not req.continue_final_message,
                continue_final_message=req.continue_final_message,
                **(req.chat_template_kwargs or {}),
            )
        except Exception as e:  # a template's own raise_exception (e.g. roles must alternate) or a bad kwarg
            raise OpenAIError(400, f"the chat template rejected the messages: {e}", "messages") from None
        assert isinstance(prompt, str), "apply_chat_template(tokenize=False) returns the prompt's text"
        ids = tok.encode(prompt, add_special_tokens=False)
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sampling = self._sampling(req, max_new)
        if fcp is not None and fcp.constraint is not None:
            kind, grammar = fcp.constraint
            sampling[kind] = grammar
        return GenerateReqInput(
            input_ids=ids,
            sampling_params=sampling,
            rid=req.rid,
            return_logprob=req.logprobs,
            top_logprobs_num=(req.top_logprobs or 0) if req.logprobs else 0,
            return_text_in_logprobs=True,
            stream=req.stream,
            timeout=req.timeout,
            priority=req.priority,
            lora_path=self.lora_path(req),
            bootstrap_host=req.bootstrap_host,
            bootstrap_port=req.bootstrap_port,
            bootstrap_room=req.bootstrap_room,
            image_data=images or None,
            media_labels=labels or None,
        )

    async def _serve(self, body: Any, request: Request, cls, to_input, responder_cls) -> Response:
        try:
            req = self._parse(cls, body)
            obj = to_input(req)
        except OpenAIError as e:
            return openai_error_response(e.status, e.message, e.param, e.code)
        try:
            gen = self.tm.generate_request(obj, request)
            first = await gen.__anext__()
        except (InvalidRequest, InvalidSamplingParams) as e:
            return openai_error_response(400, *_openai_names(str(e)))
        except ServiceUnavailable as e:
            return with_retry_after(openai_error_response(e.status, str(e)), e)
        responder = responder_cls(self, req)
        if not req.stream:
            return Response(
                orjson.dumps(responder.body(first if isinstance(first, list) else [first])),
                media_type="application/json",
            )

        async def events():
            try:
                yield responder.chunk(first)
                async for out in gen:
                    yield responder.chunk(out)
                tail = responder.usage_chunk()
                if tail:
                    yield tail
            except ServiceUnavailable as e:
                yield _sse({"error": {"message": str(e), "type": ERROR_TYPES[503], "param": None, "code": 503}})
            finally:  # a client that went away cancels us here: abort its request now, not at GC
                await gen.aclose()
            yield b"data: [DONE]\n\n"

        return EventStream(events())

    # -- responses -------------------------------------------------------------------------------

    @staticmethod
    def usage(outs: list[dict], n: int) -> dict:
        metas = [o["meta_info"] for o in outs]
        prompt = sum(m["prompt_tokens"] for m in metas[::n])  # n samples share one prompt
        completion = sum(m["completion_tokens"] for m in metas)
        cached = sum(m["cached_tokens"] for m in metas[::n])
        details = {"cached_tokens": cached}
        if image_tokens := sum(m.get("image_tokens", 0) for m in metas[::n]):
            details["image_tokens"] = image_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": details,
        }

    @staticmethod
    def completion_logprobs(meta: dict, echo: bool) -> dict:
        entries = (meta.get("input_token_logprobs") or [] if echo else []) + meta.get("output_token_logprobs", [])
        tops = (meta.get("input_top_logprobs") or [] if echo else []) + (meta.get("output_top_logprobs") or [])
        tokens = [e[2] for e in entries]
        text_offset, pos = [], 0
        for t in tokens:
            text_offset.append(pos)
            pos += len(t or "")
        top = [None if t is None else {e[2]: e[0] for e in t} for t in tops] if tops else None
        return {
            "tokens": tokens,
            "token_logprobs": [e[0] for e in entries],
            "top_logprobs": top,
            "text_offset": text_offset,
        }

    @staticmethod
    def chat_logprobs(meta: dict, start: int = 0) -> dict:
        entries = meta.get("output_token_logprobs", [])[start:]
        tops = (meta.get("output_top_logprobs") or [])[start:]
        content = []
        for i, (lp, _tid, text) in enumerate(entries):
            top = tops[i] if i < len(tops) and tops[i] else []
            content.append(
                {
                    "token": text,
                    "logprob": lp,
                    "bytes": list(text.encode()),
                    "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for v, _id, t in top],
                }
            )
        return {"content": content}


class _Responder(abc.ABC):
    """One request's answer in OpenAI's shapes: the whole body, or delta chunks built from the
    TokenizerManager's cumulative per-index outputs."""

    object_name = chunk_object = id_prefix = ""

    def __init__(self, serving: OpenAIServing, req):
        self.serving, self.req = serving, req
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sent_text: dict[int, int] = {}
        self.sent_lp: dict[int, int] = {}
        self.final: dict[int, dict] = {}

    def body(self, outs: list[dict]) -> dict:
        choices = [
            {**_finish_fields(out["meta_info"]["finish_reason"]), **self.final_choice(i, out)}
            for i, out in enumerate(outs)
        ]
        return {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.serving.model_name,
            "choices": choices,
            "usage": self.serving.usage(outs, self.req.n),
            # SGLang's: the weights that made the answer (srt/rl; a request spanning an update
            # names the version of its last token)
            "metadata": {"weight_version": outs[0]["meta_info"].get("weight_version")},
        }

    def chunk(self, out: dict) -> bytes:
        i = out.get("index", 0)
        meta = out["meta_info"]
        first = i not in self.sent_text
        delta_text = out["text"][self.sent_text.get(i, 0) :]
        self.sent_text[i] = len(out["text"])
        choice = {
            **_finish_fields(meta["finish_reason"]),
            **self.delta_choice(i, first, delta_text, meta, self.sent_lp.get(i, 0)),
        }
        self.sent_lp[i] = len(meta.get("output_token_logprobs") or [])
        if meta["finish_reason"] is not None:
            self.final[i] = out
        body = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.serving.model_name,
            "choices": [choice],
        }
        if self.req.stream_options and self.req.stream_options.continuous_usage_stats:
            body["usage"] = self.serving.usage([out], 1)
        return _sse(body)

    def usage_chunk(self) -> bytes | None:
        if not (self.req.stream_options and self.req.stream_options.include_usage):
            return None
        outs = [self.final[i] for i in sorted(self.final)]
        return _sse(
            {
                "id": self.id,
                "object": self.chunk_object,
                "created": self.created,
                "model": self.serving.model_name,
                "choices": [],
                "usage": self.serving.usage(outs, self.req.n),
            }
        )

    @abc.abstractmethod
    def final_choice(self, i: int, out: dict) -> dict:
        """Choice i of the whole answer, without its finish fields."""

    @abc.abstractmethod
    def delta_choice(self, i: int, first: bool, text: str, meta: dict, lp_start: int) -> dict:
        """Choice i of a chunk: `text` and the logprobs from `lp_start` are new since its last chunk."""


class _CompletionResponder(_Responder):
    object_name = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, serving, req):
        super().__init__(serving, req)
        self.prompts = self._prompt_texts()

    def _prompt_texts(self) -> list[str]:
        """Each prompt's text, for echo."""
        req = self.req
        if not req.echo:
            return []
        p = req.prompt
        if isinstance(p, str):
            return [p]
        if _is_texts(p):
            return list(p)
        batches = p if isinstance(p[0], list) else [p]
        # one prompt's ids decode to one string (a list of strings only for a batch of prompts)
        return [cast(str, self.serving.tm.tokenizer.decode(ids)) for ids in batches]

    def final_choice(self, i, out):
        req = self.req
        echo = self.prompts[i // req.n] if req.echo else ""
        logprobs = self.serving.completion_logprobs(out["meta_info"], req.echo) if req.logprobs is not None else None
        return {"index": i, "text": echo + out["text"], "logprobs": logprobs}

    def delta_choice(self, i, first, text, meta, lp_start):
        if first and self.req.echo:
            text = self.prompts[i // self.req.n] + text
        logprobs = None
        if self.req.logprobs is not None:
            full = self.serving.completion_logprobs(meta, self.req.echo and first)
            if not (self.req.echo and first):
                full = {k: (v[lp_start:] if v is not None else None) for k, v in full.items()}
            logprobs = full
        return {"index": i, "text": text, "logprobs": logprobs}


class _ChatResponder(_Responder):
    """Chat answers; with --reasoning-parser the <think> part goes to reasoning_content, with tools
    the calls to tool_calls (the answer part only), streamed per choice as they are decided."""

    object_name, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, serving, req):
        super().__init__(serving, req)
        self.fcp: FunctionCallParser | None = req._tool_calling  # checked when the request was read
        name = serving.reasoning_parser
        self.reasoning = name if name is not None and req.separate_reasoning else None
        self.streams: dict[int, tuple[ReasoningParser | None, ToolCallStream | None]] = {}

    def final_choice(self, i, out):
        logprobs = self.serving.chat_logprobs(out["meta_info"]) if self.req.logprobs else None
        message: dict = {"role": "assistant", "content": out["text"]}
        if self.reasoning is not None:
            message["reasoning_content"], message["content"] = ReasoningParser(self.reasoning).parse(out["text"])
        choice: dict = {"index": i, "message": message, "logprobs": logprobs}
        if self.fcp is not None and self.fcp.detector is not None:
            normal, calls = self.fcp.detector.parse(message["content"])
            if calls:
                message["content"] = normal.strip() or None
                message["tool_calls"] = [
                    {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.parameters}}
                    for c in calls
                ]
                choice.update(self._calls_finish(out["meta_info"]))
        return choice

    @staticmethod
    def _calls_finish(meta: dict) -> dict:
        reason = meta["finish_reason"]
        return {"finish_reason": "tool_calls"} if reason is not None and reason.get("type") == "stop" else {}

    def delta_choice(self, i, first, text, meta, lp_start):
        if i not in self.streams:
            reasoning = ReasoningParser(self.reasoning, self.req.stream_reasoning) if self.reasoning else None
            detector = self.fcp.detector if self.fcp is not None else None
            self.streams[i] = (reasoning, ToolCallStream(detector) if detector else None)
        reasoning, calls = self.streams[i]
        done = meta["finish_reason"] is not None
        thought, answer = "", text
        if reasoning is not None:
            thought, answer = reasoning.feed(text)
            if done:
                more_thought, more_answer = reasoning.finish()
                thought, answer = thought + more_thought, answer + more_answer
        delta: dict = {"role": "assistant"} if first else {}
        choice: dict = {"index": i, "delta": delta}
        if calls is not None:
            answer, deltas = calls.feed(answer)
            if done:
                more, more_deltas = calls.finish()
                answer, deltas = answer + more, deltas + more_deltas
            if deltas:
                delta["tool_calls"] = deltas
            if done and calls.sent:
                choice.update(self._calls_finish(meta))
        if thought:
            delta["reasoning_content"] = thought
        if answer or not (thought or delta.get("tool_calls")):
            delta["content"] = answer
        choice["logprobs"] = self.serving.chat_logprobs(meta, lp_start) if self.req.logprobs else None
        return choice

"""OpenAI's Responses API: `POST /v1/responses`, `GET /v1/responses/{id}` (and `/input_items`),
`POST /v1/responses/{id}/cancel`, `DELETE /v1/responses/{id}`.

A request becomes a chat completion request (input items -> chat messages, `text.format` ->
`response_format`, flat function tools -> chat tools) and runs through OpenAIServing's chat path:
the chat template, the tool-call grammar and parsers, the reasoning parser, the grammar backend.
The output is split into `reasoning`, `message` and `function_call` items (`chat_turn`); a stream
sends OpenAI's event sequence with `sequence_number`s. Stored responses (`store`, the default) keep
their conversation, so `previous_response_id` continues it, function calls and their outputs
included, and the radix cache reuses the earlier turns' KV.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any, Literal

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, ValidationError

from srt.entrypoints.openai.chat_turn import Piece, TurnStream, parse_body, split_turn, warn_once
from srt.entrypoints.openai.protocol import ChatCompletionRequest, _Body, format_validation_error
from srt.entrypoints.openai.response_store import ResponseStore, Stored
from srt.entrypoints.openai.serving import (
    EventStream,
    OpenAIError,
    OpenAIServing,
    openai_error_response,
    with_retry_after,
)
from srt.managers.io_struct import InvalidRequest
from srt.managers.tokenizer_manager import ServiceUnavailable
from srt.sampling.sampling_params import InvalidSamplingParams

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# The request fields of OpenAI's client (ResponseCreateParams), and what this server does with each;
# README.md's table says the same, and tests/server/test_agent_apis.py checks the three agree.
SUPPORTED_FIELDS = (
    "background",
    "include",
    "input",
    "instructions",
    "max_output_tokens",
    "metadata",
    "model",
    "parallel_tool_calls",
    "previous_response_id",
    "reasoning",
    "store",
    "stream",
    "temperature",
    "text",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "truncation",
    "user",
)
# Accepted and ignored, with a warning in the server log (once per field): they describe features of
# OpenAI's hosted service, or change nothing a local server does.
IGNORED_FIELDS = (
    "access_programs",
    "background_options",
    "context_management",
    "image",
    "max_tool_calls",
    "moderation",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "safety_identifier",
    "service_tier",
    "stream_options",
)
REJECTED_FIELDS = ("conversation", "prompt")
IGNORED_INCLUDES = frozenset(
    {
        "reasoning.encrypted_content",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        "web_search_call.action.sources",
        "web_search_call.results",
    }
)
# SGLang's sampling extensions, passed through to the chat request as they are.
EXTENSIONS = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "seed",
    "regex",
    "ebnf",
    "rid",
    "timeout",
    "lora_path",
    "chat_template_kwargs",
    "skip_special_tokens",
)
ROUTE = "/v1/responses"


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: str | None = None


class Reasoning(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict] = ""
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    user: str | None = None
    stream: bool = False
    truncation: Literal["auto", "disabled"] | None = None
    conversation: Any = None
    prompt: Any = None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str, vision: bool) -> tuple[str | list[dict], list[str]]:
    """A message item's content as chat content: its text, or (with a vision model) text and image
    parts; and the labels of its images."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise OpenAIError(400, f"{where}.content must be a string or a list of content parts", f"{where}.content")
    parts: list[dict] = []
    labels: list[str] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        here = f"{where}.content[{j}]"
        if kind in ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text"):
            text = part.get("refusal") if kind == "refusal" else part.get("text")
            if not isinstance(text, str):
                raise OpenAIError(400, f"{here}.text must be a string", here)
            parts.append({"type": "text", "text": text})
        elif kind == "input_image":
            if not vision:
                raise OpenAIError(400, f"{here} is an image; this model accepts text only", here)
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise OpenAIError(400, f"{here}.image_url must be a URL or data URL (file_id is not supported)", here)
            parts.append({"type": "image_url", "image_url": {"url": url, "detail": part.get("detail") or "auto"}})
            labels.append(f"{here}.image_url")
        else:
            raise OpenAIError(
                400,
                f"{here}.type = {kind!r} is not supported (input_text, output_text, refusal and input_image are)",
                f"{here}.type",
            )
    if not labels:
        return "".join(p["text"] for p in parts), []
    return parts, labels


def input_messages(items: str | list[dict], vision: bool) -> tuple[list[dict], list[dict]]:
    """The input as chat messages, and as items with ids (what /input_items lists)."""
    if isinstance(items, str):
        item = {
            "id": _new_id("msg"),
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": items}],
        }
        return [{"role": "user", "content": items}], [item]
    messages: list[dict] = []
    stored: list[dict] = []
    call_names: dict[str, str] = {}
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise OpenAIError(400, f"{where} must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise OpenAIError(
                    400, f"{where}.role = {role!r} must be user, assistant, system or developer", f"{where}.role"
                )
            content, _ = _text_of(item.get("content"), where, vision)
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, str):
                raise OpenAIError(
                    400, f"{where}: a function_call needs string `call_id`, `name` and `arguments`", where
                )
            call_names[call_id] = name
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and isinstance(last.get("content"), str | None):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise OpenAIError(400, f"{where}.call_id must be a string", f"{where}.call_id")
            if isinstance(output, list):
                output, _ = _text_of(output, where, False)
            if not isinstance(output, str):
                raise OpenAIError(400, f"{where}.output must be a string or text parts", f"{where}.output")
            msg = {"role": "tool", "tool_call_id": call_id, "content": output}
            if call_id in call_names:
                msg["name"] = call_names[call_id]
            messages.append(msg)
        elif kind == "reasoning":
            pass  # earlier reasoning is not shown to the model again (chat templates drop it too)
        else:
            raise OpenAIError(
                400,
                f"{where}.type = {kind!r} is not supported "
                "(message, function_call, function_call_output and reasoning items are)",
                f"{where}.type",
            )
        stored.append({"id": _new_id("msg" if kind == "message" else "item"), **item})
    return messages, stored


def chat_tools(tools: list[dict] | None, choice: str | dict | None) -> tuple[list[dict] | None, Any]:
    """Flat Responses function tools and tool_choice -> chat's nested ones."""
    out = None
    if tools is not None:
        out = []
        for i, t in enumerate(tools):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise OpenAIError(
                    400, f"tools[{i}].type = {kind!r} is not supported (only function tools are)", f"tools[{i}].type"
                )
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
            out.append({"type": "function", "function": fn})
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise OpenAIError(
                400,
                f"tool_choice.type = {choice.get('type')!r} is not supported ('auto', 'none', 'required' or "
                '{"type": "function", "name": ...})',
                "tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return out, choice


class ResponsesServing:
    def __init__(self, openai: OpenAIServing, max_items: int, max_bytes: int):
        self.openai = openai
        self.tm = openai.tm
        self.store = ResponseStore(max_items, max_bytes)

    # -- routes ----------------------------------------------------------------------------------

    async def create(self, body: Any, request: Request) -> Response:
        tenant = getattr(request.state, "tenant", None)
        try:
            req = self._parse(body)
            job = self._job(req, body, tenant)
        except OpenAIError as e:
            return openai_error_response(e.status, e.message, e.param, e.code)
        if req.background:
            return self._start_background(job, tenant)
        try:
            gen = self.tm.generate_request(job.obj, request)
            first = await gen.__anext__()
        except (InvalidRequest, InvalidSamplingParams) as e:
            return openai_error_response(400, str(e), job.param_of(str(e)))
        except ServiceUnavailable as e:
            return with_retry_after(openai_error_response(e.status, str(e)), e)
        if not req.stream:
            assert isinstance(first, dict), "one prompt with n = 1 gives one output"
            response = job.finish(first)
            self._keep(job, tenant)
            return Response(orjson.dumps(response), media_type="application/json")
        return EventStream(self._events(job, gen, first, tenant))

    def retrieve(self, response_id: str, request: Request) -> Response:
        entry = self._find(response_id, request)
        if entry is None:
            return self._missing(response_id)
        return Response(orjson.dumps(entry.response), media_type="application/json")

    def input_items(self, response_id: str, request: Request) -> Response:
        entry = self._find(response_id, request)
        if entry is None:
            return self._missing(response_id)
        data = list(reversed(entry.input_items))
        if request.query_params.get("order") == "asc":
            data.reverse()
        body = {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": False,
        }
        return Response(orjson.dumps(body), media_type="application/json")

    async def cancel(self, response_id: str, request: Request) -> Response:
        entry = self._find(response_id, request)
        if entry is None:
            return self._missing(response_id)
        if not entry.response.get("background"):
            return openai_error_response(400, "only a response created with background: true can be cancelled")
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
            try:
                await entry.task
            except asyncio.CancelledError:
                pass
        return Response(orjson.dumps(entry.response), media_type="application/json")

    async def delete(self, response_id: str, request: Request) -> Response:
        entry = self.store.delete(getattr(request.state, "tenant", None), response_id)
        if entry is None:
            return self._missing(response_id)
        if entry.task is not None:
            entry.task.cancel()
        return Response(
            orjson.dumps({"id": response_id, "object": "response", "deleted": True}), media_type="application/json"
        )

    # -- requests --------------------------------------------------------------------------------

    def _find(self, response_id: str, request: Request) -> Stored | None:
        return self.store.get(getattr(request.state, "tenant", None), response_id)

    @staticmethod
    def _missing(response_id: str) -> Response:
        return openai_error_response(404, f"No response found with id '{response_id}'.", "response_id", "not_found")

    def _parse(self, body: Any) -> ResponsesRequest:
        req = parse_body(ResponsesRequest, body, ROUTE, IGNORED_FIELDS, lambda message: OpenAIError(400, message))
        if req.conversation is not None:
            raise OpenAIError(
                400, "`conversation` is not supported; continue with `previous_response_id`", "conversation"
            )
        if req.prompt is not None:
            raise OpenAIError(400, "`prompt` (stored prompt templates) is not supported", "prompt")
        if req.background and not req.store:
            raise OpenAIError(
                400, "background responses must be stored: `background` needs `store: true`", "background"
            )
        if req.background and req.stream:
            raise OpenAIError(400, "`background` together with `stream` is not supported", "background")
        for value in req.include or []:
            if value in IGNORED_INCLUDES:
                warn_once(ROUTE, f"include {value!r}")
            elif value != LOGPROBS_INCLUDE:
                raise OpenAIError(
                    400, f"include = {value!r} is not supported (only {LOGPROBS_INCLUDE!r} is)", "include"
                )
        meta = req.metadata or {}
        if len(meta) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in meta.items()):
            raise OpenAIError(
                400,
                "metadata holds at most 16 pairs, keys of at most 64 and values of at most 512 characters",
                "metadata",
            )
        if req.truncation == "auto":
            warn_once(ROUTE, "truncation 'auto' (a prompt over the context is a 400)")
        if req.input == "" or req.input == []:
            raise OpenAIError(400, "`input` must not be empty", "input")
        return req

    def _job(self, req: ResponsesRequest, body: dict, tenant: str | None) -> _Job:
        history: list[dict] = []
        if req.previous_response_id is not None:
            prev = self.store.get(tenant, req.previous_response_id)
            if prev is None:
                raise OpenAIError(
                    404,
                    f"Previous response with id '{req.previous_response_id}' not found.",
                    "previous_response_id",
                    "previous_response_not_found",
                )
            if prev.response["status"] in ("queued", "in_progress"):
                raise OpenAIError(
                    400,
                    f"previous response {req.previous_response_id!r} is still {prev.response['status']}",
                    "previous_response_id",
                )
            history = prev.conversation
        new, items = input_messages(req.input, self.tm.image_prompts is not None)
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history + new
        tools, choice = chat_tools(req.tools, req.tool_choice)
        logprobs = LOGPROBS_INCLUDE in (req.include or [])
        chat: dict[str, Any] = {
            "model": req.model,
            "messages": messages,
            "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tools": tools,
            "tool_choice": choice,
            "parallel_tool_calls": req.parallel_tool_calls,
            "logprobs": logprobs,
            "top_logprobs": req.top_logprobs if logprobs else None,
            "stream": req.stream,
            "user": req.user,
        }
        chat.update({k: body[k] for k in EXTENSIONS if body.get(k) is not None})
        fmt = req.text.format if req.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise OpenAIError(
                    400, "text.format.schema is required when text.format.type is 'json_schema'", "text.format.schema"
                )
            spec = {"name": fmt.name or "schema", "schema": fmt.schema_, "strict": fmt.strict}
            chat["response_format"] = {"type": "json_schema", "json_schema": spec}
        if req.reasoning is not None and req.reasoning.effort is not None:
            kwargs = dict(chat.get("chat_template_kwargs") or {})
            kwargs.setdefault("reasoning_effort", req.reasoning.effort)
            if req.reasoning.effort == "none":
                kwargs.setdefault("enable_thinking", False)
            chat["chat_template_kwargs"] = kwargs
        try:
            chat_req = ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
        except ValidationError as e:
            raise OpenAIError(400, format_validation_error(e)) from None
        try:
            obj = self.openai.chat_input(chat_req)
        except OpenAIError as e:
            e.param = {"response_format": "text.format", "messages": "input"}.get(e.param or "", e.param)
            raise
        return _Job(self, req, obj, chat_req._tool_calling, messages[1:] if req.instructions else messages, items)

    def _keep(self, job: _Job, tenant: str | None, task: asyncio.Task | None = None) -> None:
        if job.req.store:
            self.store.put(tenant, Stored(job.response, job.conversation(), job.items, task))

    def _start_background(self, job: _Job, tenant: str | None) -> Response:
        job.response["status"] = "queued"

        async def run():
            try:
                job.response["status"] = "in_progress"
                async for out in self.tm.generate_request(job.obj, _Detached(tenant)):
                    assert isinstance(out, dict), "one prompt with n = 1 gives one output"
                    job.finish(out)
            except asyncio.CancelledError:
                job.response["status"] = "cancelled"
                raise
            except Exception as e:  # a bad grammar, a dead worker: the response failed
                job.fail(str(e))
            finally:
                entry = self.store.get(tenant, job.id)
                if entry is not None:
                    entry.task = None
                    self._keep(job, tenant)

        task = asyncio.get_running_loop().create_task(run())
        self._keep(job, tenant, task)
        return Response(orjson.dumps(job.response), media_type="application/json")

    async def _events(self, job: _Job, gen: AsyncGenerator, first: Any, tenant: str | None):
        try:
            yield job.event("response.created", response=job.snapshot())
            yield job.event("response.in_progress", response=job.snapshot())
            out = first
            while True:
                for event in job.stream(out):
                    yield event
                if out["meta_info"]["finish_reason"] is not None:
                    break
                out = await gen.__anext__()
            self._keep(job, tenant)
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                job.response["status"], "response.failed"
            )
            yield job.event(kind, response=job.response)
        except ServiceUnavailable as e:
            job.fail(str(e))
            yield job.event("error", code="service_unavailable", message=str(e), param=None)
        finally:  # a client that went away cancels us here: abort its request now
            await gen.aclose()


class _Detached:
    """The `request` a background response generates under: its tenant, and never disconnected."""

    def __init__(self, tenant: str | None):
        self.state = type("State", (), {"tenant": tenant})()

    async def is_disconnected(self) -> bool:
        return False


class _Job:
    """One response: its object (updated as it generates), its output items and its stream."""

    def __init__(self, serving: ResponsesServing, req: ResponsesRequest, obj, fcp, messages: list[dict], items):
        self.serving, self.req, self.obj, self.fcp = serving, req, obj, fcp
        self.messages, self.items = messages, items
        self.id = _new_id("resp")
        name = serving.openai.reasoning_parser
        self.reasoning = name
        self.logprobs = LOGPROBS_INCLUDE in (req.include or [])
        self.output: list[dict] = []
        self.seq = 0
        self.turn = TurnStream(name, fcp)
        self.open: dict | None = None  # the output item being streamed
        self.sent_text = 0
        self.sent_lp = 0
        self.response = self._object()

    def _object(self) -> dict:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        text_format: dict = {"type": "text"}
        if fmt is not None:
            text_format = {k: v for k, v in fmt.model_dump(by_alias=True).items() if v is not None}
        return {
            "id": self.id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "background": req.background,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.serving.openai.model_name,
            "output": self.output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else {"effort": None, "summary": None},
            "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": text_format},
            "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
            "tools": req.tools or [],
            "top_logprobs": req.top_logprobs,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": None,
            "user": req.user,
        }

    def snapshot(self) -> dict:
        return {**self.response, "output": []}

    def param_of(self, message: str) -> str | None:
        return "text.format" if "json_schema" in message or "grammar" in message else None

    # -- the whole answer ------------------------------------------------------------------------

    def finish(self, out: dict) -> dict:
        """The final output: items, status and usage (a stream has built the items already)."""
        meta = out["meta_info"]
        if self.seq == 0:  # not streamed: the items come from the whole text
            self.output[:] = self._items(out["text"], meta)
        reason = meta.get("finish_reason") or {}
        status, details = "completed", None
        if reason.get("type") == "length":
            status, details = "incomplete", {"reason": "max_output_tokens"}
        elif reason.get("type") == "abort":
            self.response.update(status="failed", error={"code": "server_error", "message": reason.get("message", "")})
            status = "failed"
        reasoning_text = "".join(
            c["text"] for item in self.output if item["type"] == "reasoning" for c in item.get("content") or []
        )
        reasoning_tokens = (
            len(self.serving.tm.tokenizer.encode(reasoning_text, add_special_tokens=False)) if reasoning_text else 0
        )
        self.response.update(
            status=status,
            incomplete_details=details,
            usage={
                "input_tokens": meta["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": meta["cached_tokens"]},
                "output_tokens": meta["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, meta["completion_tokens"])},
                "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"],
            },
        )
        return self.response

    def fail(self, message: str) -> None:
        self.response.update(status="failed", error={"code": "server_error", "message": message})

    def _items(self, text: str, meta: dict) -> list[dict]:
        turn = split_turn(text, self.reasoning, self.fcp)
        items: list[dict] = []
        if turn.reasoning:
            items.append(self._reasoning_item(turn.reasoning))
        if turn.text or not turn.calls:
            lp = self._logprobs(meta, 0) if self.logprobs else None
            items.append(self._message_item(turn.text, lp))
        for call in turn.calls:
            items.append(
                {
                    "type": "function_call",
                    "id": _new_id("fc"),
                    "call_id": call.id,
                    "name": call.name,
                    "arguments": call.arguments,
                    "status": "completed",
                }
            )
        return items

    @staticmethod
    def _reasoning_item(text: str, status: str = "completed") -> dict:
        return {
            "type": "reasoning",
            "id": _new_id("rs"),
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "status": status,
        }

    @staticmethod
    def _text_part(text: str, logprobs: list | None) -> dict:
        part = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        return part

    def _message_item(self, text: str, logprobs: list | None, status: str = "completed") -> dict:
        content = [self._text_part(text, logprobs)] if status == "completed" else []
        return {"type": "message", "id": _new_id("msg"), "status": status, "role": "assistant", "content": content}

    def _logprobs(self, meta: dict, start: int) -> list[dict]:
        entries = self.serving.openai.chat_logprobs(meta, start)["content"]
        return [
            {
                "token": e["token"],
                "logprob": e["logprob"],
                "bytes": e["bytes"],
                "top_logprobs": [
                    {"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]} for t in e["top_logprobs"]
                ],
            }
            for e in entries
        ]

    def conversation(self) -> list[dict]:
        """The chat messages after this response: its input and its output (reasoning left out)."""
        text = "".join(c["text"] for item in self.output if item["type"] == "message" for c in item["content"])
        calls = [
            {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
            for i in self.output
            if i["type"] == "function_call"
        ]
        reply: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            reply["tool_calls"] = calls
        return [*self.messages, reply]

    # -- the stream ------------------------------------------------------------------------------

    def event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def stream(self, out: dict) -> list[bytes]:
        meta = out["meta_info"]
        done = meta["finish_reason"] is not None
        delta = out["text"][self.sent_text :]
        self.sent_text = len(out["text"])
        events: list[bytes] = []
        pieces = self.turn.feed(delta, done)
        for piece in pieces:
            events += self._piece(piece, meta)
        if done:
            if not any(i["type"] in ("message", "function_call") for i in self.output):
                events += self._piece(Piece("text", ""), meta)
            events += self._close()
            self.finish(out)
        return events

    def _piece(self, piece: Piece, meta: dict) -> list[bytes]:
        events: list[bytes] = []
        kind = {"reasoning": "reasoning", "text": "message", "call": "function_call", "args": "function_call"}[
            piece.kind
        ]
        if self.open is not None and (self.open["type"] != kind or piece.kind == "call"):
            events += self._close()
        if self.open is None:
            events += self._open(piece)
        item, k = self.open, len(self.output) - 1
        assert item is not None
        if piece.kind == "reasoning":
            item["content"][0]["text"] += piece.text
            events.append(
                self.event(
                    "response.reasoning_text.delta",
                    item_id=item["id"],
                    output_index=k,
                    content_index=0,
                    delta=piece.text,
                )
            )
        elif piece.kind == "text":
            part = item["content"][0]
            part["text"] += piece.text
            lp: list = []
            if self.logprobs:
                lp = self._logprobs(meta, self.sent_lp)
                self.sent_lp += len(lp)
                part["logprobs"] += lp
            if piece.text or lp:
                events.append(
                    self.event(
                        "response.output_text.delta",
                        item_id=item["id"],
                        output_index=k,
                        content_index=0,
                        delta=piece.text,
                        logprobs=lp,
                    )
                )
        elif piece.kind == "args":
            item["arguments"] += piece.text
            events.append(
                self.event(
                    "response.function_call_arguments.delta", item_id=item["id"], output_index=k, delta=piece.text
                )
            )
        return events

    def _open(self, piece: Piece) -> list[bytes]:
        k = len(self.output)
        item: dict[str, Any]
        part: dict | None
        if piece.kind == "reasoning":
            item = self._reasoning_item("", "in_progress")
            part = {"type": "reasoning_text", "text": ""}
            item["content"] = []
        elif piece.kind == "text":
            item = self._message_item("", None, "in_progress")
            part = self._text_part("", [] if self.logprobs else None)
        else:
            item = {
                "type": "function_call",
                "id": _new_id("fc"),
                "call_id": piece.id,
                "name": piece.name,
                "arguments": "",
                "status": "in_progress",
            }
            part = None
        self.output.append(item)
        self.open = item
        events = [
            self.event("response.output_item.added", output_index=k, item=dict(item, content=[]) if part else item)
        ]
        if part is not None:
            item["content"] = [part]
            events.append(
                self.event(
                    "response.content_part.added", item_id=item["id"], output_index=k, content_index=0, part=part
                )
            )
        return events

    def _close(self) -> list[bytes]:
        item, k = self.open, len(self.output) - 1
        if item is None:
            return []
        self.open = None
        item["status"] = "completed"
        events = []
        if item["type"] == "function_call":
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=k,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {"logprobs": part.get("logprobs") or []} if item["type"] == "message" else {}
            events.append(
                self.event(done, item_id=item["id"], output_index=k, content_index=0, text=part["text"], **extra)
            )
            events.append(
                self.event("response.content_part.done", item_id=item["id"], output_index=k, content_index=0, part=part)
            )
        events.append(self.event("response.output_item.done", output_index=k, item=item))
        return events

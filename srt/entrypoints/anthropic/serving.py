"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A request becomes a chat completion request (blocks -> chat messages, `tool_use` -> assistant tool
calls, `tool_result` -> tool messages, tools' `input_schema` -> function parameters, `tool_choice`
`any` -> required) and runs through OpenAIServing's chat path, so tool calls use the same parsers
and the valid-by-construction grammar, and thinking uses the reasoning parser. The answer is
Anthropic's `content` blocks (`thinking`, `text`, `tool_use`) with its `stop_reason`, a stream its
events. Usage follows Anthropic: `input_tokens` counts the prompt tokens not served from the prefix
cache, `cache_read_input_tokens` those that were (their sum is what count_tokens says).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any, Literal

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, ValidationError

from srt.entrypoints.openai.chat_turn import Piece, TurnStream, parse_body, split_turn
from srt.entrypoints.openai.protocol import ChatCompletionRequest, _Body, format_validation_error
from srt.entrypoints.openai.serving import EventStream, OpenAIError, OpenAIServing
from srt.managers.io_struct import InvalidRequest
from srt.managers.tokenizer_manager import ServiceUnavailable
from srt.sampling.sampling_params import InvalidSamplingParams

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# The request fields of Anthropic's client (MessageCreateParams, MessageCountTokensParams) and the
# sampling fields older clients send, and what this server does with each; README.md's table says
# the same, and tests/server/test_agent_apis.py checks the three agree. `cache_control` changes
# nothing: the radix cache keeps every prompt prefix without being asked.
SUPPORTED_FIELDS = (
    "cache_control",
    "max_tokens",
    "messages",
    "metadata",
    "model",
    "output_config",
    "stop_sequences",
    "stream",
    "system",
    "temperature",
    "thinking",
    "tool_choice",
    "tools",
    "top_k",
    "top_p",
)
REJECTED_FIELDS: tuple[str, ...] = ()
# Accepted and ignored, with a warning in the server log (once per field).
IGNORED_FIELDS = (
    "service_tier",
    "container",
    "context_management",
    "mcp_servers",
    "inference_geo",
    "speed",
    "diagnostics",
    "user_profile_id",
    "workspace_id",
)
EXTENSIONS = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "regex", "ebnf", "rid")


def anthropic_error(status: int, message: str, retry_after: Any = None) -> Response:
    body = {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
    response = Response(orjson.dumps(body), status_code=status, media_type="application/json")
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    return response


class AnthropicError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Body):
    format: OutputFormat | None = None
    effort: str | None = None


class CountTokensRequest(_Body):
    model: str | None = None
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=0)  # 0: only fill the prefix cache
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    stream: bool = False
    metadata: dict | None = None


def _text_blocks(value: Any, where: str) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise AnthropicError(400, f"{where}: must be a string or a list of text blocks")
    out = []
    for j, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise AnthropicError(400, f"{where}.{j}.type: {kind!r} is not supported here (text blocks are)")
        out.append(block["text"])
    return "".join(out)


def _image_url(block: dict, where: str) -> str:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        return f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    if kind == "url" and isinstance(source, dict) and isinstance(source.get("url"), str):
        return source["url"]
    raise AnthropicError(400, f"{where}.source.type: {kind!r} is not supported (base64 and url are)")


def chat_messages(req: CountTokensRequest, vision: bool) -> list[dict]:
    messages: list[dict] = []
    if req.system is not None:
        system = _text_blocks(req.system, "system")
        if system:
            messages.append({"role": "system", "content": system})
    names: dict[str, str] = {}
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant", "system"):
            raise AnthropicError(400, f"{where}.role: {role!r} must be 'user', 'assistant' or 'system'")
        content = m.get("content")
        if role == "system":
            messages.append({"role": "system", "content": _text_blocks(content, f"{where}.content")})
            continue
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise AnthropicError(400, f"{where}.content: must be a string or a list of content blocks")
        parts: list[dict] = []
        calls: list[dict] = []
        results: list[dict] = []
        for j, block in enumerate(content):
            here = f"{where}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image":
                if not vision:
                    raise AnthropicError(400, f"{here}: an image; this model accepts text only")
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block, here)}})
            elif kind == "tool_use" and role == "assistant":
                call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
                if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, dict):
                    raise AnthropicError(
                        400, f"{here}: tool_use needs a string `id`, a string `name` and an object `input`"
                    )
                names[call_id] = name
                calls.append(
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
                )
            elif kind == "tool_result" and role == "user":
                call_id = block.get("tool_use_id")
                if not isinstance(call_id, str):
                    raise AnthropicError(400, f"{here}.tool_use_id: must be a string")
                text = _text_blocks(block.get("content", ""), f"{here}.content")
                if block.get("is_error"):
                    text = f"Error: {text}"
                result = {"role": "tool", "tool_call_id": call_id, "content": text}
                if call_id in names:
                    result["name"] = names[call_id]
                results.append(result)
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier thinking is not shown to the model again (chat templates drop it too)
            else:
                allowed = "text, image, tool_use, thinking" if role == "assistant" else "text, image, tool_result"
                raise AnthropicError(400, f"{here}.type: {kind!r} is not supported in a {role} message ({allowed})")
        messages += results
        if parts or calls or not results:
            if any(p["type"] == "image_url" for p in parts):
                body: Any = parts
            else:
                body = "".join(p["text"] for p in parts)
            msg: dict[str, Any] = {"role": role, "content": body if (body or not calls) else None}
            if calls:
                msg["tool_calls"] = calls
            messages.append(msg)
    return messages


def chat_tools(req: CountTokensRequest) -> tuple[list[dict] | None, Any, bool]:
    """Anthropic tools and tool_choice -> chat's (tools, tool_choice, parallel_tool_calls)."""
    tools = None
    if req.tools is not None:
        tools = []
        for i, t in enumerate(req.tools):
            if not isinstance(t, dict) or t.get("type", "custom") not in ("custom", None):
                kind = t.get("type") if isinstance(t, dict) else type(t).__name__
                raise AnthropicError(400, f"tools.{i}.type: {kind!r} is not supported (only custom tools are)")
            if "input_schema" not in t:
                raise AnthropicError(400, f"tools.{i}.input_schema: Field required")
            fn = {"name": t.get("name"), "parameters": t["input_schema"]}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            if t.get("strict") is not None:
                fn["strict"] = t["strict"]
            tools.append({"type": "function", "function": fn})
    choice: Any = None
    parallel = True
    tc = req.tool_choice
    if tc is not None:
        kind = tc.get("type")
        parallel = not tc.get("disable_parallel_tool_use", False)
        if kind == "auto":
            choice = "auto"
        elif kind == "any":
            choice = "required"
        elif kind == "none":
            choice = "none"
        elif kind == "tool":
            choice = {"type": "function", "function": {"name": tc.get("name")}}
        else:
            raise AnthropicError(400, f"tool_choice.type: {kind!r} must be auto, any, tool or none")
        if choice != "none" and not tools:
            raise AnthropicError(400, f"tool_choice: {kind!r} needs `tools`")
    return tools, choice, parallel


class AnthropicServing:
    def __init__(self, openai: OpenAIServing):
        self.openai = openai
        self.tm = openai.tm

    # -- routes ----------------------------------------------------------------------------------

    async def messages(self, body: Any, request: Request) -> Response:
        try:
            req = self._parse(MessagesRequest, body)
            assert isinstance(req, MessagesRequest)
            chat_req = self._chat(req, body)
            obj = self._input(chat_req)
        except AnthropicError as e:
            return anthropic_error(e.status, e.message)
        try:
            gen = self.tm.generate_request(obj, request)
            first = await gen.__anext__()
        except (InvalidRequest, InvalidSamplingParams) as e:
            return anthropic_error(400, str(e))
        except ServiceUnavailable as e:
            return anthropic_error(e.status, str(e), e.retry_after)
        reply = _Reply(self, req, chat_req._tool_calling)
        if not req.stream:
            assert isinstance(first, dict), "one prompt with n = 1 gives one output"
            reason = first["meta_info"]["finish_reason"] or {}
            if reason.get("type") == "abort":
                return anthropic_error(reason.get("status_code") or 500, reason.get("message") or "aborted")
            return Response(orjson.dumps(reply.whole(first)), media_type="application/json")
        return EventStream(self._events(reply, gen, first))

    async def count_tokens(self, body: Any, request: Request) -> Response:
        try:
            req = self._parse(CountTokensRequest, body)
            obj = self._input(self._chat(req, body))
        except AnthropicError as e:
            return anthropic_error(e.status, e.message)
        assert obj.input_ids is not None and isinstance(obj.input_ids[0], int), "a chat prompt is one list of ids"
        count = len(obj.input_ids)
        if obj.image_data:
            try:
                expanded = await self.tm.expand_images(obj)
            except (InvalidRequest, ValueError) as e:
                return anthropic_error(400, str(e))
            count += sum(getattr(it, "num_rows", 0) for it in expanded or ()) - len(obj.image_data)
        return Response(orjson.dumps({"input_tokens": count}), media_type="application/json")

    # -- requests --------------------------------------------------------------------------------

    @staticmethod
    def _parse(model: type[CountTokensRequest], body: Any) -> CountTokensRequest:
        return parse_body(model, body, "/v1/messages", IGNORED_FIELDS, lambda message: AnthropicError(400, message))

    def _chat(self, req: CountTokensRequest, body: dict) -> ChatCompletionRequest:
        messages = chat_messages(req, self.tm.image_prompts is not None)
        tools, choice, parallel = chat_tools(req)
        chat: dict[str, Any] = {
            "model": req.model,
            "messages": messages,
            "tools": tools,
            "tool_choice": choice,
            "parallel_tool_calls": parallel,
        }
        kwargs: dict[str, Any] = {}
        if req.thinking is not None:
            kwargs["enable_thinking"] = req.thinking.type != "disabled"
        config = req.output_config
        if config is not None and config.effort is not None:
            kwargs["reasoning_effort"] = config.effort
        if config is not None and config.format is not None:
            spec = {"name": "output", "schema": config.format.schema_, "strict": True}
            chat["response_format"] = {"type": "json_schema", "json_schema": spec}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
            chat["continue_final_message"] = True  # prefill: the answer continues the assistant's text
        if isinstance(req, MessagesRequest):
            chat.update(
                max_tokens=req.max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                stop=req.stop_sequences or None,
                stream=req.stream,
                user=(req.metadata or {}).get("user_id"),
            )
            chat.update({k: body[k] for k in EXTENSIONS if body.get(k) is not None})
            kwargs = {**kwargs, **(body.get("chat_template_kwargs") or {})}
        if kwargs:
            chat["chat_template_kwargs"] = kwargs
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
        except ValidationError as e:
            raise AnthropicError(400, format_validation_error(e)) from None

    def _input(self, chat_req: ChatCompletionRequest):
        try:
            return self.openai.chat_input(chat_req)
        except OpenAIError as e:
            raise AnthropicError(e.status, e.message) from None

    async def _events(self, reply: _Reply, gen: AsyncGenerator, first: Any):
        try:
            yield reply.event("message_start", message=reply.start(first))
            yield reply.event("ping")
            out = first
            while True:
                for event in reply.stream(out):
                    yield event
                if out["meta_info"]["finish_reason"] is not None:
                    break
                out = await gen.__anext__()
        except ServiceUnavailable as e:
            yield reply.event("error", error={"type": "overloaded_error", "message": str(e)})
        finally:  # a client that went away cancels us here: abort its request now
            await gen.aclose()


class _Reply:
    """One message's answer: whole, or as Anthropic's stream events."""

    def __init__(self, serving: AnthropicServing, req: MessagesRequest, fcp):
        self.serving, self.req, self.fcp = serving, req, fcp
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.reasoning = serving.openai.reasoning_parser
        self.turn = TurnStream(self.reasoning, fcp)
        self.blocks: list[dict] = []  # streamed so far
        self.open: dict | None = None
        self.sent_text = 0
        self.omit_thinking = req.thinking is not None and req.thinking.display == "omitted"

    def _usage(self, meta: dict) -> dict:
        cached = meta.get("cached_tokens", 0)
        return {
            "input_tokens": meta["prompt_tokens"] - cached,
            "output_tokens": meta["completion_tokens"],
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def _stop(self, meta: dict, called: bool) -> tuple[str, str | None]:
        reason = meta["finish_reason"] or {}
        if reason.get("type") == "length":
            return "max_tokens", None
        if called:
            return "tool_use", None
        matched = reason.get("matched")
        if isinstance(matched, str) and matched in (self.req.stop_sequences or []):
            return "stop_sequence", matched
        return "end_turn", None

    def _message(self, content: list[dict], meta: dict, stop: tuple[str | None, str | None]) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.serving.openai.model_name,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": self._usage(meta),
        }

    def whole(self, out: dict) -> dict:
        turn = split_turn(out["text"], self.reasoning, self.fcp)
        content: list[dict] = []
        if turn.reasoning:
            shown = "" if self.omit_thinking else turn.reasoning
            content.append({"type": "thinking", "thinking": shown, "signature": ""})
        if turn.text:
            content.append({"type": "text", "text": turn.text})
        for call in turn.calls:
            content.append(
                {"type": "tool_use", "id": _tool_id(call.id), "name": call.name, "input": _args(call.arguments)}
            )
        return self._message(content, out["meta_info"], self._stop(out["meta_info"], bool(turn.calls)))

    # -- the stream ------------------------------------------------------------------------------

    @staticmethod
    def event(kind: str, **fields) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"

    def start(self, out: dict) -> dict:
        meta = dict(out["meta_info"], completion_tokens=0)
        return self._message([], meta, (None, None))

    def stream(self, out: dict) -> list[bytes]:
        meta = out["meta_info"]
        done = meta["finish_reason"] is not None
        delta = out["text"][self.sent_text :]
        self.sent_text = len(out["text"])
        events: list[bytes] = []
        for piece in self.turn.feed(delta, done):
            events += self._piece(piece)
        if done:
            events += self._close()
            called = any(b["type"] == "tool_use" for b in self.blocks)
            stop_reason, stop_sequence = self._stop(meta, called)
            usage = self._usage(meta)
            events.append(
                self.event(
                    "message_delta",
                    delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    usage=usage,
                )
            )
            events.append(self.event("message_stop"))
        return events

    def _piece(self, piece: Piece) -> list[bytes]:
        kind = {"reasoning": "thinking", "text": "text", "call": "tool_use", "args": "tool_use"}[piece.kind]
        events: list[bytes] = []
        if self.open is not None and (self.open["type"] != kind or piece.kind == "call"):
            events += self._close()
        if self.open is None:
            if kind == "thinking":
                block: dict = {"type": "thinking", "thinking": "", "signature": ""}
            elif kind == "text":
                block = {"type": "text", "text": ""}
            else:
                block = {"type": "tool_use", "id": _tool_id(piece.id), "name": piece.name, "input": {}}
            self.blocks.append(block)
            self.open = block
            events.append(self.event("content_block_start", index=len(self.blocks) - 1, content_block=block))
        index = len(self.blocks) - 1
        if piece.kind == "reasoning":
            events.append(
                self.event("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": piece.text})
            )
        elif piece.kind == "text" and piece.text:
            events.append(
                self.event("content_block_delta", index=index, delta={"type": "text_delta", "text": piece.text})
            )
        elif piece.kind == "args":
            events.append(
                self.event(
                    "content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": piece.text}
                )
            )
        return events

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        events = []
        if self.open["type"] == "thinking":
            events.append(
                self.event(
                    "content_block_delta",
                    index=len(self.blocks) - 1,
                    delta={"type": "signature_delta", "signature": ""},
                )
            )
        self.open = None
        events.append(self.event("content_block_stop", index=len(self.blocks) - 1))
        return events


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _args(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}

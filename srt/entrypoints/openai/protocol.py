"""OpenAI request bodies (completions, chat completions) with SGLang's extra sampling fields.

Unknown fields are ignored (clients and routers add their own). A value out of range is a 400
whose message names the field, the value and the limit (see `format_validation_error`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

MAX_N = 128
MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    name: str = "schema"
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Body):
    """Sampling fields shared by both routes (OpenAI's, then SGLang's extensions)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    user: str | None = None
    response_format: ResponseFormat | None = None
    # SGLang extensions
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None  # checked (400 naming it) by SamplingParams
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    rid: str | None = None
    priority: int | None = None  # with --enable-priority-scheduling (docs/qos.md)
    timeout: float | None = Field(default=None, gt=0)  # seconds; past it the request is aborted
    lora_path: str | None = None  # a LoRA adapter's name (also: "model": "<base>:<adapter>")
    # prefill-decode disaggregation (what SGLang's router adds; one per prompt in a batch)
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError(f"at most 16 stop sequences, got {len(v)}")
        return v

    def sampling_params(self, max_new_tokens: int | None) -> dict:
        params: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "n": self.n,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_new_tokens": self.min_tokens,
            "stop": self.stop or None,
            "stop_token_ids": self.stop_token_ids,
            "stop_regex": self.stop_regex,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "logit_bias": self.logit_bias,
            "sampling_seed": self.seed,
            "regex": self.regex,
            "json_schema": self.json_schema,
            "ebnf": self.ebnf,
        }
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            params["json_schema"] = '{"type": "object"}'
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ValueError(
                    "response_format.json_schema.schema is required when response_format.type is 'json_schema'"
                )
            params["json_schema"] = json.dumps(fmt.json_schema.schema_)
        return {k: v for k, v in params.items() if v is not None}


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("must not be an empty list")
        return v


def _part_text(part: dict, j: int) -> str:
    if not isinstance(part.get("text"), str):
        raise ValueError(f"content[{j}].text = {part.get('text')!r} is invalid: a text part needs a string `text`")
    return part["text"]


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    def text(self) -> str | None:
        """Text content (a text-only model); a list of parts must be text parts."""
        if not isinstance(self.content, list):
            return self.content
        out = []
        for j, part in enumerate(self.content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                raise ValueError(f"content[{j}] is an image; this model accepts text only, not images")
            if isinstance(part, dict) and part.get("type") == "text":
                out.append(_part_text(part, j))
                continue
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"content[{j}] of type {kind!r} is not supported (text and image_url parts are)")
        return "".join(out)

    def parts(self) -> tuple[list[dict], list[tuple[int, str]]]:
        """Content as a vision-language chat template reads it (text parts and `{"type": "image"}`
        where an image goes) and the images' (part index, url) in order."""
        if not isinstance(self.content, list):
            return [{"type": "text", "text": self.content or ""}], []
        parts, images = [], []
        for j, part in enumerate(self.content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": _part_text(part, j)})
            elif kind == "image_url":
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                if not isinstance(url, str) or not url:
                    raise ValueError(f"content[{j}].image_url must be an object with a non-empty `url`")
                detail = ref.get("detail", "auto") if isinstance(ref, dict) else "auto"
                if detail not in ("auto", "low", "high"):
                    raise ValueError(f"content[{j}].image_url.detail = {detail!r} must be auto, low or high")
                parts.append({"type": "image"})
                images.append((j, url))
            else:
                raise ValueError(f"content[{j}] of type {kind!r} is not supported (text and image_url parts are)")
        return parts, images


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    # with --reasoning-parser: put <think> text in reasoning_content; stream it as it comes
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # the checked tool calling (srt.function_call.FunctionCallParser), set once the request is read
    _tool_calling: Any = PrivateAttr(default=None)


def format_validation_error(e: ValidationError) -> str:
    """'field = value is invalid: reason' for each problem, in the style of the native API's errors."""
    parts = []
    for err in e.errors()[:4]:
        loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("function-", "tagged-union")))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            parts.append(f"`{loc}` is required")
        else:
            value = err.get("input")
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            parts.append(f"`{loc}` = {shown} is invalid: {msg}")
    return "; ".join(parts)

"""`--tool-call-parser`: the formats by SGLang's names, the checks on a request's `tools` and
`tool_choice`, and the grammar that makes `required`, named and `strict` calls valid by construction.

Constraints: with a format a grammar can write (JSON arguments between fixed strings), calls are
generated in the model's own format under an xgrammar structural tag: `required` and a named
function as one or more tagged calls (at least one; one unless `parallel_tool_calls`), `auto` with a
`strict` tool as free text in which each call, once its opening marker appears, follows its
function's parameter schema. Otherwise (`pythonic`, or no parser) `required` / named generate
SGLang's JSON list of calls under a JSON schema. Every call in an answer is then parsed back
by the same detector the free-text path uses.
"""

from __future__ import annotations

import json
from typing import Any

from srt.function_call.core import NAME_RE, BaseFormatDetector
from srt.function_call.deepseekv3 import DeepSeekV3Detector
from srt.function_call.hermes import HermesDetector
from srt.function_call.json_array import JsonArrayDetector, array_schema, parameters_schema
from srt.function_call.llama3 import Llama3Detector
from srt.function_call.mistral import MistralDetector
from srt.function_call.pythonic import PythonicDetector
from srt.function_call.smollm2 import SmolLM2Detector

TOOL_CALL_PARSERS: dict[str, type[BaseFormatDetector]] = {
    "hermes": HermesDetector,
    "qwen25": HermesDetector,
    "qwen": HermesDetector,
    "llama3": Llama3Detector,
    "mistral": MistralDetector,
    "pythonic": PythonicDetector,
    "deepseekv3": DeepSeekV3Detector,
    "smollm2": SmolLM2Detector,
}


class ToolError(ValueError):
    """A bad `tools` / `tool_choice`: the message names the field; `param` is its path."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def check_tools(tools: Any) -> list[dict]:
    """The request's tools, checked: OpenAI's shape, names unique, parameters a valid JSON schema."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if not isinstance(tools, list):
        raise ToolError("tools", f"must be a list of tools, got {type(tools).__name__}")
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolError(f"{where}.type", "only tools of type 'function' are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function", "is required (an object with `name`)")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ToolError(f"{where}.function.name", f"{name!r} must be 1-64 letters, digits, '_', '-' or '.'")
        if name in seen:
            raise ToolError(f"{where}.function.name", f"{name!r} is also tools[{seen[name]}]'s name")
        seen[name] = i
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise ToolError(f"{where}.function.parameters", "must be a JSON schema object")
            try:
                Draft202012Validator.check_schema(params)
            except SchemaError as e:
                raise ToolError(f"{where}.function.parameters", f"is not a valid JSON schema: {e.message}") from None
        if "strict" in fn and not isinstance(fn["strict"], bool | None):
            raise ToolError(f"{where}.function.strict", "must be a boolean")
    return tools


def check_tool_choice(choice: Any, tools: list[dict] | None) -> str | dict:
    """'none' | 'auto' | 'required' | {"type": "function", "function": {"name": ...}} (default: auto
    with tools, none without)."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ToolError("tool_choice", f"{choice!r} must be 'none', 'auto', 'required' or a named function")
        if choice == "required" and not tools:
            raise ToolError("tool_choice", "'required' needs `tools`")
        return choice
    if not isinstance(choice, dict) or not isinstance(choice.get("function"), dict):
        raise ToolError("tool_choice", 'must be a string or {"type": "function", "function": {"name": ...}}')
    name = choice["function"].get("name")
    names = [t["function"]["name"] for t in tools or []]
    if name not in names:
        raise ToolError("tool_choice.function.name", f"{name!r} is not one of the tools ({', '.join(names) or 'none'})")
    return {"type": "function", "function": {"name": name}}


class FunctionCallParser:
    """One request's tool calling: which detector reads the output, and the grammar (if any)."""

    def __init__(self, parser_name: str | None, tools: list[dict], tool_choice: str | dict, parallel: bool = True):
        self.tools = tools
        fmt = TOOL_CALL_PARSERS[parser_name](tools) if parser_name else None
        only = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        named = only is not None
        forced = named or tool_choice == "required"
        self.callable = [t for t in tools if only is None or t["function"]["name"] == only]
        if forced and (fmt is None or fmt.structure("f") is None):
            self.detector: BaseFormatDetector | None = JsonArrayDetector(tools)
            self.constraint: tuple[str, str] | None = (
                "json_schema",
                json.dumps(array_schema(self.callable, parallel and not named)),
            )
            return
        self.detector = fmt
        self.constraint = None
        if fmt is None:
            return
        if forced:
            fmt_spec: dict = {
                "type": "tags_with_separator",
                "tags": self._tags(fmt, self.callable, strict_only=False),
                "separator": fmt.separator,
                "at_least_one": True,
                "stop_after_first": named or not parallel,
            }
        elif any(t["function"].get("strict") for t in tools) and (info := fmt.structure("f")) is not None:
            fmt_spec = {
                "type": "triggered_tags",
                "triggers": [info.trigger],
                "tags": self._tags(fmt, tools, strict_only=True),
                "at_least_one": False,
                "stop_after_first": not parallel,
            }
        else:
            return
        self.constraint = ("structural_tag", json.dumps({"type": "structural_tag", "format": fmt_spec}))

    @staticmethod
    def _tags(fmt: BaseFormatDetector, tools: list[dict], strict_only: bool) -> list[dict]:
        tags = []
        for t in tools:
            info = fmt.structure(t["function"]["name"])
            assert info is not None
            schema = parameters_schema(t)
            if strict_only and not t["function"].get("strict"):
                schema = {"type": "object"}  # a non-strict tool's arguments: any object
            # at most one blank between JSON tokens: a small model under a grammar can loop on blanks forever
            content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
            tags.append({"type": "tag", "begin": info.begin, "content": content, "end": info.end})
        return tags

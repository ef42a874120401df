"""The format-free form of `tool_choice: required` / a named function (SGLang's, for parsers whose
format a grammar cannot write, and for servers without --tool-call-parser): the whole output is a
JSON list of calls, `[{"name": "f", "parameters": {...}}, ...]`, generated under a JSON schema."""

from __future__ import annotations

from srt.function_call.core import BAD, BaseFormatDetector, Call, Scan, object_list


class JsonArrayDetector(BaseFormatDetector):
    name = "json_array"

    def scan(self, text: str, final: bool) -> Scan:
        calls, end = object_list(text, 0, final)
        scan = Scan()
        if not calls and end < 0:
            if final or end == BAD:
                scan.text(text)
            else:
                scan.segments.append(Call(raw=text))
            return scan
        bounds = [s for _, s in calls] + [len(text) if end < 0 else end]
        bounds[0] = 0
        for n, (call, _) in enumerate(calls):
            call.raw = text[bounds[n] : bounds[n + 1]]
            if end < 0 and n == len(calls) - 1:
                call.done = False
            scan.segments.append(call)
        if end >= 0:
            scan.text(text[end:])
        return scan


def array_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of that list for these tools (one call unless parallel)."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": parameters_schema(t),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parameters_schema(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}

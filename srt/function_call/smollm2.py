"""SmolLM2's own format (the default model; its Ollama template and training data): a JSON list of
calls in one block, `<tool_call>[{"name": "f", "arguments": {...}}, ...]</tool_call>`.

Its Hugging Face chat template does not render tools, so this format also writes them into the
prompt (`adapt_messages`): the tools go in a system message as SmolLM2 was trained to read them,
earlier calls become the assistant's `<tool_call>` text and tool results user turns in
`<tool_response>` tags."""

from __future__ import annotations

import json

from srt.function_call.core import BaseFormatDetector, Scan, StructureInfo, object_list, scan_marked

BOT, EOT = "<tool_call>", "</tool_call>"

SYSTEM = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the functions can be used, point it out and refuse to answer.\n"
    "If the given question lacks the parameters required by the function, also point it out.\n"
    "You have access to the following tools:\n"
    "<tools>{tools}</tools>\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct. If no function call is "
    "needed, please make the tool calls an empty list '[]'.\n"
    '<tool_call>[\n{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},\n'
    "(more tool calls as required)\n]</tool_call>"
)


class SmolLM2Detector(BaseFormatDetector):
    name = "smollm2"
    separator = ""

    def scan(self, text: str, final: bool) -> Scan:
        return scan_marked(text, final, BOT, object_list, EOT)

    def structure(self, function_name: str) -> StructureInfo:
        begin = f'{BOT}[{{"name": {json.dumps(function_name)}, "arguments": '
        return StructureInfo(begin=begin, end=f"}}]{EOT}", trigger=BOT)

    @staticmethod
    def adapt_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
        out: list[dict] = []
        if tools:
            listed = json.dumps([t["function"] for t in tools], ensure_ascii=False)
            system = SYSTEM.format(tools=listed)
            if messages and messages[0]["role"] == "system" and messages[0].get("content"):
                system = messages[0]["content"] + "\n\n" + system
                messages = messages[1:]
            out.append({"role": "system", "content": system})
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = [
                    {"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}
                    for c in m["tool_calls"]
                ]
                text = (m.get("content") or "") + BOT + json.dumps(calls, ensure_ascii=False) + EOT
                out.append({"role": "assistant", "content": text})
            elif m["role"] == "tool":
                out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
            else:
                out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
        return out


def _arguments(args) -> object:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args if args is not None else {}

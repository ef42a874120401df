"""Hermes / Qwen 2.5 format: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one
block per call, text around them is content. `hermes` and `qwen25` name the same format."""

from __future__ import annotations

import json

from srt.function_call.core import BaseFormatDetector, Scan, StructureInfo, one_object, scan_marked

BOT, EOT = "<tool_call>", "</tool_call>"


class HermesDetector(BaseFormatDetector):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        return scan_marked(text, final, BOT, one_object, EOT)

    def structure(self, function_name: str) -> StructureInfo:
        begin = f'{BOT}\n{{"name": {json.dumps(function_name)}, "arguments": '
        return StructureInfo(begin=begin, end=f"}}\n{EOT}", trigger=BOT)

"""Mistral format: `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]` after any text."""

from __future__ import annotations

import json

from srt.function_call.core import BaseFormatDetector, Scan, StructureInfo, object_list, scan_marked

BOT = "[TOOL_CALLS]"


class MistralDetector(BaseFormatDetector):
    name = "mistral"
    separator = ""

    def scan(self, text: str, final: bool) -> Scan:
        return scan_marked(text, final, BOT, object_list)

    def structure(self, function_name: str) -> StructureInfo:
        begin = f'{BOT} [{{"name": {json.dumps(function_name)}, "arguments": '
        return StructureInfo(begin=begin, end="}]", trigger=BOT)

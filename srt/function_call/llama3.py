"""Llama 3.1-3.3 JSON format: `<|python_tag|>{"name": "f", "parameters": {...}}`, several calls
separated by `;`; without the tag, an output that is JSON call objects from its first character."""

from __future__ import annotations

import json
from functools import partial

from srt.function_call.core import (
    BaseFormatDetector,
    Call,
    Scan,
    StructureInfo,
    object_list,
    partial_marker,
    scan_marked,
    skip_ws,
)

BOT = "<|python_tag|>"
calls_body = partial(object_list, open_="", sep=";", close=None)


class Llama3Detector(BaseFormatDetector):
    name = "llama3"
    separator = ";"

    def scan(self, text: str, final: bool) -> Scan:
        if BOT in text:
            return scan_marked(text, final, BOT, calls_body)
        j = skip_ws(text, 0)
        if j == len(text) and not final:  # nothing but blanks yet: could become either
            scan = Scan()
            scan.text(text)
            scan.hold = len(text)
            return scan
        if j < len(text) and text[j] == "{":
            scan = scan_marked("\0" + text, final, "\0", calls_body)  # a virtual marker at the start
            first = scan.segments[0] if scan.segments else None
            if isinstance(first, Call):
                first.raw = first.raw[1:]
            elif isinstance(first, str):
                scan.segments[0] = first[1:]
            return scan
        scan = Scan()
        scan.text(text)
        if not final:
            scan.hold = partial_marker(text, (BOT,))
        return scan

    def structure(self, function_name: str) -> StructureInfo:
        begin = f'{BOT}{{"name": {json.dumps(function_name)}, "parameters": '
        return StructureInfo(begin=begin, end="}", trigger=BOT)

"""DeepSeek-V3 format:
`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`."""

from __future__ import annotations

from srt.function_call.core import (
    BAD,
    INCOMPLETE,
    BaseFormatDetector,
    Call,
    Scan,
    StructureInfo,
    scan_marked,
    skip_ws,
    value_end,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "\n```json\n", "\n```"


def _calls(text: str, i: int, final: bool):
    calls: list[tuple[Call, int]] = []
    while True:
        j = skip_ws(text, i)
        rest = text[j:]
        if not rest or (CALL_BEGIN.startswith(rest) and not final):
            return calls, INCOMPLETE
        if not rest.startswith(CALL_BEGIN):
            return calls, j if calls else BAD
        k = j + len(CALL_BEGIN)
        head = "function" + SEP
        if not text.startswith(head, k):
            return (calls, INCOMPLETE) if head.startswith(text[k:]) and not final else (calls, BAD)
        k += len(head)
        nl = text.find(FENCE_OPEN, k)
        call = Call(raw="")
        calls.append((call, j))
        if nl < 0:
            return calls, INCOMPLETE
        call.name = text[k:nl].strip()
        a = nl + len(FENCE_OPEN)
        end = value_end(text, a, final)
        if end == BAD:
            return calls, BAD
        call.args = text[a : len(text) if end == INCOMPLETE else end]
        if end == INCOMPLETE:
            return calls, INCOMPLETE
        tail = FENCE_CLOSE + CALL_END
        if not text.startswith(tail, end):
            return (calls, INCOMPLETE) if tail.startswith(text[end:]) and not final else (calls, BAD)
        call.done = True
        i = end + len(tail)


class DeepSeekV3Detector(BaseFormatDetector):
    name = "deepseekv3"
    separator = ""

    def scan(self, text: str, final: bool) -> Scan:
        return scan_marked(text, final, CALLS_BEGIN, _calls, CALLS_END)

    def structure(self, function_name: str) -> StructureInfo:
        begin = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}{function_name}{FENCE_OPEN}"
        return StructureInfo(begin=begin, end=f"{FENCE_CLOSE}{CALL_END}{CALLS_END}", trigger=CALLS_BEGIN)

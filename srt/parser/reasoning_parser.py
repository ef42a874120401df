"""`--reasoning-parser`: a thinking model's `<think>...</think>` reasoning apart from its answer.

`deepseek-r1` starts in reasoning (its template opens `<think>` in the prompt; an opening tag the
model writes anyway is dropped) until `</think>`; `qwen3` reasons only when the output opens with
`<think>` (with `enable_thinking: false` the template closes the block in the prompt). An output that
ends inside the block is all reasoning. Streaming gives the same split for any chunking: a tail that
may be the start of a tag is held back until it is decided.
"""

from __future__ import annotations

from dataclasses import dataclass

from srt.function_call.core import partial_marker

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    force_reasoning: bool  # the output starts inside the reasoning block


REASONING_PARSERS = {
    "deepseek-r1": ReasoningFormat(force_reasoning=True),
    "qwen3": ReasoningFormat(force_reasoning=False),
}


def split(text: str, fmt: ReasoningFormat, final: bool) -> tuple[str, str, int]:
    """(reasoning, answer, held): held chars at the end are undecided (only when not final)."""
    body = text.lstrip()
    if body.startswith(THINK_START):
        body, opened = body[len(THINK_START) :], True
    elif not final and THINK_START.startswith(body):
        return "", "", len(text)  # may still open the block
    else:
        opened = fmt.force_reasoning
        body = text if not opened else body
        if not opened:
            return "", text, 0
    end = body.find(THINK_END)
    if end >= 0:
        return body[:end].strip(), body[end + len(THINK_END) :].lstrip(), 0
    held = 0 if final else partial_marker(body, (THINK_END,))
    reasoning = body[: len(body) - held].lstrip()
    return (reasoning.rstrip() if final else reasoning), "", held


class ReasoningParser:
    """One request's separation: `parse` for a whole output, `feed` / `finish` for a stream (each
    returns the new reasoning and answer text)."""

    def __init__(self, name: str, stream_reasoning: bool = True):
        self.fmt = REASONING_PARSERS[name]
        self.stream_reasoning = stream_reasoning
        self.text = ""
        self.sent = [0, 0]  # chars of reasoning and of answer already sent

    def parse(self, text: str) -> tuple[str, str]:
        reasoning, answer, _ = split(text, self.fmt, True)
        return reasoning, answer

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._emit(False)

    def finish(self) -> tuple[str, str]:
        return self._emit(True)

    def _emit(self, final: bool) -> tuple[str, str]:
        reasoning, answer, _ = split(self.text, self.fmt, final)
        if not self.stream_reasoning and not (answer or final or THINK_END in self.text):
            reasoning = ""  # sent whole once the block ends
        if not final and not answer and THINK_END not in self.text:
            reasoning = reasoning.rstrip() if reasoning.strip() else ""  # trailing blanks may be stripped at the end
        out_r, out_a = reasoning[self.sent[0] :], answer[self.sent[1] :]
        self.sent = [max(self.sent[0], len(reasoning)), max(self.sent[1], len(answer))]
        return out_r, out_a

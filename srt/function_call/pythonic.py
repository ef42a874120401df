"""Pythonic format (Llama 3.2+/4 with a pythonic template): a Python list of calls with literal
keyword arguments, `[get_weather(city="Paris"), get_time()]`, optionally between
`<|python_start|>` and `<|python_end|>`. Arguments are Python literals, so a call's arguments
(converted to JSON) are sent whole once its list is closed."""

from __future__ import annotations

import ast
import json
import re

from srt.function_call.core import BaseFormatDetector, Call, Scan

START, END = "<|python_start|>", "<|python_end|>"
HEAD = re.compile(r"\s*(<\|python_start\|>)?\s*\[\s*[A-Za-z_][\w.]*\s*\(")
HEAD_SO_FAR = re.compile(r"\s*(<\|python_start\|>\s*)?(\[\s*([A-Za-z_][\w.]*\s*)?)?$")  # may still become HEAD


def _list_end(text: str, i: int) -> int:
    """End of the bracketed list at text[i] ('['), or -1 while it is open (strings respected)."""
    depth, quote, j = 0, "", i
    while j < len(text):
        c = text[j]
        if quote:
            if c == "\\":
                j += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return -1


def _parse_calls(src: str) -> list[tuple[str, str]] | None:
    """[(name, JSON arguments)] of a list of calls with literal keyword arguments, else None."""
    try:
        tree = ast.parse(src.strip(), mode="eval")
    except SyntaxError:
        return None
    if not isinstance(tree.body, ast.List):
        return None
    out = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        try:
            kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            args = json.dumps(kwargs, ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError):
            return None
        out.append((name, args))
    return out


class PythonicDetector(BaseFormatDetector):
    name = "pythonic"

    def scan(self, text: str, final: bool) -> Scan:
        scan = Scan()
        m = HEAD.match(text)
        if m is None:
            if not final and (HEAD_SO_FAR.match(text) or START.startswith(text.lstrip())):
                scan.segments.append(Call(raw=text))  # undecided
            else:
                scan.text(text)
            return scan
        open_at = text.index("[", m.start() if m.group(1) is None else m.end(1))
        end = _list_end(text, open_at)
        if end < 0:
            scan.segments.append(Call(raw=text, done=False))  # names and arguments come when the list closes
            return scan
        stop = end
        if m.group(1) is not None:
            k = text.find(END, end)
            if k >= 0 and not text[end:k].strip():
                stop = k + len(END)
            elif not final and END.startswith(text[end:].strip()):
                scan.segments.append(Call(raw=text))
                return scan
        parsed = _parse_calls(text[open_at:end])
        if parsed is None or any(name not in self.names for name, _ in parsed):  # then the list is text
            scan.text(text)
            return scan
        for n, (name, args) in enumerate(parsed):
            raw = text[:stop] if n == 0 else ""
            scan.segments.append(Call(raw=raw, name=name, args=args, done=True, args_json=False))
        scan.text(text[stop:])
        return scan

    def to_json_args(self, call: Call) -> str | None:
        return call.args if call.done else None

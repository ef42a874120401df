"""The program's expressions: what `s += ...` appends, built by `gen`, `select`, `image`, roles and plain text.

Expressions are plain data; the interpreter (`frontend.interpreter`) executes them against a
backend. `a + b` concatenates, so `s += "Q: " + question + "\\nA: " + gen("answer", stop="\\n")` works.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
from collections.abc import Callable
from typing import Any

import PIL.Image

from frontend.choices import ChoicesMethod, token_length_normalized

SAMPLING_KEYS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "ignore_eos",
    "n",
    "regex",
    "json_schema",
    "ebnf",
    "sampling_seed",
    "skip_special_tokens",
    "logit_bias",
)

# What `dtype` (and gen_int / gen_string) constrain a generation to, and how its value is parsed.
INT_REGEX = r"-?(0|[1-9][0-9]{0,17})"
FLOAT_REGEX = r"-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,12})?"
BOOL_REGEX = r"(True|False|true|false)"
STRING_REGEX = r'"[^"\\\n]{0,256}"'
DTYPES: dict[Any, tuple[str | None, Callable[[str], Any]]] = {
    int: (INT_REGEX, int),
    float: (FLOAT_REGEX, float),
    bool: (BOOL_REGEX, lambda t: t.strip().lower() == "true"),
    str: (None, str),
}


class Expr:
    """Anything that can be appended to a program state."""

    def __add__(self, other) -> Concat:
        return Concat([self, to_expr(other)])

    def __radd__(self, other) -> Concat:
        return Concat([to_expr(other), self])


@dataclasses.dataclass
class Text(Expr):
    value: str


@dataclasses.dataclass
class Concat(Expr):
    parts: list[Expr]

    def __add__(self, other) -> Concat:
        return Concat([*self.parts, to_expr(other)])


@dataclasses.dataclass
class Gen(Expr):
    """Generate text into variable `name` with these sampling parameters (None = the program's
    default, then the server's)."""

    name: str | None
    sampling: dict[str, Any]
    dtype: Any = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    tools: ToolSpec | None = None

    def parse(self, text: str) -> Any:
        if self.dtype is None or self.dtype is str:
            return text
        try:
            return DTYPES[self.dtype][1](text.strip())
        except ValueError as e:
            raise ValueError(
                f"gen({self.name!r}, dtype={self.dtype.__name__}) produced {text!r}, which does not "
                f"parse as {self.dtype.__name__} (was max_tokens too small?)"
            ) from e


@dataclasses.dataclass
class ToolSpec:
    """gen(tools=...): the checked tools, tool_choice and parallel_tool_calls."""

    tools: list[dict]
    choice: str | dict
    parallel: bool


@dataclasses.dataclass
class Select(Expr):
    """Pick one of `choices` by the model's likelihood of each as a continuation."""

    name: str | None
    choices: list[str]
    method: ChoicesMethod
    temperature: float = 0.0


@dataclasses.dataclass
class Image(Expr):
    """An image at this point of the prompt: the model's placeholder in the text, `data` (what
    /generate's image_data takes) in the state's images."""

    source: str  # what the program named (its data URL or URL cut short), for errors and repr
    data: str = dataclasses.field(repr=False)


@dataclasses.dataclass
class RoleBegin(Expr):
    role: str


@dataclasses.dataclass
class RoleEnd(Expr):
    role: str


@dataclasses.dataclass
class VarScopeBegin(Expr):
    name: str


@dataclasses.dataclass
class VarScopeEnd(Expr):
    name: str


def to_expr(value) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(
        f"cannot append {type(value).__name__} to a program state; use str or an expression (gen, select, a role)"
    )


# -- constructors -------------------------------------------------------------------------------


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    min_tokens: int | None = None,
    ignore_eos: bool | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    ebnf: str | None = None,
    dtype: Any = None,
    choices: list[str] | None = None,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    sampling_seed: int | None = None,
    max_new_tokens: int | None = None,
    tools: list[dict] | None = None,
    tool_choice: str | dict = "auto",
    parallel_tool_calls: bool = True,
) -> Expr:
    """Generate into variable `name`. `dtype` (int, float, bool or str) constrains and parses the
    value; `regex` / `json_schema` (a dict or a JSON string) / `ebnf` constrain it with the server's
    grammar backend. `choices=[...]` is shorthand for `select(name, choices)`.

    `tools` (OpenAI's tool objects) makes the variable the list of calls the model wrote,
    `[{"name", "arguments"}]`, read in the server's `--tool-call-parser` format; `tool_choice`
    'required' or a function's name (or OpenAI's `{"type": "function", ...}`) generates calls under
    the server-side grammar, so they always parse. The generated text stays in the program's text
    as written; describing the tools to the model (e.g. in a system message) is the program's part."""
    if choices is not None:
        return select(name, choices, temperature=temperature or 0.0)
    spec = None
    if tools is not None:
        from srt.function_call import check_tool_choice, check_tools

        if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
            tool_choice = {"type": "function", "function": {"name": tool_choice}}
        checked = check_tools(tools)
        spec = ToolSpec(checked, check_tool_choice(tool_choice, checked), parallel_tool_calls)
        if spec.choice not in ("none", "auto") and (regex or json_schema or ebnf or dtype not in (None, str)):
            raise ValueError(
                "gen: tool_choice that forces a call cannot be combined with regex, json_schema, ebnf or dtype"
            )
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"gen dtype = {dtype!r} must be one of int, float, bool, str")
    if dtype not in (None, str) and regex is None and json_schema is None and ebnf is None:
        regex = DTYPES[dtype][0]
    if sum(x is not None for x in (regex, json_schema, ebnf)) > 1:
        raise ValueError("gen takes at most one of regex, json_schema and ebnf")
    if isinstance(json_schema, dict):
        json_schema = json.dumps(json_schema)
    if isinstance(stop, str):
        stop = [stop]
    values = dict(
        max_new_tokens=max_tokens if max_tokens is not None else max_new_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        stop_regex=stop_regex,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        repetition_penalty=repetition_penalty,
        min_new_tokens=min_tokens,
        ignore_eos=ignore_eos,
        regex=regex,
        json_schema=json_schema,
        ebnf=ebnf,
        sampling_seed=sampling_seed,
    )
    sampling = {k: v for k, v in values.items() if v is not None}
    return Gen(name, sampling, dtype, return_logprob, top_logprobs_num, spec)


def gen_int(name: str | None = None, **kwargs) -> Expr:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs) -> Expr:
    """A double-quoted string without escapes or newlines (the quotes are part of the value), so
    that `'"key": ' + gen_string("key")` builds valid JSON."""
    return gen(name, regex=STRING_REGEX, **kwargs)


def image(source: str | os.PathLike | bytes | PIL.Image.Image) -> Image:
    """An image for a vision-language model, where it is appended: a file path (read now and sent
    as base64, so a remote server needs no access to this machine's files), a data URL or an
    http(s) URL (sent as given; the server fetches URLs only with --allow-remote-media), raw
    encoded bytes, or a PIL image (sent as PNG)."""
    if isinstance(source, PIL.Image.Image):
        buf = io.BytesIO()
        source.save(buf, format="PNG")
        return Image(f"<PIL image {source.width}x{source.height}>", base64.b64encode(buf.getvalue()).decode())
    if isinstance(source, (bytes, bytearray)):
        return Image(f"<{len(source)} bytes>", base64.b64encode(source).decode())
    if isinstance(source, str) and source.startswith(("data:", "http://", "https://")):
        return Image(source[:64], source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"image() takes a file path, a data URL, an http(s) URL, bytes or a PIL image, not {type(source).__name__}"
        )
    path = os.fsdecode(source).removeprefix("file://")
    if not os.path.isfile(path):
        raise ValueError(f"image({path!r}): no such file (nor a data URL or an http(s) URL)")
    with open(path, "rb") as f:
        return Image(path, base64.b64encode(f.read()).decode())


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesMethod | None = None,
) -> Expr:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select choices = {choices!r} must be a non-empty list of non-empty strings")
    if temperature != 0.0:
        raise ValueError(f"select temperature = {temperature!r}: only 0 (pick the best-scoring choice) is supported")
    return Select(name, list(choices), choices_method or token_length_normalized, temperature)


def _role(role: str, expr=None) -> Expr:
    if expr is None:
        return RoleBegin(role)
    return Concat([RoleBegin(role), to_expr(expr), RoleEnd(role)])


def system(expr=None) -> Expr:
    return _role("system", expr)


def user(expr=None) -> Expr:
    return _role("user", expr)


def assistant(expr=None) -> Expr:
    return _role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")

"""Per-request sampling parameters, with SGLang's names, defaults and validation.

`verify` raises `InvalidSamplingParams` whose message names the field, the value and the limit;
the HTTP layer turns it into a 400.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields

GREEDY_TEMPERATURE = 1e-6
GRAMMAR_KINDS = (
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
)  # structured-output constraints, at most one per request


# Caps that keep one request from costing the server unbounded work.
MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
# tokens of output whose text sampling_params.stop_regex is searched in after each new token (SGLang
# searches a tail too): a match must end in the last token and fit in these
STOP_REGEX_TAIL = 64


class InvalidSamplingParams(ValueError):
    pass


def _check(cond: bool, name: str, value, limit: str) -> None:
    if not cond:
        raise InvalidSamplingParams(f"sampling_params.{name} = {value!r} is invalid: must be {limit}")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# the seed of a request that gives none under --enable-deterministic-inference (SGLang uses 42 too)
DEFAULT_SAMPLING_SEED = 42


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None  # SGLang's: stop once the output's tail matches one (re.search)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    # structured output: at most one of these (see srt/constrained)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # xgrammar's structural tag as JSON (tool calls use it)
    stop_strs: list[str] = field(default_factory=list, repr=False)
    stop_regex_strs: list[str] = field(default_factory=list, repr=False)

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        """Known keys are taken; unknown keys are ignored (routers and clients add their own)."""
        d = d or {}
        if not isinstance(d, dict):
            raise InvalidSamplingParams(f"sampling_params must be an object, got {type(d).__name__}")
        names = {f.name for f in fields(cls) if f.name not in ("stop_strs", "stop_regex_strs")}
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def verify(self, vocab_size: int) -> None:
        _check(
            self.max_new_tokens is None or (_is_int(self.max_new_tokens) and self.max_new_tokens >= 0),
            "max_new_tokens",
            self.max_new_tokens,
            "an integer >= 0",
        )
        _check(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            self.temperature,
            "a finite number >= 0 (0 means greedy)",
        )
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(
            _is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
            "top_k",
            self.top_k,
            "-1 (disabled) or an integer >= 1",
        )
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            _check(_is_number(v) and -2 <= v <= 2, name, v, "in [-2, 2]")
        _check(
            _is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
            "repetition_penalty",
            self.repetition_penalty,
            "in (0, 2]",
        )
        _check(
            _is_int(self.min_new_tokens) and self.min_new_tokens >= 0,
            "min_new_tokens",
            self.min_new_tokens,
            "an integer >= 0",
        )
        if self.max_new_tokens is not None:
            _check(
                self.min_new_tokens <= self.max_new_tokens,
                "min_new_tokens",
                self.min_new_tokens,
                f"<= max_new_tokens ({self.max_new_tokens})",
            )
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", self.n, f"an integer in [1, {MAX_N}]")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            v = getattr(self, name)
            _check(isinstance(v, bool), name, v, "a boolean")
        self._verify_stop()
        self._verify_stop_regex()
        if self.stop_token_ids is not None:
            _check(
                isinstance(self.stop_token_ids, list)
                and all(_is_int(t) and 0 <= t < vocab_size for t in self.stop_token_ids),
                "stop_token_ids",
                self.stop_token_ids,
                f"a list of token ids in [0, {vocab_size})",
            )
        if self.logit_bias is not None:
            self._verify_logit_bias(self.logit_bias, vocab_size)
        self._verify_grammar()
        if self.sampling_seed is not None:
            _check(
                _is_int(self.sampling_seed) and 0 <= self.sampling_seed < 2**63,
                "sampling_seed",
                self.sampling_seed,
                "an integer in [0, 2**63)",
            )

    @property
    def grammar_key(self) -> tuple[str, str] | None:
        """(kind, text) of the structured-output constraint, or None when unconstrained."""
        return next(((kind, getattr(self, kind)) for kind in GRAMMAR_KINDS if getattr(self, kind) is not None), None)

    def _verify_grammar(self) -> None:
        """Cheap checks here; the compile itself happens in the scheduler (srt/constrained)."""
        given = [kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None]
        if len(given) > 1:
            raise InvalidSamplingParams(
                f"sampling_params: give at most one of {', '.join(GRAMMAR_KINDS)} (got {', '.join(given)})"
            )
        for kind in given:
            text = getattr(self, kind)
            _check(isinstance(text, str) and text != "", kind, text, "a non-empty string")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise InvalidSamplingParams(f"sampling_params.json_schema is not valid JSON: {e}") from None
            _check(isinstance(schema, (dict, bool)), "json_schema", self.json_schema, "a JSON object (a JSON Schema)")
        if self.structural_tag is not None:
            try:
                tag = json.loads(self.structural_tag)
            except json.JSONDecodeError as e:
                raise InvalidSamplingParams(f"sampling_params.structural_tag is not valid JSON: {e}") from None
            _check(isinstance(tag, dict), "structural_tag", self.structural_tag, "a JSON object")

    def _verify_stop(self) -> None:
        stop = self.stop
        if stop is None:
            self.stop_strs = []
            return
        if isinstance(stop, str):
            stop = [stop]
        _check(
            isinstance(stop, list) and all(isinstance(s, str) and s for s in stop),
            "stop",
            self.stop,
            "a non-empty string or a list of non-empty strings",
        )
        _check(
            len(stop) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_CHARS for s in stop),
            "stop",
            self.stop,
            f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each",
        )
        self.stop_strs = list(stop)

    def _verify_stop_regex(self) -> None:
        pats = [self.stop_regex] if isinstance(self.stop_regex, str) else self.stop_regex
        if pats is None:
            self.stop_regex_strs = []
            return
        limit = (
            f"a non-empty regular expression or a list of at most {MAX_STOP_STRINGS} of them, "
            f"{MAX_STOP_CHARS} characters each"
        )
        _check(
            isinstance(pats, list)
            and len(pats) <= MAX_STOP_STRINGS
            and all(isinstance(p, str) and 0 < len(p) <= MAX_STOP_CHARS for p in pats),
            "stop_regex",
            self.stop_regex,
            limit,
        )
        for pat in pats:
            try:
                re.compile(pat)
            except re.error as e:
                raise InvalidSamplingParams(
                    f"sampling_params.stop_regex = {pat!r} is invalid: not a regular expression ({e})"
                ) from None
        self.stop_regex_strs = list(pats)

    @staticmethod
    def _verify_logit_bias(logit_bias: dict, vocab_size: int) -> None:
        _check(isinstance(logit_bias, dict), "logit_bias", logit_bias, "an object of token id -> bias")
        for k, v in logit_bias.items():
            try:
                tid = int(k)
            except (TypeError, ValueError):
                tid = -1
            _check(0 <= tid < vocab_size, "logit_bias", k, f"keyed by token ids in [0, {vocab_size})")
            _check(_is_number(v) and -100 <= v <= 100, f"logit_bias[{k}]", v, "in [-100, 100]")

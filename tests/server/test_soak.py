"""The soak (`make soak`, in neither `make test` nor `make test-all`): one private server on the tiny
model takes mixed traffic from 12 client threads for RADIXSERVE_SOAK_SECONDS (default 1800; `make soak
SOAK_MINUTES=N`), then must be back where it started. The traffic mixes every kind of request the
server serves: /generate plain, streamed and with n > 1; streams cut by the client, /abort_request and
per-request deadlines (deliberate aborts); JSON schemas and regexes through sampling_params and OpenAI's
response_format; logprobs (native and OpenAI); tool calls (OpenAI chat with `tools`); long prompts;
shared long prefixes (radix hits); deliberately bad requests that must be 400s. Before the clock
starts, each kind runs once on its own (a broken kind fails in seconds), then the same traffic runs for a
ramp (at least 60 s and 1,000 requests, at most 180 s) that builds the server's working set.

At the end it asserts:
- no error but those the test provoked: every answer has the status and shape its kind expects (bad
  requests 400, aborted ones a `finish_reason` of abort), no exception or traceback, and no more
  aborted requests server-side (/metrics) than the test provoked;
- every server process's RSS on a plateau: sampled every 10 s by a background thread, its growth over
  the second half (the median of the last three samples under load minus the median of the three
  nearest the middle) stays below max(RSS_GROWTH_MB, RSS_GROWTH_FRACTION of its middle RSS). The server
  runs with glibc's MALLOC_MMAP_THRESHOLD_ at 128 KiB, so that a freed tensor's memory goes back to the
  system and RSS follows live memory: with the stock threshold, glibc keeps the freed prompt-logprob
  logits (up to ~60 MB a request) on its heap, and the scheduler's RSS climbs for minutes (to ~2.4 GB
  under prompt logprobs alone, against ~0.85 GB with the threshold, flat over 5,000 requests): that
  growth would fail a short soak though nothing leaks, and could hide a leak in a long one.
  RADIXSERVE_SOAK_STOCK_MALLOC=1 measures the stock allocator instead;
- the KV pool, request slots and radix locks at baseline (/server_info: idle, integrity check passed,
  free + evictable = capacity, nothing protected, every request slot free, no request in flight), and
  after /flush_cache every KV slot free;
- open file descriptors flat per process (idle after the ramp against idle at the end), and the same
  processes alive.

It prints a table: length, requests by kind, outcomes and errors by kind, RSS at start / middle / end
and fds at start / end per process."""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import jsonschema
import openai
import psutil
import pytest
import requests
from openai.types.chat import ChatCompletionMessageParam

SECONDS = float(os.environ.get("RADIXSERVE_SOAK_SECONDS", "1800"))
SAMPLE_EVERY_S = 10.0
WORKERS = 12
REQUEST_TIMEOUT_S = 120.0  # any one request; a worker's last request may run this long past the end
# Server start, warm-up, ramp, the last requests, settling: the test's timeout is its length plus this
# (the Makefile's --timeout says the same; this marker wins over pyproject's global 600 s).
MARGIN_S = 900
RSS_GROWTH_MB = 32.0
RSS_GROWTH_FRACTION = 0.05
# Before the clock starts: the same traffic for at least RAMP_S[0] s and RAMP_REQUESTS requests, at
# most RAMP_S[1] s (see test_soak)
RAMP_S = (60.0, 180.0)
RAMP_REQUESTS = 1000
FD_SLACK = 2  # descriptors a process may hold at the end beyond its count after the ramp
MAX_ERRORS = 100  # unexpected errors that end the soak early (a dead server fails every request at once)
# glibc serves blocks of at least this many bytes with mmap and unmaps them when freed (see the docstring)
MALLOC_ENV = {} if os.environ.get("RADIXSERVE_SOAK_STOCK_MALLOC") == "1" else {"MALLOC_MMAP_THRESHOLD_": "131072"}

pytestmark = [pytest.mark.soak, pytest.mark.timeout(SECONDS + MARGIN_S)]


@pytest.fixture(scope="module")
def server(server_factory, tiny_chat_model):
    """Private: its processes' memory and descriptors are this test's alone (a subprocess, not forked
    from the test zygote: the allocator's setting must hold from the start)."""
    return server_factory(
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "16384",  # long prompts and the shared prefixes compete for it: evictions as well as hits
        "--max-running-requests",
        "32",
        "--max-queued-requests",
        "64",  # 12 workers with n <= 4 stay below it: a 503 would be an error
        "--enable-metrics",
        "--tool-call-parser",
        "hermes",
        env=MALLOC_ENV,
    )


# -- what the requests carry -----------------------------------------------------------------------

BOUNDED_SCHEMA = {  # a random model finishes these: enums, booleans, small integers
    "type": "object",
    "properties": {
        "mode": {"type": "string", "enum": ["eco", "fast", "off"]},
        "on": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["mode", "on", "n"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,8}-[0-9]{2}"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set_mode",
            "description": "Set the mode",
            "parameters": {
                "type": "object",
                "properties": {"mode": {"type": "string", "enum": ["eco", "fast"]}, "on": {"type": "boolean"}},
                "required": ["mode", "on"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "pick",
            "description": "Pick a number",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["n"],
            },
        },
    },
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WORDS = (
    "the a radix tree cache holds shared prefixes of every prompt so that a second request skips its prefill".split()
)
# Deliberate client mistakes: (path, body, the words the 400's message must carry)
BAD_REQUESTS = [
    ("/generate", {"input_ids": [-1], "sampling_params": {"max_new_tokens": 4}}, "out of range"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "regex": "(unclosed"}}, "regex"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "json_schema": "{not json"}}, "JSON"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": -1}}, "temperature"),
    ("/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"model": "default", "messages": [], "max_tokens": 4}, "messages"),
    (
        "/v1/chat/completions",
        {"model": "default", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        "tools[0]",
    ),
]


class Unexpected(Exception):
    """An answer the request's kind did not expect; `label` groups them in the table."""

    def __init__(self, label: str, detail: str):
        super().__init__(f"{label}: {detail}")
        self.label = label


def check(condition: bool, label: str, detail) -> None:
    if not condition:
        raise Unexpected(label, str(detail)[:300])


def expect(r: requests.Response, status: int = 200) -> requests.Response:
    check(r.status_code == status, f"HTTP {r.status_code}", f"wanted {status} from {r.url}: {r.text[:300]}")
    return r


@dataclass
class Client:
    """One worker's handles: its random stream, an `openai` client, the shared prefixes."""

    url: str
    rng: random.Random
    prefixes: list[list[int]]
    oai: openai.OpenAI = field(init=False)
    cached_tokens: int = 0  # radix hits seen by the `radix` kind

    def __post_init__(self):
        self.oai = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S)

    def post(self, path: str, body: dict, status: int = 200, timeout: float = REQUEST_TIMEOUT_S) -> requests.Response:
        return expect(requests.post(self.url + path, json=body, timeout=timeout), status)

    def ids(self, lo: int, hi: int) -> list[int]:
        return [self.rng.randrange(100, 40000) for _ in range(self.rng.randint(lo, hi))]

    def words(self, lo: int = 1, hi: int = 40) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(lo, hi)))

    def prompt(self) -> dict:
        return {"text": self.words()} if self.rng.random() < 0.5 else {"input_ids": self.ids(4, 300)}

    def sampling(self, lo: int = 1, hi: int = 96) -> dict:
        return {
            "max_new_tokens": self.rng.randint(lo, hi),
            "temperature": self.rng.choice([0.0, 0.7, 1.0]),
            "ignore_eos": True,
        }

    def messages(self) -> list[ChatCompletionMessageParam]:
        return [{"role": "user", "content": self.words()}]


def finish_type(out: dict) -> str:
    reason = out["meta_info"]["finish_reason"]
    return reason["type"] if reason else "none"


# -- the kinds of request: each returns its outcome ("ok" or "provoked: ...") or raises -------------


def k_generate(c: Client) -> str:
    sp = c.sampling()
    out = c.post("/generate", {**c.prompt(), "sampling_params": sp}).json()
    meta = out["meta_info"]
    check(meta["completion_tokens"] == sp["max_new_tokens"], "wrong length", meta)
    check(finish_type(out) == "length", "wrong finish", meta["finish_reason"])
    return "ok"


def k_generate_n(c: Client) -> str:
    n = c.rng.randint(2, 4)
    sp = {**c.sampling(hi=48), "n": n, "temperature": 0.8}
    outs = c.post("/generate", {**c.prompt(), "sampling_params": sp}).json()
    check(isinstance(outs, list) and len(outs) == n, "wrong n", str(outs)[:200])
    check(all(o["meta_info"]["completion_tokens"] == sp["max_new_tokens"] for o in outs), "wrong length", outs)
    return "ok"


def k_stream(c: Client) -> str:
    sp = c.sampling()
    with requests.post(
        c.url + "/generate",
        json={**c.prompt(), "sampling_params": sp, "stream": True},
        stream=True,
        timeout=REQUEST_TIMEOUT_S,
    ) as r:
        expect(r)
        lines = [line for line in r.iter_lines() if line]
    check(lines[-1] == b"data: [DONE]", "stream not ended by [DONE]", lines[-1:])
    last = json.loads(lines[-2].removeprefix(b"data: "))
    check(finish_type(last) == "length", "wrong finish", last["meta_info"])
    check(len(last["output_ids"]) == sp["max_new_tokens"], "wrong length", last["meta_info"])
    return "ok"


def k_stream_disconnect(c: Client) -> str:
    """A native stream the client drops after a few chunks: the server must abort and free it."""
    keep = c.rng.randint(0, 12)
    with requests.post(
        c.url + "/generate",
        json={**c.prompt(), "sampling_params": c.sampling(200, 400), "stream": True},
        stream=True,
        timeout=REQUEST_TIMEOUT_S,
    ) as r:
        expect(r)
        for n, line in enumerate(r.iter_lines()):
            if line == b"data: [DONE]":
                return "ok"
            if n >= keep:
                return "provoked: client disconnect"
    return "ok"


def k_chat_stream(c: Client) -> str:
    """A chat stream through the `openai` client, read to its usage chunk, or closed early."""
    max_tokens = c.rng.randint(1, 80)
    stream = c.oai.chat.completions.create(
        model="default",
        messages=c.messages(),
        max_tokens=max_tokens,
        temperature=c.rng.choice([0.0, 0.8]),
        stream=True,
        stream_options={"include_usage": True},
    )
    cut = c.rng.random() < 0.3
    keep = c.rng.randint(0, 8)
    finish, usage = None, None
    try:
        for n, chunk in enumerate(stream):
            if cut and n >= keep:
                return "provoked: client disconnect"
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                usage = chunk.usage
    finally:
        stream.close()
    check(finish in ("length", "stop"), "wrong finish", finish)
    check(usage is not None and 0 < usage.completion_tokens <= max_tokens, "bad usage", usage)
    return "ok"


def k_abort_rid(c: Client) -> str:
    """/abort_request by rid while the request runs (or before it is seen, or after it ended)."""
    rid = f"soak-{uuid.uuid4().hex}"
    result: dict = {}

    def send():
        try:
            result["r"] = requests.post(
                c.url + "/generate",
                json={**c.prompt(), "rid": rid, "sampling_params": c.sampling(100, 300)},
                timeout=REQUEST_TIMEOUT_S,
            )
        except Exception as e:  # noqa: BLE001 - handed to the worker
            result["e"] = e

    t = threading.Thread(target=send, name="soak-abort-victim")
    t.start()
    time.sleep(c.rng.random() * 0.4)
    c.post("/abort_request", {"rid": rid}, timeout=30)
    t.join(REQUEST_TIMEOUT_S + 10)
    check(not t.is_alive(), "hung", f"the aborted request {rid} did not return")
    if "e" in result:
        raise result["e"]
    out = expect(result["r"]).json()
    kind = finish_type(out)
    check(kind in ("abort", "length"), "wrong finish", out["meta_info"])
    return "provoked: /abort_request" if kind == "abort" else "ok"


def k_deadline(c: Client) -> str:
    """A request whose `timeout` ends it before its tokens are done: 200 with an abort."""
    timeout = round(0.05 + c.rng.random() * 0.5, 3)
    out = c.post("/generate", {**c.prompt(), "sampling_params": c.sampling(300, 500), "timeout": timeout}).json()
    kind = finish_type(out)
    check(kind in ("abort", "length"), "wrong finish", out["meta_info"])
    if kind == "abort":
        check("deadline" in out["meta_info"]["finish_reason"]["message"], "abort not by deadline", out["meta_info"])
        return "provoked: deadline"
    return "ok"


def check_json(text: str, finish: str | None) -> None:
    if finish == "length":  # cut inside the object: the grammar held as far as it went
        return
    check(finish == "stop", "wrong finish", finish)
    try:
        jsonschema.validate(json.loads(text), BOUNDED_SCHEMA)
    except (ValueError, jsonschema.ValidationError) as e:
        raise Unexpected("off-schema JSON", f"{text!r}: {e}") from None


def k_json_schema(c: Client) -> str:
    sp = {"max_new_tokens": 64, "temperature": c.rng.choice([0.0, 0.8]), "json_schema": json.dumps(BOUNDED_SCHEMA)}
    out = c.post("/generate", {**c.prompt(), "sampling_params": sp}).json()
    check_json(out["text"], finish_type(out))
    return "ok"


def k_regex(c: Client) -> str:
    """A regex through sampling_params (native) or the OpenAI completions body."""
    temperature = c.rng.choice([0.0, 0.8])
    if c.rng.random() < 0.5:
        out = c.post(
            "/generate",
            {**c.prompt(), "sampling_params": {"max_new_tokens": 32, "temperature": temperature, "regex": REGEX}},
        ).json()
        text, finish = out["text"], finish_type(out)
    else:
        r = c.oai.completions.create(
            model="default", prompt=c.words(), max_tokens=32, temperature=temperature, extra_body={"regex": REGEX}
        )
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    check(finish == "stop" and re.fullmatch(REGEX, text) is not None, "off-regex text", (finish, text))
    return "ok"


def k_response_format(c: Client) -> str:
    r = c.oai.chat.completions.create(
        model="default",
        messages=c.messages(),
        max_tokens=64,
        temperature=c.rng.choice([0.0, 0.8]),
        response_format={"type": "json_schema", "json_schema": {"name": "soak", "schema": BOUNDED_SCHEMA}},
    )
    check_json(r.choices[0].message.content or "", r.choices[0].finish_reason)
    return "ok"


def k_logprobs(c: Client) -> str:
    """Prompt and output logprobs with top-k: native, OpenAI completions or OpenAI chat."""
    k = c.rng.randint(1, 4)
    max_tokens = c.rng.randint(1, 24)
    which = c.rng.randrange(3)
    if which == 0:
        body = {
            **c.prompt(),
            "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": k,
            "logprob_start_len": 0,
        }
        meta = c.post("/generate", body).json()["meta_info"]
        check(len(meta["output_token_logprobs"]) == max_tokens, "wrong logprobs", meta)
        check(len(meta["input_token_logprobs"]) == meta["prompt_tokens"], "wrong prompt logprobs", meta)
        check(all(len(t) == k for t in meta["output_top_logprobs"]), "wrong top-k", meta["output_top_logprobs"])
    elif which == 1:
        r = c.oai.completions.create(
            model="default", prompt=c.words(), max_tokens=max_tokens, logprobs=k, extra_body={"ignore_eos": True}
        )
        lp = r.choices[0].logprobs
        check(lp is not None and len(lp.tokens or []) == max_tokens, "wrong logprobs", lp)
    else:
        r = c.oai.chat.completions.create(
            model="default",
            messages=c.messages(),
            max_tokens=max_tokens,
            logprobs=True,
            top_logprobs=k,
        )
        content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
        tokens = r.usage.completion_tokens if r.usage else -1
        check(content is not None and len(content) == tokens, "wrong logprobs", (tokens, content))
        check(all(len(t.top_logprobs) == k for t in content or []), "wrong top-k", content)
    return "ok"


def k_tools(c: Client) -> str:
    """OpenAI chat with `tools`: required, named or auto, streamed or not; calls parse and validate."""
    choice = c.rng.choice(["required", "auto", {"type": "function", "function": {"name": "pick"}}])
    body: dict = {
        "model": "default",
        "messages": c.messages(),
        "tools": TOOLS,
        "tool_choice": choice,
        "max_tokens": 200,
        "temperature": c.rng.choice([0.0, 0.8]),
        "frequency_penalty": 0.5,
    }
    calls: list[tuple[str, str]] = []
    if c.rng.random() < 0.5:
        r = c.oai.chat.completions.create(**body)
        finish = r.choices[0].finish_reason
        calls = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls or []]  # type: ignore[union-attr]
    else:
        parts: dict[int, list[str]] = {}
        finish = None
        with c.oai.chat.completions.create(**body, stream=True) as stream:
            for chunk in stream:
                if not chunk.choices:
                    continue
                ch = chunk.choices[0]
                finish = ch.finish_reason or finish
                for t in ch.delta.tool_calls or []:
                    entry = parts.setdefault(t.index, ["", ""])
                    entry[0] += (t.function.name or "") if t.function else ""
                    entry[1] += (t.function.arguments or "") if t.function else ""
        calls = [(name, args) for name, args in parts.values()]
    if choice != "auto":
        check(finish in ("tool_calls", "length"), "wrong finish", (choice, finish, calls))
    if finish == "tool_calls":
        check(bool(calls), "no calls", finish)
        for name, args in calls:
            check(name in TOOL_SCHEMAS, "unknown tool", name)
            try:
                jsonschema.validate(json.loads(args), TOOL_SCHEMAS[name])
            except (ValueError, jsonschema.ValidationError) as e:
                raise Unexpected("off-schema call", f"{name}({args!r}): {e}") from None
    return "ok"


def k_openai_n(c: Client) -> str:
    """n > 1 through OpenAI completions or chat."""
    n = c.rng.randint(2, 4)
    max_tokens = c.rng.randint(1, 40)
    if c.rng.random() < 0.5:
        r = c.oai.completions.create(
            model="default",
            prompt=c.words(),
            max_tokens=max_tokens,
            n=n,
            temperature=0.8,
            extra_body={"ignore_eos": True},
        )
        check(len(r.choices) == n, "wrong n", r.choices)
        check(r.usage is not None and r.usage.completion_tokens == n * max_tokens, "wrong usage", r.usage)
    else:
        r = c.oai.chat.completions.create(
            model="default",
            messages=c.messages(),
            max_tokens=max_tokens,
            n=n,
            temperature=0.8,
        )
        check(sorted(ch.index for ch in r.choices) == list(range(n)), "wrong n", r.choices)
    return "ok"


def k_long(c: Client) -> str:
    """A long prompt (chunked prefill, a large share of the KV pool)."""
    ids = c.ids(2000, 6000)
    sp = {"max_new_tokens": c.rng.randint(1, 8), "ignore_eos": True}
    meta = c.post("/generate", {"input_ids": ids, "sampling_params": sp}).json()["meta_info"]
    check(meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == sp["max_new_tokens"], "wrong count", meta)
    return "ok"


def k_radix(c: Client) -> str:
    """One of the shared long prefixes and a short suffix of its own: a radix hit unless evicted."""
    ids = c.rng.choice(c.prefixes) + c.ids(1, 64)
    sp = {"max_new_tokens": c.rng.randint(1, 16), "ignore_eos": True, "temperature": c.rng.choice([0.0, 0.8])}
    meta = c.post("/generate", {"input_ids": ids, "sampling_params": sp}).json()["meta_info"]
    check(0 <= meta["cached_tokens"] < len(ids), "wrong cached tokens", meta)
    c.cached_tokens += meta["cached_tokens"]
    return "ok"


def k_bad(c: Client) -> str:
    """A deliberate client mistake: a 400 naming it, native or OpenAI, or the `openai` client's error."""
    if c.rng.random() < 0.2:
        try:
            c.oai.chat.completions.create(model="default", messages=c.messages(), max_tokens=-1)
        except openai.BadRequestError:
            return "provoked: 400"
        raise Unexpected("bad request accepted", "max_tokens=-1 through the openai client")
    path, body, words = c.rng.choice(BAD_REQUESTS)
    r = c.post(path, body, status=400)
    check(words in r.json()["error"]["message"], "400 without the reason", (words, r.text[:300]))
    return "provoked: 400"


KINDS: dict[str, tuple[Callable[[Client], str], float]] = {  # name: (request, weight)
    "generate": (k_generate, 3),
    "generate_n": (k_generate_n, 1),
    "stream": (k_stream, 2),
    "stream_disconnect": (k_stream_disconnect, 1),
    "chat_stream": (k_chat_stream, 1.5),
    "abort_request": (k_abort_rid, 1),
    "deadline": (k_deadline, 1),
    "json_schema": (k_json_schema, 1),
    "regex": (k_regex, 1),
    "response_format": (k_response_format, 1),
    "logprobs": (k_logprobs, 1.5),
    "tools": (k_tools, 1.5),
    "openai_n": (k_openai_n, 1),
    "long_prompt": (k_long, 1),
    "radix_prefix": (k_radix, 2),
    "bad_request": (k_bad, 0.5),
}


# -- bookkeeping -----------------------------------------------------------------------------------


class Tally:
    """Outcomes by kind ("ok", "provoked: ...", or an unexpected error's label), thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.outcomes: dict[str, Counter] = {name: Counter() for name in KINDS}
        self.samples: list[str] = []  # the first unexpected errors' messages

    def run(self, kind: str, c: Client) -> None:
        try:
            outcome = KINDS[kind][0](c)
        except Unexpected as e:
            outcome = f"error: {e.label}"
            detail = str(e)
        except Exception as e:  # noqa: BLE001 - counted and reported
            outcome = f"error: {type(e).__name__}"
            detail = f"{type(e).__name__}: {e}"
        else:
            detail = ""
        with self.lock:
            self.outcomes[kind][outcome] += 1
            if detail and len(self.samples) < 20:
                self.samples.append(f"{kind}: {detail[:400]}")

    def total(self, prefix: str = "") -> int:
        return sum(n for c in self.outcomes.values() for k, n in c.items() if k.startswith(prefix))

    def errors(self) -> dict[str, dict[str, int]]:
        return {
            kind: {k: n for k, n in c.items() if k.startswith("error")}
            for kind, c in self.outcomes.items()
            if any(k.startswith("error") for k in c)
        }


def worker(
    url: str, seed: int, prefixes: list[list[int]], done: threading.Event, tally: Tally, cached: list[int]
) -> None:
    c = Client(url, random.Random(seed), prefixes)
    names, weights = list(KINDS), [w for _, w in KINDS.values()]
    try:
        while not done.is_set():
            tally.run(c.rng.choices(names, weights)[0], c)
    finally:
        c.oai.close()
        with tally.lock:
            cached.append(c.cached_tokens)


def start_load(url: str, prefixes: list[list[int]], first_seed: int, tally: Tally, cached: list[int]):
    """WORKERS client threads, running until the returned event is set."""
    done = threading.Event()
    threads = [
        threading.Thread(target=worker, args=(url, seed, prefixes, done, tally, cached), name=f"soak-{seed}")
        for seed in range(first_seed, first_seed + WORKERS)
    ]
    for t in threads:
        t.start()
    return done, threads


def stop_load(done: threading.Event, threads: list[threading.Thread]) -> list[str]:
    """Stop the workers once their current requests end; the names of those still running after
    twice the request timeout."""
    done.set()
    deadline = time.monotonic() + REQUEST_TIMEOUT_S * 2 + 30
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in threads if t.is_alive()]


def process_labels(server) -> dict[int, str]:
    """pid -> a name for each process of the server's tree (the HTTP process, scheduler, detokenizer,
    multiprocessing's fork server and resource tracker, whatever else it forked)."""
    info = requests.get(server.url + "/server_info", timeout=30).json()
    named = {pid: name for name, pid in info.get("process_pids", {}).items()}
    root = psutil.Process(server.proc.pid)
    labels = {root.pid: "http"}
    for p in root.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if p.pid in named:
            labels[p.pid] = named[p.pid]
        elif "resource_tracker" in cmd:
            labels[p.pid] = "resource_tracker"
        elif "forkserver" in cmd:
            labels[p.pid] = "forkserver"
        else:
            labels[p.pid] = f"child {p.pid}"
    return labels


def snapshot(root_pid: int) -> dict[int, tuple[float, int]]:
    """pid -> (RSS in MB, open file descriptors) for every live process of the tree."""
    out = {}
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            out[p.pid] = (p.memory_info().rss / 2**20, p.num_fds())
        except psutil.Error:
            pass
    return out


class Sampler(threading.Thread):
    """RSS and fds of each server process every `every` s, and the scheduler's token usage."""

    def __init__(self, server, every: float):
        super().__init__(name="soak-sampler", daemon=True)
        self.server, self.every = server, every
        self.samples: list[tuple[float, dict[int, tuple[float, int]]]] = []
        self.peak_usage = 0.0
        self.halt = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.halt.is_set():
            self.samples.append((time.monotonic() - self.t0, snapshot(self.server.proc.pid)))
            try:
                self.peak_usage = max(self.peak_usage, self.server.state()["token_usage"])
            except (requests.RequestException, KeyError, IndexError, ValueError):
                pass  # a slow answer under load; the workers' own requests report a dead server
            self.halt.wait(self.every)


def rss_series(samples, pid: int) -> list[tuple[float, float]]:
    return [(t, snap[pid][0]) for t, snap in samples if pid in snap]


def plateau(series: list[tuple[float, float]], length: float) -> tuple[float, float]:
    """(RSS in the middle, at the end) under load: the medians of the three samples nearest the
    middle and of the last three."""
    if not series:
        return float("nan"), float("nan")
    middle = sorted(series, key=lambda s: abs(s[0] - length / 2))[:3]
    return statistics.median(v for _, v in middle), statistics.median(v for _, v in series[-3:])


def settled_state(server, timeout: float = 120) -> dict:
    """The scheduler's state once it is idle with nothing running or queued and every KV slot free or
    evictable (right after its last batch a finished request still counts as running until the
    scheduler's next loop drops it); the last state read when that does not happen within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        s = server.wait_idle(timeout=max(1.0, deadline - time.monotonic()))
        quiet = s["idle"] and s["num_running_reqs"] == 0 and s["num_queue_reqs"] == 0
        if quiet and s["kv_available"] + s["kv_evictable"] == s["kv_capacity"] or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"sglang:{name}"))


# -- the soak --------------------------------------------------------------------------------------


def test_soak(server):
    baseline = settled_state(server, timeout=60)
    assert baseline["idle"] and baseline["integrity_ok"], baseline
    prng = random.Random(1234)
    prefixes = [[prng.randrange(100, 40000) for _ in range(prng.randint(1000, 2000))] for _ in range(4)]

    # Warm-up: each kind (and each bad request) once, one at a time, so that a broken kind fails in
    # seconds, not after the whole soak; then the soak's own traffic until the server's working set is
    # built (batch buffers, a full radix tree, grammar and tokenizer caches: the scheduler's RSS climbs
    # for about the first 900 requests, then holds), so that the start figures and a short soak's
    # "second half" are past it.
    warm = Tally()
    c = Client(server.url, random.Random(-1), prefixes)
    for _ in range(2):
        for kind in KINDS:
            warm.run(kind, c)
    for path, body, _words in BAD_REQUESTS:
        expect(requests.post(server.url + path, json=body, timeout=30), 400)
    expect(requests.get(server.url + "/metrics", timeout=30))  # read at the end: its first use is not a leak
    c.oai.close()
    assert not warm.errors(), f"warm-up errors: {warm.errors()}; {warm.samples}"
    ramp = Tally()
    ramp_began = time.monotonic()
    done, threads = start_load(server.url, prefixes, 1000, ramp, [])
    while not done.wait(1):
        elapsed = time.monotonic() - ramp_began
        if elapsed >= RAMP_S[1] or elapsed >= RAMP_S[0] and ramp.total() >= RAMP_REQUESTS or ramp.errors():
            break
    hung = stop_load(done, threads)
    ramp_s = time.monotonic() - ramp_began
    assert not hung and not ramp.errors(), f"ramp: {ramp.errors()}, {hung} hung; {ramp.samples[:5]}"
    settled_state(server, timeout=60)
    time.sleep(6)  # past uvicorn's 5 s keep-alive: the warm-up's connections are closed
    labels = process_labels(server)
    start = snapshot(server.proc.pid)

    tally, cached_by_worker = Tally(), []
    sampler = Sampler(server, min(SAMPLE_EVERY_S, max(1.0, SECONDS / 12)))
    sampler.start()
    done, threads = start_load(server.url, prefixes, 0, tally, cached_by_worker)
    stop, cut_short = time.monotonic() + SECONDS, ""
    while not done.wait(max(0.0, min(5.0, stop - time.monotonic()))) and time.monotonic() < stop:
        if server.proc.poll() is not None:
            cut_short = f"the server exited with {server.proc.returncode}"
        elif tally.total("error") >= MAX_ERRORS:
            cut_short = f"{tally.total('error')} unexpected errors"
        if cut_short:
            break
    hung = stop_load(done, threads)
    if server.proc.poll() is not None:
        pytest.fail(f"the server exited with {server.proc.returncode} during the soak:\n{server.tail(80)}")
    load_s = time.monotonic() - sampler.t0
    under_load = [s for s in sampler.samples if s[0] <= SECONDS]
    sampler.halt.set()
    sampler.join(30)

    # Back to idle: the scheduler has run its integrity check (--debug-integrity-check makes a failure
    # fatal), every descriptor a client held is closed.
    state = settled_state(server)
    info = requests.get(server.url + "/server_info", timeout=30).json()
    metrics = requests.get(server.url + "/metrics", timeout=30).text
    deadline = time.monotonic() + 30
    while True:
        end = snapshot(server.proc.pid)
        settled = all(end.get(pid, (0, 0))[1] <= fds + FD_SLACK for pid, (_, fds) in start.items())
        if settled or time.monotonic() > deadline:
            break
        time.sleep(1)
    flushed = requests.post(server.url + "/flush_cache", timeout=60)
    after_flush = settled_state(server, timeout=60)
    log = server.log_text()
    tracebacks = [m.start() for m in re.finditer(r"Traceback|IntegrityError|integrity violated", log)]

    # -- the table -----------------------------------------------------------------------------
    provoked = tally.total("provoked")
    # the server's counters include the warm-up's and the ramp's requests
    provoked_since_start = provoked + ramp.total("provoked") + warm.total("provoked") + len(BAD_REQUESTS)
    errors = tally.errors()
    n_errors = tally.total("error")
    lines = [
        "",
        f"soak: {SECONDS:.0f} s of load ({load_s:.0f} s with the last requests), {WORKERS} workers, "
        f"{tally.total()} requests: {tally.total('ok')} ok, {provoked} provoked errors, {n_errors} unexpected errors "
        f"(after a ramp of {ramp.total()} requests in {ramp_s:.0f} s, {ramp.total('error')} unexpected errors)",
        f"{'kind':<18} {'sent':>6} {'ok':>6}  provoked / unexpected",
    ]
    for kind, counts in tally.outcomes.items():
        other = ", ".join(f"{k} {n}" for k, n in sorted(counts.items()) if k != "ok")
        lines.append(f"{kind:<18} {sum(counts.values()):>6} {counts['ok']:>6}  {other or '-'}")
    finished, aborted = metric(metrics, "num_requests_total"), metric(metrics, "num_aborted_requests_total")
    lines += [
        f"server (since start): {finished:.0f} requests finished, {aborted:.0f} aborted (provoked: "
        f"{provoked_since_start}), "
        f"{metric(metrics, 'cached_tokens_total'):.0f} prompt tokens from the radix cache "
        f"({sum(cached_by_worker)} on the shared prefixes), peak token usage {sampler.peak_usage:.2f}, "
        f"{len(sampler.samples)} samples every {sampler.every:.0f} s",
        f"at the end: {state['num_running_reqs']} running, {state['num_queue_reqs']} queued; KV free "
        f"{state['kv_available']} + evictable {state['kv_evictable']} + protected "
        f"{state['kv_protected']} of {state['kv_capacity']}; request slots free {state['req_slots_free']} of "
        f"{baseline['req_slots_free']}; integrity {'ok' if state['integrity_ok'] else 'VIOLATED'}; after "
        f"/flush_cache free {after_flush['kv_available']}",
        f"{'process':<18} {'pid':>8} {'RSS start':>10} {'middle':>8} {'end':>8} {'idle':>8} "
        f"{'growth':>8} {'bound':>7} {'fds start':>10} {'end':>5}",
    ]
    rss_failures, fd_failures = [], []
    for pid, label in labels.items():
        mid, last = plateau(rss_series(under_load, pid), SECONDS)
        bound = max(RSS_GROWTH_MB, RSS_GROWTH_FRACTION * mid)
        rss0, fds0 = start.get(pid, (float("nan"), -1))
        rss_idle, fds1 = end.get(pid, (float("nan"), -1))
        growth = last - mid
        lines.append(
            f"{label:<18} {pid:>8} {rss0:>10.0f} {mid:>8.0f} {last:>8.0f} {rss_idle:>8.0f} "
            f"{growth:>+8.1f} {bound:>7.0f} {fds0:>10} {fds1:>5}"
        )
        if not growth < bound:  # a NaN (a process gone) fails too
            rss_failures.append(f"{label} (pid {pid}): {mid:.0f} -> {last:.0f} MB, +{growth:.1f} >= {bound:.0f} MB")
        if fds1 < 0 or fds1 > fds0 + FD_SLACK:
            fd_failures.append(f"{label} (pid {pid}): {fds0} -> {fds1} open fds (slack {FD_SLACK})")
    lines.append(
        f"RSS in MB: start = idle after the ramp, middle / end = under load (medians of 3 samples), "
        f"idle = at the end; bound = max({RSS_GROWTH_MB:.0f} MB, {RSS_GROWTH_FRACTION:.0%} of middle); "
        f"allocator: {' '.join(f'{k}={v}' for k, v in MALLOC_ENV.items()) or 'stock glibc'}"
    )
    print("\n".join(lines))
    for sample in tally.samples:
        print("  error:", sample)

    # -- the checks ----------------------------------------------------------------------------
    assert not cut_short, f"the soak stopped after {load_s:.0f} s: {cut_short}; first: {tally.samples[:5]}"
    assert not hung, f"workers still running {REQUEST_TIMEOUT_S * 2 + 30:.0f} s past the end: {hung}"
    assert n_errors == 0, f"{n_errors} unexpected errors by kind: {errors}; first: {tally.samples[:5]}"
    assert tally.total("ok") > 0 and all(sum(c.values()) for c in tally.outcomes.values()), tally.outcomes
    assert not tracebacks, f"{len(tracebacks)} tracebacks in the server log, the first:\n{log[tracebacks[0] :][:3000]}"
    assert aborted <= provoked_since_start, (
        f"{aborted:.0f} requests aborted server-side, only {provoked_since_start} provoked"
    )
    assert sum(cached_by_worker) > 0, "no radix hit on the shared prefixes"
    assert state["idle"] and state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0, state
    assert state["integrity_ok"], "the scheduler's idle integrity check failed (see the server log)"
    assert state["kv_protected"] == 0, f"{state['kv_protected']} radix tokens still locked while idle"
    assert state["kv_available"] + state["kv_evictable"] == state["kv_capacity"] == baseline["kv_capacity"], (
        f"KV free {state['kv_available']} + evictable {state['kv_evictable']} != capacity {state['kv_capacity']}"
    )
    assert state["req_slots_free"] == baseline["req_slots_free"], (
        f"request slots free {state['req_slots_free']}, {baseline['req_slots_free']} at the start"
    )
    assert state.get("grammar_queue", 0) == 0, f"{state['grammar_queue']} requests still wait for a grammar"
    assert info["tenants"] == {}, f"requests still in flight in the HTTP process: {info['tenants']}"
    assert flushed.status_code == 200 and after_flush["kv_available"] == after_flush["kv_capacity"], (
        f"after /flush_cache ({flushed.status_code}) {after_flush['kv_available']} of "
        f"{after_flush['kv_capacity']} KV slots free"
    )
    assert set(end) == set(start), (
        f"server processes changed: gone {sorted(set(start) - set(end))}, new {sorted(set(end) - set(start))}"
    )
    assert not rss_failures, "RSS grew over the second half: " + "; ".join(rss_failures)
    assert not fd_failures, "open file descriptors grew: " + "; ".join(fd_failures)

"""Structured output: grammars compiled off the scheduler loop, cached, matched per request.

A request with `json_schema`, `regex` or `ebnf` waits in the scheduler's grammar queue while its
grammar compiles on a worker thread (other requests keep running); compiled grammars are cached by
(kind, text), and so are compile errors. A grammar that fails to compile, or takes longer than
--grammar-compile-timeout, fails its request with a 400 that carries the compiler's message;
nothing ever runs unconstrained by accident.

A running request holds an xgrammar `GrammarMatcher` (`Req.grammar`): it fills the request's row
of the batch's token bitmask before sampling, accepts each sampled token, and finishes the request
when the grammar terminates. With jump-forward on, a string the grammar forces is appended without
forward passes (see `Scheduler.jump_forward_tokens`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 1024


class GrammarError(ValueError):
    """The grammar cannot be used; the message is the compiler's (shown to the client)."""


class XGrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], any_whitespace: bool = False):
        self.vocab_size = vocab_size
        start = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        logger.info("Grammar backend xgrammar ready in %.2f s", time.perf_counter() - start)
        self.any_whitespace = any_whitespace
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self.cache: dict[tuple[str, str], Future] = {}
        self.compiled = 0
        self.compile_total_s = self.compile_max_s = 0.0

    def submit(self, key: tuple[str, str]) -> Future:
        """The (possibly cached) compile of `key`; its result is a compiled grammar or a GrammarError."""
        fut = self.cache.pop(key, None)
        if fut is None:
            fut = self.executor.submit(self._compile, key)
            while len(self.cache) >= MAX_CACHED_GRAMMARS:  # least recently used first
                self.cache.pop(next(iter(self.cache)))
        self.cache[key] = fut
        return fut

    def _compile(self, key: tuple[str, str]):
        kind, text = key
        start = time.perf_counter()
        try:
            if kind == "json_schema":
                compiled = self.compiler.compile_json_schema(text, any_whitespace=self.any_whitespace)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            elif kind == "structural_tag":
                compiled = self.compiler.compile_structural_tag(text)
            else:
                compiled = self.compiler.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's message
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return GrammarError(f"invalid {kind}: {message}")
        seconds = time.perf_counter() - start
        self.compiled += 1
        self.compile_total_s += seconds
        self.compile_max_s = max(self.compile_max_s, seconds)
        return compiled

    @staticmethod
    def matcher(compiled) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)

    def stats(self) -> dict:
        return {
            "compiled": self.compiled,
            "total_s": round(self.compile_total_s, 4),
            "max_s": round(self.compile_max_s, 4),
            "cache_entries": len(self.cache),
        }

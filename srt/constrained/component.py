"""Structured output's scheduler side: requests wait here while their grammar compiles, and a
running request's forced strings are appended without decoding them (jump forward)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from srt.constrained.grammar_backend import GrammarError, XGrammarBackend
from srt.managers.io_struct import FINISH_ABORT
from srt.managers.scheduler_component import NewRequest, RequestRejected, SchedulerComponent
from srt.managers.scheduler_state import GrammarState

if TYPE_CHECKING:
    from srt.managers.schedule_batch import Req
    from srt.managers.scheduler_component import SchedulerPort
    from srt.managers.scheduler_state import SchedulerState

GRAMMAR_POLL_MS = 5
# A jump-forward costs the request an extend pass of its own (outside the decode batch), so it pays
# only for forced strings of several tokens (JSON keys, enum tails), not for a ", " between items.
JUMP_FORWARD_MIN_TOKENS = 4
JUMP_FORWARD_CONTEXT_TOKENS = 2  # generated tokens re-tokenized with the forced string


class GrammarComponent(SchedulerComponent):
    name = "grammar"

    def __init__(self, port: SchedulerPort, backend: XGrammarBackend | None):
        self.port = port
        self.backend = backend
        args = port.server_args
        self.compile_timeout = args.grammar_compile_timeout
        # the request's KV waits in the prefix cache across a jump: without a radix cache it would be recomputed
        self.jump_forward = not (args.disable_jump_forward or args.disable_radix_cache)
        self.queue: list[tuple[Req, Future, float]] = []  # (request, its compile, when it arrived)
        self.jump_forward_tokens = 0

    @classmethod
    def build(cls, port: SchedulerPort) -> GrammarComponent | None:
        if not port.runner.generates:
            return None  # an encoder: nothing is decoded, so nothing is constrained
        backend = None
        if port.server_args.grammar_backend == "xgrammar":
            config = port.runner.model_config
            backend = XGrammarBackend(port.tokenizer, config.vocab_size, sorted(port.eos_token_ids))
        return cls(port, backend)

    # -- new requests ------------------------------------------------------------------------------

    def on_new_request(self, req: Req, recv: Any) -> None:
        if req.sampling_params.grammar_key is not None and self.backend is None:
            raise RequestRejected(
                "structured output (json_schema / regex / ebnf) is disabled on this server (--grammar-backend none)"
            )

    def on_accepted(self, req: Req) -> NewRequest:
        key = req.sampling_params.grammar_key
        if key is None:
            return NewRequest.CONTINUE
        assert self.backend is not None, "on_new_request rejects grammars without a backend"
        self.queue.append((req, self.backend.submit(key), time.monotonic()))
        return NewRequest.HELD  # the event loop polls the queue right after taking in new requests

    def poll(self) -> None:
        """Requests whose grammar compiled go on; failed or timed-out ones end."""
        if not self.queue:
            return
        still, now, timeout = [], time.monotonic(), self.compile_timeout
        for req, fut, since in self.queue:
            if req.to_abort is not None:
                req.finished_reason = FINISH_ABORT(message=req.to_abort)
                self.port.stream_output([req])
            elif fut.done():
                result = fut.result()
                if isinstance(result, GrammarError):
                    self.port.fail_request(req, str(result))
                else:
                    assert self.backend is not None  # only its requests wait for a compile
                    req.grammar = self.backend.matcher(result)
                    self.port.enqueue(req)
            elif now - since > timeout:
                self.port.fail_request(
                    req, f"the grammar did not compile within {timeout:g} s (--grammar-compile-timeout)"
                )
            else:
                still.append((req, fut, since))
        self.queue = still

    def wait_ms(self) -> int | None:
        return GRAMMAR_POLL_MS if self.queue else None

    def pending(self) -> bool:
        return bool(self.queue)

    def queued_reqs(self) -> list[Req]:
        return [r for r, _, _ in self.queue]

    # -- jump forward ------------------------------------------------------------------------------

    def forced_tokens(self, req: Req) -> list[int] | None:
        """The tokens of the string the grammar forces next, to append without decoding them (the
        grammar has accepted them), or None.

        The forced string is tokenized together with the last generated tokens; it is used only
        when that keeps those tokens (else decoding goes on, and the next step tries again at a
        cleaner boundary). The request then leaves the decode batch with its KV in the prefix
        cache and comes back as one extend over the appended tokens."""
        grammar = req.grammar
        if grammar is None or not self.jump_forward:
            return None
        p = req.sampling_params
        # no logprobs for jumped tokens; a stop string or regex could fire inside
        if req.return_logprob or p.stop_strs or p.stop_regex_strs:
            return None
        forced = grammar.find_jump_forward_string()
        if not forced:
            return None
        tokenizer = self.port.tokenizer
        out = req.output_ids
        tail = out[-JUMP_FORWARD_CONTEXT_TOKENS:]  # earlier tokens belong to finished pre-tokens
        tail_text = tokenizer.decode(tail, clean_up_tokenization_spaces=False)
        assert isinstance(tail_text, str)  # one sequence of ids decodes to one string
        ids = tokenizer.encode(tail_text + forced, add_special_tokens=False)
        if ids[: len(tail)] != tail:
            return None
        # The last forced token is left to the model: it may merge with the free text after it
        # (e.g. ' "' + 'S' -> ' "S'), and decoding it keeps the tokens greedy decoding would pick.
        extra = ids[len(tail) : -1]
        if len(extra) < JUMP_FORWARD_MIN_TOKENS:
            return None
        if (
            p.max_new_tokens is not None
            and len(out) + len(extra) >= p.max_new_tokens
            or req.seq_len + len(extra) >= self.port.runner.model_config.context_len
        ):
            return None
        if set(extra) & (set(p.stop_token_ids or ()) | self.port.eos_token_ids):
            return None  # a stop token inside the forced string: decode it normally
        for k, t in enumerate(extra):
            if not grammar.accept_token(t):
                grammar.rollback(k)
                return None
        self.jump_forward_tokens += len(extra)
        return extra

    def fill_state(self, state: SchedulerState) -> None:
        stats = self.backend.stats() if self.backend is not None else None
        state.grammar = GrammarState(queue=len(self.queue), compile=stats, jump_forward_tokens=self.jump_forward_tokens)

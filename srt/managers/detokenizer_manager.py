"""The detokenizer process: token ids -> text, incrementally and UTF-8 safe.

Each request's text only ever grows by whole characters, and what has been sent is always a
prefix of the final text: a trailing partial UTF-8 sequence is held back until it completes, and
so is any tail that could still turn into a stop string (stop strings are trimmed from the final
text unless `no_stop_trim`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import traceback

import zmq

from srt.hf_transformers_utils import get_tokenizer
from srt.managers.io_struct import (
    FINISH_MATCHED_STR,
    FINISH_MATCHED_TOKEN,
    FINISHED_MATCHED_REGEX,
    BaseFinishReason,
    BatchStrOutput,
    BatchTokenIDOutput,
    SchedulerCrashed,
)
from srt.sampling.sampling_params import STOP_REGEX_TAIL
from srt.server_args import PortArgs, ServerArgs
from srt.utils import start_child_process, zmq_socket

logger = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


# Constructs under which a match's start depends on where the scheduler's tail begins (its search sees
# the last STOP_REGEX_TAIL tokens' text alone): with these a pattern keeps the whole tail held back.
_TAIL_RELATIVE = re.compile(r"(?<!\[)\^|\\[AbBG]|\(\?<")


def stop_regex_matchers(patterns: tuple[str, ...]) -> list | None:
    """sampling_params.stop_regex compiled for partial matching (the `regex` module's `partial=True`),
    or None where one of them cannot be (then the decoder holds back the last STOP_REGEX_TAIL tokens'
    text, as the scheduler searches them)."""
    if not patterns or any(_TAIL_RELATIVE.search(p) for p in patterns):
        return None
    try:
        import regex
    except ImportError:  # pragma: no cover - a dependency of ours and of transformers
        return None
    try:
        return [regex.compile(p) for p in patterns]
    except regex.error:  # a pattern `re` takes and `regex` does not
        return None


def stop_holdback(text: str, stop_strs: tuple[str, ...]) -> int:
    """How many trailing characters of text might still be the start of, or contain, a stop string."""
    cut = len(text)
    for s in stop_strs:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                cut = min(cut, len(text) - k)
                break
    return len(text) - cut


class IncrementalDecoder:
    def __init__(
        self,
        tokenizer,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop_strs: tuple[str, ...] = (),
        no_stop_trim: bool = False,
        stop_regex: tuple[str, ...] = (),
    ):
        self.tokenizer = tokenizer
        self.kw = dict(
            skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens
        )
        self.stop_strs, self.no_stop_trim = stop_strs, no_stop_trim
        # with stop_regex: (ids, characters of text) after each step, for the text of the last
        # STOP_REGEX_TAIL tokens (the scheduler's search stops a request on a match there), and the
        # patterns for partial matching: of that text, only what starts at or after the first character
        # where one of them could still match (`scan`, which only moves on: a string that is no prefix
        # of a match never becomes one) is held back, so the text streams as it comes
        self.marks: list[tuple[int, int]] | None = [] if stop_regex and not no_stop_trim else None
        self.matchers = stop_regex_matchers(tuple(stop_regex)) if self.marks is not None else None
        self.scan = 0
        self.ids: list[int] = []
        self.text = ""  # decoded text of ids[:read_offset]
        self.surr_offset = 0
        self.read_offset = 0
        self.sent = 0  # characters of text already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.kw)

    def _advance(self, final: bool) -> None:
        surr = self._decode(self.ids[self.surr_offset : self.read_offset])
        full = self._decode(self.ids[self.surr_offset :])
        if full.endswith(REPLACEMENT) and not final:
            return  # a multi-byte character is still incomplete
        self.text += full[len(surr) :]
        self.surr_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.marks is not None:
            self.marks.append((self.read_offset, len(self.text)))

    def _match_start(self, tail_start: int) -> int:
        """The first character of text from which a stop_regex match could still start (len(text): none
        could), or tail_start where the patterns cannot be matched partially."""
        if self.matchers is None:
            return tail_start
        self.scan = max(self.scan, tail_start, self.sent)
        while self.scan < len(self.text):
            if any(m.match(self.text, self.scan, partial=True) for m in self.matchers):
                break
            self.scan += 1
        return self.scan

    def step(self, new_ids: list[int], finished_reason: BaseFinishReason | None) -> str:
        """Feed new tokens; returns the text to emit now."""
        if isinstance(finished_reason, FINISH_MATCHED_TOKEN) and not self.no_stop_trim and new_ids:
            new_ids = new_ids[:-1]  # the matched stop token is not part of the text
        self.ids.extend(new_ids)
        final = finished_reason is not None
        self._advance(final)
        if final:
            text = self.text
            if isinstance(finished_reason, FINISH_MATCHED_STR) and not self.no_stop_trim:
                i = text.find(finished_reason.matched)
                if i != -1:
                    text = text[:i]
            elif isinstance(finished_reason, FINISHED_MATCHED_REGEX) and not self.no_stop_trim:
                # the last match: the one that stopped it (the tail the scheduler searched ends the text)
                last = next(reversed(list(re.finditer(finished_reason.matched, text))), None)
                if last is not None:
                    text = text[: max(self.sent, last.start())]
            end = len(text)
        else:
            end = len(self.text) - (stop_holdback(self.text, self.stop_strs) if not self.no_stop_trim else 0)
            if self.marks is not None:
                safe = len(self.ids) - STOP_REGEX_TAIL
                tail_start = max((c for n, c in self.marks if n <= safe), default=0)
                end = min(end, max(tail_start, self._match_start(tail_start)))
            text = self.text
        if end <= self.sent:
            return ""
        delta = text[self.sent : end]
        self.sent = end
        return delta


class DetokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs):
        tokenizer_path = server_args.tokenizer_path or server_args.model_path
        assert tokenizer_path is not None, "ServerArgs.model_path is required"
        self.tokenizer = get_tokenizer(tokenizer_path)
        ctx = zmq.Context(2)
        self.recv_from_scheduler = zmq_socket(ctx, zmq.PULL, port_args.detokenizer_input, bind=True)
        self.send_to_tokenizer = zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_input, bind=False)
        self.decoders: dict[str, IncrementalDecoder] = {}

    def handle(self, batch: BatchTokenIDOutput) -> BatchStrOutput:
        deltas = []
        for rid, new_ids, reason, settings in zip(
            batch.rids, batch.new_output_ids, batch.finished_reasons, batch.decode_settings
        ):
            dec = self.decoders.get(rid)
            if dec is None:
                dec = self.decoders[rid] = IncrementalDecoder(
                    self.tokenizer,
                    skip_special_tokens=settings.skip_special_tokens,
                    spaces_between_special_tokens=settings.spaces_between_special_tokens,
                    stop_strs=settings.stop_strs,
                    no_stop_trim=settings.no_stop_trim,
                    stop_regex=settings.stop_regex,
                )
            deltas.append(dec.step(new_ids, reason))
            if reason is not None:
                del self.decoders[rid]
        # the tokenizer manager has no use for the decode settings: they stay here
        return BatchStrOutput(token_output=dataclasses.replace(batch, decode_settings=[]), text_deltas=deltas)

    def event_loop(self) -> None:
        while True:
            msg = self.recv_from_scheduler.recv_pyobj()
            if isinstance(msg, BatchTokenIDOutput):
                self.send_to_tokenizer.send_pyobj(self.handle(msg))
            elif isinstance(msg, SchedulerCrashed):  # after the outputs sent before it, never ahead of them
                self.send_to_tokenizer.send_pyobj(msg)
            else:
                logger.error("detokenizer got an unknown message %r", type(msg))


def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs, pipe_writer) -> None:
    manager = start_child_process(
        pipe_writer, server_args.log_level, " Detokenizer", lambda: DetokenizerManager(server_args, port_args)
    )
    try:
        manager.event_loop()
    except Exception:
        logger.error("detokenizer crashed:\n%s", traceback.format_exc())
        sys.exit(1)

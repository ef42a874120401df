"""What the interpreter asks of a backend, built on one primitive: a native `/generate` call.

A backend implements `call(body)` (a `/generate` JSON body in, its JSON out), `call_stream(body)`
(the stream's chunks) and `model_info()`. Everything else (generation, prefix caching, scoring the
choices of `select`) is the same for every backend and lives here.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

from frontend.chat_template import ChatTemplate
from frontend.choices import ChoicesMethod

# meta_info lists that --incremental-streaming-output sends as deltas
OUTPUT_LOGPROB_LISTS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


class ChoicePrompt(NamedTuple):
    """One prompt `select` scores: a context (and its images) followed by one choice."""

    text: str
    images: list[str]
    context_tokens: int  # the context's prompt tokens (0: no context)
    choice: str


class BackendError(RuntimeError):
    """The server or engine refused or failed a request; the message is the server's."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def _check(out: dict) -> dict:
    reason = out.get("meta_info", {}).get("finish_reason") or {}
    if reason.get("type") == "abort":
        raise BackendError(f"request aborted: {reason.get('message') or 'no reason given'}", reason.get("status_code"))
    return out


class Backend(abc.ABC):
    chat_template_override: str | None = None

    # -- the primitive, per backend -------------------------------------------------------------
    @abc.abstractmethod
    def call(self, body: dict) -> Any:
        """One /generate call: its JSON body in, its JSON out."""

    @abc.abstractmethod
    def call_stream(self, body: dict) -> Iterator[dict]:
        """One streamed /generate call: its chunks."""

    @abc.abstractmethod
    def model_info(self) -> dict:
        """/get_model_info's fields (chat_template, bos_token, eos_token at least; image_token, the
        image placeholder's text, for a model that accepts images)."""

    # -- shared -----------------------------------------------------------------------------------
    @functools.cached_property
    def chat_template(self) -> ChatTemplate:
        info = self.model_info()
        return ChatTemplate(
            self.chat_template_override or info.get("chat_template"), info.get("bos_token"), info.get("eos_token")
        )

    @functools.cached_property
    def image_token(self) -> str | None:
        """The text of the placeholder a prompt carries per image; None for a text-only model."""
        return self.model_info().get("image_token")

    @functools.cached_property
    def tool_call_parser(self) -> str | None:
        """The server's --tool-call-parser (the format `gen(tools=...)` reads)."""
        return self.model_info().get("tool_call_parser")

    @staticmethod
    def _body(
        text: str, sampling: dict, return_logprob: bool, top_logprobs_num: int, stream: bool, images: list[str] | None
    ) -> dict:
        body = {"text": text, "sampling_params": sampling, "stream": stream}
        if images:
            body["image_data"] = list(images)
        if return_logprob:
            body.update(return_logprob=True, top_logprobs_num=top_logprobs_num, return_text_in_logprobs=True)
        return body

    def generate(
        self,
        text: str,
        sampling: dict,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        images: list[str] | None = None,
    ) -> tuple[str, dict]:
        """The generated text and its meta_info; `images`: the image_data of the text's placeholders."""
        out = _check(self.call(self._body(text, sampling, return_logprob, top_logprobs_num, False, images)))
        return out["text"], out["meta_info"]

    def generate_stream(
        self,
        text: str,
        sampling: dict,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        images: list[str] | None = None,
    ) -> Iterator[tuple[str, dict]]:
        """Yields (new text, meta_info so far). Chunks are cumulative, or deltas when the server runs
        with --incremental-streaming-output (a chunk then holds fewer output_ids than
        completion_tokens); the yielded meta_info's output-side logprob lists are cumulative either way."""
        seen = 0
        lists: dict[str, list] = {}
        for out in self.call_stream(self._body(text, sampling, return_logprob, top_logprobs_num, True, images)):
            meta = dict(_check(out)["meta_info"])
            ids = out.get("output_ids") or []
            incremental = len(ids) < meta.get("completion_tokens", len(ids))
            for key in OUTPUT_LOGPROB_LISTS:
                if isinstance(meta.get(key), list):
                    lists[key] = (lists.get(key, []) + meta[key]) if incremental else list(meta[key])
                    meta[key] = lists[key]
            if incremental:
                seen += len(out["text"])
                yield out["text"], meta
            else:
                full = out["text"]
                yield full[seen:], meta
                seen = len(full)

    def cache_prefix(self, texts: list[str], images: list[list[str]] | None = None) -> list[dict]:
        """Prefill these prompts without generating (`max_new_tokens: 0`), so later requests that
        extend them hit the radix cache; returns their meta_info (prompt_tokens, cached_tokens).
        `images`: per prompt, the image_data of its placeholders."""
        body = {"text": texts, "sampling_params": {"max_new_tokens": 0}, **_batch_images(images)}
        return [_check(o)["meta_info"] for o in self.call(body)]

    def select(
        self,
        prefix: str,
        choices: list[str],
        method: ChoicesMethod,
        neutral_context: str,
        images: list[str] | None = None,
    ) -> tuple[int, dict]:
        """Score every choice as a continuation of `prefix` (whose placeholders `images` fill) in
        one batched request: the prompt logprobs of its tokens, from just before the choice
        (`logprob_start_len`)."""
        contexts = [(prefix, images or [])]
        if method.needs_unconditional:
            contexts.append((neutral_context, []))
        cached = [(text, imgs) for text, imgs in contexts if text]
        metas = iter(self.cache_prefix([t for t, _ in cached], [i for _, i in cached]) if cached else [])
        lengths = [next(metas)["prompt_tokens"] if text else 0 for text, _ in contexts]
        items = [
            ChoicePrompt(text + choice, imgs, n, choice)
            for (text, imgs), n in zip(contexts, lengths)
            for choice in choices
        ]
        outs = self.call(
            {
                "text": [it.text for it in items],
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": [max(it.context_tokens - 1, 0) for it in items],
                "return_text_in_logprobs": True,
                **_batch_images([it.images for it in items]),
            }
        )
        scored = [
            _choice_logprobs(_check(out)["meta_info"]["input_token_logprobs"], it.choice, it.context_tokens > 0)
            for out, it in zip(outs, items)
        ]
        k = len(choices)
        decision = method(scored[:k], scored[k:] if method.needs_unconditional else None)
        meta = {
            "choices_method": method.name,
            "scores": decision.scores,
            "normalized_prompt_logprobs": [sum(lp) / len(lp) if lp else None for lp in scored[:k]],
            "input_token_logprobs": scored[:k],
            "prompt_tokens": lengths[0],
        }
        if method.needs_unconditional:
            meta["unconditional_token_logprobs"] = scored[k:]
        return decision.index, meta


def _batch_images(images: list[list[str]] | None) -> dict:
    """A batch's image_data (one entry per prompt, None for a prompt without images), or nothing
    when no prompt has images (what a text-only server expects)."""
    if not images or not any(images):
        return {}
    return {"image_data": [list(i) if i else None for i in images]}


def _choice_logprobs(entries: list, choice: str, has_context: bool) -> list[float]:
    """The logprobs of the choice's tokens. The entries start one token before the choice; that
    first token belongs to the context unless the tokenizer merged it with the choice's start."""
    if has_context and entries and "".join((e[2] or "") for e in entries[1:]) == choice:
        entries = entries[1:]
    return [e[0] for e in entries if e[0] is not None]

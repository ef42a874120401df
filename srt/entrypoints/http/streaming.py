"""The SSE shape of a /generate stream: cumulative chunks, or deltas with --incremental-streaming-output."""

from __future__ import annotations

import orjson

# Output-side lists of meta_info that --incremental-streaming-output sends as deltas.
INCREMENTAL_META_LISTS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def sse(payload) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class IncrementalChunks:
    """--incremental-streaming-output (SGLang's): turns the cumulative chunks of one /generate
    stream into deltas (the new text, output_ids and output-side logprob entries), per `index`
    when a stream carries several sequences. Counts such as `output_token_logprobs_length` and
    `completion_tokens` stay cumulative."""

    def __init__(self):
        self.sent: dict[int, dict[str, int]] = {}

    def delta(self, out: dict | list) -> dict | list:
        if not isinstance(out, dict):  # streams yield one dict per chunk; anything else passes through
            return out
        sent = self.sent.setdefault(out.get("index", 0), {})
        new = dict(out)
        text = out.get("text")
        if isinstance(text, str):
            new["text"] = text[sent.get("text", 0) :]
            sent["text"] = len(text)
        if isinstance(out.get("output_ids"), list):
            new["output_ids"] = out["output_ids"][sent.get("output_ids", 0) :]
            sent["output_ids"] = len(out["output_ids"])
        meta = out.get("meta_info")
        if isinstance(meta, dict):
            new["meta_info"] = meta = dict(meta)
            for key in INCREMENTAL_META_LISTS:
                if isinstance(meta.get(key), list):
                    values = meta[key]
                    meta[key] = values[sent.get(key, 0) :]
                    sent[key] = len(values)
        return new

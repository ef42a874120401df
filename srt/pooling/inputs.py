"""The request side of pooling: what a client's input may be, how it becomes token ids (a
cross-encoder's pair with its segment ids), the length limit or truncation, and the vectors'
wire formats. Every mistake is an InvalidRequest naming the field, the value and the limit."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from srt.managers.io_struct import MAX_BATCH_SIZE, InvalidRequest
from srt.pooling.model import PoolingModel

ENCODING_FORMATS = ("float", "base64")


@dataclass
class PoolingPrompt:
    input_ids: list[int]
    token_type_ids: list[int] | None = None
    text: str | None = None
    priority: int | None = None


class Pooled(NamedTuple):
    vector: Any  # numpy float32 [D]: the embedding, or a classifier's logits
    prompt_tokens: int
    cached_tokens: int


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def parse_inputs(value, field: str = "input") -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists -> the items."""
    shape = f"{field} must be a string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(value, str):
        items: list = [value]
    elif isinstance(value, list) and value and _is_ids(value):
        items = [value]
    elif isinstance(value, list):
        items = value
        if not all(isinstance(v, str) for v in items) and not all(_is_ids(v) for v in items):
            raise InvalidRequest(shape)
    else:
        raise InvalidRequest(f"{shape}; got {type(value).__name__}")
    if not items:
        raise InvalidRequest(f"{field} is empty")
    if len(items) > MAX_BATCH_SIZE:
        raise InvalidRequest(f"{field} has {len(items)} items, more than the limit of {MAX_BATCH_SIZE}")
    for i, item in enumerate(items):
        if not item or (isinstance(item, str) and not item.strip()):
            raise InvalidRequest(f"{field}[{i}] is empty")
    return items


def check_bool(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{key} = {value!r} must be true or false")
    return value


def check_int(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise InvalidRequest(f"{key} = {value!r} must be an integer {bound}")
    return value


class PromptBuilder:
    """Token ids for pooling inputs under the model's limit (`truncate`: cut instead of a 400)."""

    def __init__(self, tokenizer, model: PoolingModel, vocab_size: int):
        self.tokenizer = tokenizer
        self.model = model
        self.vocab_size = vocab_size

    @property
    def limit(self) -> int:
        return self.model.max_input_len

    def _check_len(self, n: int, where: str) -> None:
        if n > self.limit:
            raise InvalidRequest(
                f"{where} has {n} tokens, more than this model's maximum of {self.limit} "
                "(pass truncate: true to cut it to the maximum)"
            )

    def single(self, item: str | list[int], where: str, truncate: bool) -> PoolingPrompt:
        if isinstance(item, str):
            cut = {"truncation": True, "max_length": self.limit} if truncate else {}
            enc = self.tokenizer(item, add_special_tokens=True, **cut)
            ids = list(enc["input_ids"])
            text = item
        else:
            bad = next((t for t in item if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(f"{where} holds token id {bad}, out of range [0, {self.vocab_size})")
            ids, text = list(item), None
            if truncate:
                ids = ids[: self.limit]
        if not ids:
            raise InvalidRequest(f"{where} is empty after tokenization")
        self._check_len(len(ids), where)
        return PoolingPrompt(ids, text=text)

    def pair(self, query: str, doc: str, where: str, truncate: bool) -> PoolingPrompt:
        """A cross-encoder's input: query and document as one sequence, with segment ids 0 and 1."""
        cut = {"truncation": "only_second", "max_length": self.limit} if truncate else {}
        enc = self.tokenizer(query, doc, add_special_tokens=True, return_token_type_ids=True, **cut)
        ids = list(enc["input_ids"])
        self._check_len(len(ids), where)
        types = enc.get("token_type_ids") if self.model.segment_ids else None
        return PoolingPrompt(ids, list(types) if types is not None else None)


def truncate_dims(vector: np.ndarray, dims: int) -> np.ndarray:
    """Matryoshka: the first `dims` values, normalized again."""
    head = vector[:dims]
    norm = float(np.linalg.norm(head))
    return head / norm if norm > 0 else head


def check_dimensions(model: PoolingModel, dims: int | None) -> None:
    if dims is None:
        return
    if model.kind != "embed":
        raise InvalidRequest(f"dimensions = {dims}: this model ({model.kind}) returns no embeddings to shorten")
    if dims > model.dims:
        raise InvalidRequest(f"dimensions = {dims} is more than this model's {model.dims} dimensions")
    if model.matryoshka_dims is not None and dims not in model.matryoshka_dims:
        raise InvalidRequest(
            f"dimensions = {dims} is not one this model was trained for; expected one of {list(model.matryoshka_dims)}"
        )


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """`float`: a JSON list; `base64`: little-endian float32 bytes, as OpenAI's client decodes them."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()

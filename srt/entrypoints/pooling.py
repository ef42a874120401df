"""Embeddings, reranking, scoring and classification over the TokenizerManager: the bodies of
/v1/embeddings, /encode, /v1/rerank (/rerank, /v2/rerank), /v1/score and /classify, and the
Engine's encode / rerank / score / classify. Each method takes the JSON body as a dict and returns
the answer's dict (or list); a client mistake raises InvalidRequest naming the field.

- **Embeddings** pool each input on a pooling server (--is-embedding, or an encoder).
- **Rerank** scores each (query, document): a cross-encoder's relevance (sigmoid of its one logit,
  as sentence-transformers' CrossEncoder), an embedding model's cosine similarity, or on a
  generation server a yes/no decoder reranker's P(yes) (Qwen3-Reranker's prompt; the query's prefix
  is shared through the radix cache).
- **Score** (SGLang's): on a generation server, the probabilities of `label_token_ids` as the next
  token after query + item, from the same logprobs /generate reports.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np

from srt.managers.io_struct import GenerateReqInput, InvalidRequest
from srt.pooling.inputs import (
    ENCODING_FORMATS,
    PromptBuilder,
    check_bool,
    check_dimensions,
    check_int,
    encode_vector,
    parse_inputs,
    truncate_dims,
)
from srt.pooling.model import PoolingModel

if TYPE_CHECKING:
    from srt.managers.tokenizer_manager import TokenizerManager

MAX_LABEL_TOKENS = 256

# Qwen3-Reranker's prompt: the judge's system message, then instruct / query / document, then an
# empty thinking block; the answer's first token is "yes" or "no"
RERANK_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the "
    'answer can only be "yes" or "no".'
)
RERANK_INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"
THINK_SUFFIX = "<think>\n\n</think>\n\n"


class PoolingServing:
    @classmethod
    def of(cls, tm: TokenizerManager, model_name: str, hf_config) -> PoolingServing:
        """The serving of this server: with its PoolingModel on a pooling server (--is-embedding, or an encoder)."""
        model = None
        is_generation = bool(tm.scheduler_info.get("is_generation", True))
        if tm.server_args.is_embedding or not is_generation:
            assert tm.server_args.model_path is not None
            arch = (getattr(hf_config, "architectures", None) or [""])[0]
            model = PoolingModel.read(tm.server_args.model_path, hf_config, arch, tm.max_req_input_len)
        return cls(tm, model_name, model)

    def __init__(self, tm: TokenizerManager, model_name: str, model: PoolingModel | None):
        self.tm = tm
        self.model_name = model_name
        self.model = model  # None: a generation server without --is-embedding
        self.prompts = PromptBuilder(tm.tokenizer, model, tm.vocab_size) if model is not None else None
        self.is_generation = bool(tm.scheduler_info.get("is_generation", True))

    def _pooling(self, what: str) -> tuple[PoolingModel, PromptBuilder]:
        if self.model is None or self.prompts is None:
            raise InvalidRequest(
                f"{what}: this server generates; start it with --is-embedding to serve embeddings from this model"
            )
        return self.model, self.prompts

    def _embed_model(self, what: str) -> tuple[PoolingModel, PromptBuilder]:
        model, prompts = self._pooling(what)
        if model.kind != "embed":
            raise InvalidRequest(f"{what}: this model is a classifier (cross-encoder); use /v1/rerank or /classify")
        return model, prompts

    # -- embeddings ------------------------------------------------------------------------------

    async def _embed(self, items, truncate: bool, dims: int | None, request, field: str = "input"):
        model, prompts = self._embed_model("embeddings")
        check_dimensions(model, dims)
        built = [prompts.single(item, f"{field}[{i}]", truncate) for i, item in enumerate(items)]
        pooled = await self.tm.pool(built, request, _tenant(request))
        vectors = [truncate_dims(p.vector, dims) if dims is not None else p.vector for p in pooled]
        return vectors, pooled

    async def embeddings(self, body: dict, request=None) -> dict:
        """OpenAI's /v1/embeddings."""
        if "input" not in body:
            raise InvalidRequest("input is required")
        items = parse_inputs(body["input"])
        fmt = body.get("encoding_format") or "float"
        if fmt not in ENCODING_FORMATS:
            raise InvalidRequest(
                f"encoding_format = {fmt!r} is not supported; expected one of {list(ENCODING_FORMATS)}"
            )
        dims = check_int(body, "dimensions", 1)
        vectors, pooled = await self._embed(items, check_bool(body, "truncate", False), dims, request)
        tokens = sum(p.prompt_tokens for p in pooled)
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": encode_vector(v, fmt)} for i, v in enumerate(vectors)
            ],
            "model": self.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    async def encode(self, body: dict, request=None) -> dict | list[dict]:
        """SGLang's native /encode: `text` or `input_ids` -> {embedding, meta_info} (a list for a batch)."""
        model, _ = self._pooling("/encode")
        if (body.get("text") is None) == (body.get("input_ids") is None):
            raise InvalidRequest("exactly one of text or input_ids is required")
        field = "text" if body.get("text") is not None else "input_ids"
        value = body[field]
        batch = isinstance(value, list) and not (field == "input_ids" and _is_flat_ids(value))
        items = parse_inputs(value, field)
        truncate = check_bool(body, "truncate", False)
        dims = check_int(body, "dimensions", 1)
        start = time.time()
        if model.kind == "embed":
            vectors, pooled = await self._embed(items, truncate, dims, request, field)
        else:
            assert self.prompts is not None
            check_dimensions(model, dims)
            built = [self.prompts.single(item, f"{field}[{i}]", truncate) for i, item in enumerate(items)]
            pooled = await self.tm.pool(built, request, _tenant(request))
            vectors = [p.vector for p in pooled]
        outs = [
            {
                "embedding": v.astype(np.float32).tolist(),
                "meta_info": {
                    "id": uuid.uuid4().hex,
                    "finish_reason": {"type": "length", "length": 0},
                    "prompt_tokens": p.prompt_tokens,
                    "cached_tokens": p.cached_tokens,
                    "e2e_latency": time.time() - start,
                },
            }
            for v, p in zip(vectors, pooled)
        ]
        return outs if batch else outs[0]

    # -- classification --------------------------------------------------------------------------

    async def classify(self, body: dict, request=None) -> dict:
        """SGLang's /v1/classify: each input's label and the softmax over the labels."""
        model, prompts = self._pooling("classify")
        if model.kind != "classify":
            raise InvalidRequest("classify: this model has no classification head (it serves embeddings)")
        if "input" not in body:
            raise InvalidRequest("input is required")
        items = parse_inputs(body["input"])
        truncate = check_bool(body, "truncate", False)
        built = [prompts.single(item, f"input[{i}]", truncate) for i, item in enumerate(items)]
        pooled = await self.tm.pool(built, request, _tenant(request))
        data = []
        for i, p in enumerate(pooled):
            probs = _softmax(np.asarray(p.vector, dtype=np.float64))
            data.append(
                {
                    "index": i,
                    "label": model.labels[int(np.argmax(probs))],
                    "probs": probs.tolist(),
                    "num_classes": len(probs),
                }
            )
        tokens = sum(p.prompt_tokens for p in pooled)
        return {
            "id": f"classify-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": self.model_name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }

    # -- rerank ----------------------------------------------------------------------------------

    async def rerank(self, body: dict, request=None, response_format: str = "sglang") -> Any:
        """/v1/rerank: `query`, `documents` (strings or {text}), `top_n`, `return_documents`."""
        query = body.get("query")
        if not isinstance(query, str) or not query.strip():
            raise InvalidRequest(f"query = {_clip(query)} must be a non-empty string")
        docs = body.get("documents")
        if not isinstance(docs, list) or not docs:
            raise InvalidRequest("documents must be a non-empty list of strings or {text} objects")
        texts = []
        for i, d in enumerate(docs):
            text = d.get("text") if isinstance(d, dict) else d
            if not isinstance(text, str) or not text.strip():
                raise InvalidRequest(f"documents[{i}] = {_clip(d)} must be a non-empty string or {{text: string}}")
            texts.append(text)
        if len(texts) > 2048:
            raise InvalidRequest(f"documents has {len(texts)} items, more than the limit of 2048")
        top_n = check_int(body, "top_n", 1)
        return_documents = check_bool(body, "return_documents", True)
        truncate = check_bool(body, "truncate", False)
        instruct = body.get("instruct") or RERANK_INSTRUCT
        if not isinstance(instruct, str):
            raise InvalidRequest(f"instruct = {_clip(instruct)} must be a string")
        scores, tokens = await self._relevance(query, texts, truncate, instruct, request)
        order = sorted(range(len(texts)), key=lambda i: -scores[i])[: top_n or len(texts)]
        if response_format == "cohere":
            results = []
            for i in order:
                entry: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
                if return_documents:
                    entry["document"] = {"text": texts[i]}
                results.append(entry)
            return {
                "id": f"rerank-{uuid.uuid4().hex}",
                "model": self.model_name,
                "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "meta": {"billed_units": {"search_units": 1}},
            }
        out = []
        for i in order:
            entry = {"score": scores[i], "index": i, "meta_info": {"prompt_tokens": tokens}}
            if return_documents:
                entry["document"] = docs[i]
            out.append(entry)
        return out

    async def _relevance(
        self, query: str, texts: list[str], truncate: bool, instruct: str, request
    ) -> tuple[list[float], int]:
        model = self.model
        if model is not None and model.encoder and model.kind == "classify":
            assert self.prompts is not None
            if model.dims != 1:
                raise InvalidRequest(
                    f"rerank needs a cross-encoder with one relevance logit; this one has {model.dims} labels "
                    "(use /classify)"
                )
            built = [self.prompts.pair(query, t, f"documents[{i}]", truncate) for i, t in enumerate(texts)]
            pooled = await self.tm.pool(built, request, _tenant(request))
            return [_sigmoid(float(p.vector[0])) for p in pooled], sum(p.prompt_tokens for p in pooled)
        if model is not None and model.kind == "embed":  # a bi-encoder: cosine similarity
            vectors, pooled = await self._embed([query, *texts], truncate, None, request, "documents")
            q = _unit(vectors[0])
            return [float(np.dot(q, _unit(v))) for v in vectors[1:]], sum(p.prompt_tokens for p in pooled)
        return await self._yes_no(query, texts, instruct, request)

    async def _yes_no(self, query: str, texts: list[str], instruct: str, request) -> tuple[list[float], int]:
        """A decoder reranker: P(yes) against P(no) as the answer's first token."""
        tok = self.tm.tokenizer
        yes, no = _single_token(tok, "yes"), _single_token(tok, "no")
        prompts = [self._rerank_prompt(instruct, query, t) for t in texts]
        obj = GenerateReqInput(
            text=prompts,
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_logprob=True,
            token_ids_logprob=[yes, no],
        )
        outs = await _first(self.tm.generate_request(obj, request))
        scores, tokens = [], 0
        for out in outs:
            by_id = {entry[1]: entry[0] for entry in out["meta_info"]["output_token_ids_logprobs"][0]}
            lp_yes, lp_no = by_id[yes], by_id[no]
            scores.append(1.0 / (1.0 + math.exp(lp_no - lp_yes)))
            tokens += out["meta_info"]["prompt_tokens"]
        return scores, tokens

    def _rerank_prompt(self, instruct: str, query: str, doc: str) -> str:
        user = f"<Instruct>: {instruct}\n<Query>: {query}\n<Document>: {doc}"
        tok = self.tm.tokenizer
        if getattr(tok, "chat_template", None):
            messages = [{"role": "system", "content": RERANK_SYSTEM}, {"role": "user", "content": user}]
            text = str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
            if "<think>" in (tok.chat_template or ""):
                text += THINK_SUFFIX
            return text
        return f"{RERANK_SYSTEM}\n\n{user}\n\nAnswer: "

    # -- score -----------------------------------------------------------------------------------

    async def score(self, body: dict, request=None) -> dict:
        """SGLang's /v1/score: for each item, the probabilities of `label_token_ids` as the next
        token after query + item (item + query with item_first); softmax over the labels with
        apply_softmax, else each label's own probability."""
        if not self.is_generation:
            raise InvalidRequest("/v1/score scores next tokens: this model is an encoder and does not generate")
        query, items = body.get("query"), body.get("items")
        labels = body.get("label_token_ids")
        if not isinstance(labels, list) or not labels or not all(_is_int(t) for t in labels):
            raise InvalidRequest(f"label_token_ids = {_clip(labels)} must be a non-empty list of token ids")
        if len(labels) > MAX_LABEL_TOKENS:
            raise InvalidRequest(f"label_token_ids has {len(labels)} ids, more than the limit of {MAX_LABEL_TOKENS}")
        bad = next((t for t in labels if not 0 <= t < self.tm.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"label_token_ids holds {bad}, out of range [0, {self.tm.vocab_size})")
        apply_softmax = check_bool(body, "apply_softmax", False)
        item_first = check_bool(body, "item_first", False)
        if isinstance(items, str):
            items = [items]
        if isinstance(query, str) and isinstance(items, list) and items and all(isinstance(i, str) for i in items):
            prompts: dict = {"text": [f"{i}{query}" if item_first else f"{query}{i}" for i in items]}
        elif (
            isinstance(query, list)
            and _is_ids(query)
            and isinstance(items, list)
            and items
            and all(_is_ids(i) and i for i in items)
        ):
            ids: list[list[int]] = [[int(t) for t in i] for i in items]
            prompts = {"input_ids": [(i + query) if item_first else (query + i) for i in ids]}
        else:
            raise InvalidRequest(
                "query and items must be a string and a list of strings, or token ids and a list of token-id lists"
            )
        obj = GenerateReqInput(
            **prompts,
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_logprob=True,
            token_ids_logprob=list(labels),
        )
        outs = await _first(self.tm.generate_request(obj, request))
        scores, tokens = [], 0
        for out in outs:
            by_id = {entry[1]: entry[0] for entry in out["meta_info"]["output_token_ids_logprobs"][0]}
            logprobs = np.array([by_id[t] for t in labels], dtype=np.float64)
            probs = _softmax(logprobs) if apply_softmax else np.exp(logprobs)
            scores.append(probs.tolist())
            tokens += out["meta_info"]["prompt_tokens"]
        return {
            "scores": scores,
            "model": self.model_name,
            "object": "scoring",
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }


async def _first(gen) -> list[dict]:
    out = await gen.__anext__()
    await gen.aclose()
    return out if isinstance(out, list) else [out]


def _tenant(request) -> str | None:
    return getattr(request.state, "tenant", None) if request is not None else None


def _is_int(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(_is_int(t) for t in value)


def _is_flat_ids(value) -> bool:
    return bool(value) and _is_ids(value)


def _clip(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _unit(v: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(v))
    return v / n if n > 0 else v


def _single_token(tokenizer, word: str) -> int:
    ids = tokenizer.encode(word, add_special_tokens=False)
    if len(ids) != 1:
        raise InvalidRequest(
            f"rerank: {word!r} is {len(ids)} tokens in this model's vocabulary; a yes/no reranker needs one"
        )
    return ids[0]

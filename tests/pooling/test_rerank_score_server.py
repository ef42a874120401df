"""Rerankers, scoring and decoder embeddings over HTTP, against HF transformers in float32:

- a tiny random BERT cross-encoder: /encode's logits equal HF's BertForSequenceClassification on the
  (query, document) pairs with their segment ids within 1e-5, /v1/rerank's scores are their sigmoid,
  best first, in SGLang's list and in the Cohere / Jina shape; /classify;
- a tiny random Llama with --is-embedding: embeddings equal HF's last hidden state of the last token,
  normalized, within 1e-5; a shared prefix is served from the radix cache; it still generates, and a
  flood of embedding requests does not stop a running generation (pooling rounds alternate with
  decode steps);
- the plain generation server: /v1/score's probabilities equal the logprobs /generate reports for the
  same tokens (text and token ids, item_first, apply_softmax), and a yes/no decoder rerank is P(yes)
  against P(no) from those logprobs; pooling routes there name --is-embedding;
- Engine.encode / rerank / score in process."""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import torch
from pooling.pooling_models import build_cross_encoder, sentences

transformers = pytest.importorskip("transformers")

TOL = 1e-5
QUERY = "Where does the cat sleep?"
DOCS = ["The cat sits on the mat.", "Stock markets fell sharply on Monday.", "A feline rests on a rug.", "Hi"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> str:
    return build_cross_encoder(str(tmp_path_factory.mktemp("cross-encoder")))


@pytest.fixture(scope="module")
def cross_server(shared_server, cross_encoder):
    return shared_server("--model-path", cross_encoder)


@pytest.fixture(scope="module")
def decoder_server(shared_server, tiny_chat_model):
    return shared_server(
        "--model-path",
        tiny_chat_model,
        "--is-embedding",
        "--max-total-tokens",
        "8192",
        "--max-pooling-batch-tokens",
        "48",
    )


def hf_cross_logits(path: str, query: str, docs: list[str]) -> np.ndarray:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.BertForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    batch = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits.numpy()


def test_cross_encoder_logits_and_rerank(cross_server, cross_encoder):
    want = hf_cross_logits(cross_encoder, QUERY, DOCS)[:, 0]
    # the pairs' logits, as the rerank computes them, through the public rerank answer
    ranked = cross_server.post("/v1/rerank", {"query": QUERY, "documents": DOCS}).json()
    assert [x["index"] for x in ranked] == list(np.argsort(-want, kind="stable"))
    for x in ranked:
        assert x["score"] == pytest.approx(1 / (1 + math.exp(-want[x["index"]])), abs=TOL)
        assert x["document"] == DOCS[x["index"]]
    cohere = cross_server.post("/v2/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2}).json()
    assert [r["index"] for r in cohere["results"]] == [x["index"] for x in ranked[:2]]
    assert cohere["results"][0]["relevance_score"] == pytest.approx(ranked[0]["score"], abs=1e-7)
    assert cohere["results"][0]["document"] == {"text": DOCS[ranked[0]["index"]]}
    assert cohere["usage"]["total_tokens"] > 0


def test_cross_encoder_encode_and_classify(cross_server, cross_encoder):
    tok = transformers.AutoTokenizer.from_pretrained(cross_encoder)
    model = transformers.BertForSequenceClassification.from_pretrained(cross_encoder, dtype=torch.float32).eval()
    texts = sentences(5)
    with torch.no_grad():
        want = model(**tok(texts, padding=True, return_tensors="pt")).logits.numpy()
    got = cross_server.post("/encode", {"text": texts}).json()
    assert np.abs(np.array([g["embedding"] for g in got]) - want).max() < TOL
    out = cross_server.post("/v1/classify", {"input": texts[:2]}).json()
    assert [d["index"] for d in out["data"]] == [0, 1]
    assert out["data"][0]["probs"] == [1.0] and out["data"][0]["label"] == "LABEL_0"
    r = cross_server.post("/v1/embeddings", {"input": "a"})
    assert r.status_code == 400 and "classifier" in r.json()["error"]["message"]


def hf_last_token(path: str, texts: list[str]) -> np.ndarray:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for t in texts:
            hidden = model(torch.tensor([tok(t)["input_ids"]])).last_hidden_state[0, -1]
            out.append(torch.nn.functional.normalize(hidden, dim=-1).numpy())
    return np.array(out)


def test_decoder_embeddings_match_hf_and_reuse_prefixes(decoder_server, tiny_chat_model):
    texts = sentences(12)
    want = hf_last_token(tiny_chat_model, texts)
    r = decoder_server.post("/v1/embeddings", {"input": texts, "encoding_format": "float"})
    assert r.status_code == 200, r.text
    got = np.array([d["embedding"] for d in r.json()["data"]])
    assert np.abs(got - want).max() < TOL
    decoder_server.flush_cache()
    prefix = "A long shared instruction that every query repeats before its own text: " * 3
    first = decoder_server.post("/encode", {"text": prefix + "alpha"}).json()
    second = decoder_server.post("/encode", {"text": prefix + "beta"}).json()
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"] - 4
    want2 = hf_last_token(tiny_chat_model, [prefix + "beta"])[0]
    assert np.abs(np.array(second["embedding"]) - want2).max() < TOL
    # the same server still generates
    out = decoder_server.generate(text="Hello", sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert out["meta_info"]["completion_tokens"] == 4


def test_pooling_flood_does_not_stop_generation(decoder_server):
    """Embedding requests keep arriving while a request decodes: pooling prefill rounds (48 tokens
    each here) alternate with decode steps, so the generation advances during the flood."""
    received: list[float] = []
    started = threading.Event()

    def stream():
        body = {
            "text": "Count:",
            "sampling_params": {"max_new_tokens": 600, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
        with requests.post(decoder_server.url + "/generate", json=body, stream=True, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    received.append(len(json.loads(line[6:])["output_ids"]))
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    before = received[-1]
    texts = [f"embedding request number {i} with a few more words" for i in range(120)]
    with ThreadPoolExecutor(32) as pool:
        codes = list(pool.map(lambda x: decoder_server.post("/v1/embeddings", {"input": x}).status_code, texts))
    during = received[-1] - before
    t.join()
    assert codes == [200] * 120
    # 120 inputs of ~12 tokens in rounds of at most 48 tokens: 30+ rounds, each followed by a decode step
    assert during >= 15, f"the generation advanced {during} tokens during the flood"


def test_score_matches_generate_logprobs(tiny_server, tiny_chat_model):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_chat_model)
    labels = [tok.encode(w, add_special_tokens=False)[0] for w in (" Paris", " London", " yes")]
    query, items = "The capital of France is", [" certainly", " maybe", ""]
    items = items[:2]
    r = tiny_server.post("/v1/score", {"query": query, "items": items, "label_token_ids": labels})
    assert r.status_code == 200, r.text
    scores = r.json()["scores"]
    for item, row in zip(items, scores):
        out = tiny_server.generate(
            text=query + item,
            sampling_params={"max_new_tokens": 1, "temperature": 0},
            return_logprob=True,
            token_ids_logprob=labels,
        )
        lp = {e[1]: e[0] for e in out["meta_info"]["output_token_ids_logprobs"][0]}
        assert row == pytest.approx([math.exp(lp[t]) for t in labels], abs=1e-6)
    soft = tiny_server.post(
        "/v1/score", {"query": query, "items": items, "label_token_ids": labels, "apply_softmax": True}
    ).json()["scores"]
    for row, probs in zip(scores, soft):
        assert probs == pytest.approx([p / sum(row) for p in row], abs=1e-6)
        assert sum(probs) == pytest.approx(1.0)
    # token ids, item first
    q_ids, item_ids = tok.encode(query), tok.encode(" certainly", add_special_tokens=False)
    by_ids = tiny_server.post(
        "/v1/score", {"query": q_ids, "items": [item_ids], "label_token_ids": labels, "item_first": True}
    ).json()["scores"][0]
    out = tiny_server.generate(
        input_ids=item_ids + q_ids,
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        token_ids_logprob=labels,
    )
    lp = {e[1]: e[0] for e in out["meta_info"]["output_token_ids_logprobs"][0]}
    assert by_ids == pytest.approx([math.exp(lp[t]) for t in labels], abs=1e-6)


def test_decoder_yes_no_rerank(tiny_server, tiny_chat_model):
    body = {"query": QUERY, "documents": DOCS[:3]}
    ranked = tiny_server.post("/v1/rerank", body).json()
    assert sorted(x["index"] for x in ranked) == [0, 1, 2]
    tok = transformers.AutoTokenizer.from_pretrained(tiny_chat_model)
    yes, no = tok.encode("yes", add_special_tokens=False)[0], tok.encode("no", add_special_tokens=False)[0]
    from srt.entrypoints.pooling import RERANK_INSTRUCT, RERANK_SYSTEM

    for x in ranked:
        user = f"<Instruct>: {RERANK_INSTRUCT}\n<Query>: {QUERY}\n<Document>: {DOCS[x['index']]}"
        prompt = tok.apply_chat_template(
            [{"role": "system", "content": RERANK_SYSTEM}, {"role": "user", "content": user}],
            tokenize=False,
            add_generation_prompt=True,
        )
        out = tiny_server.generate(
            text=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0}, token_ids_logprob=[yes, no]
        )
        lp = {e[1]: e[0] for e in out["meta_info"]["output_token_ids_logprobs"][0]}
        assert x["score"] == pytest.approx(1 / (1 + math.exp(lp[no] - lp[yes])), abs=1e-6)
    assert [x["score"] for x in ranked] == sorted((x["score"] for x in ranked), reverse=True)


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/v1/embeddings", {"input": "a"}, "--is-embedding"),
        ("/encode", {"text": "a"}, "--is-embedding"),
        ("/v1/score", {"query": "q", "items": ["a"]}, "label_token_ids"),
        ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [10**7]}, "out of range"),
        ("/v1/score", {"query": "q", "items": [3], "label_token_ids": [1]}, "query and items"),
        ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [1], "apply_softmax": 1}, "apply_softmax"),
    ],
)
def test_generation_server_bad_pooling_input(tiny_server, path, body, field):
    r = tiny_server.post(path, body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_engine_encode_rerank_score(tiny_chat_model):
    from srt.entrypoints.engine import Engine

    engine = Engine(tiny_chat_model, is_embedding=True, dtype="float32", max_total_tokens=4096, log_level="error")
    try:
        texts = sentences(3)
        outs = engine.encode(texts)
        assert np.abs(np.array([o["embedding"] for o in outs]) - hf_last_token(tiny_chat_model, texts)).max() < TOL
        single = engine.encode(texts[0], dimensions=16)
        assert isinstance(single, dict)
        assert len(single["embedding"]) == 16
        assert np.linalg.norm(single["embedding"]) == pytest.approx(1.0, abs=1e-5)
        ranked = engine.rerank(QUERY, DOCS, top_n=2)
        assert len(ranked) == 2 and ranked[0]["score"] >= ranked[1]["score"]
        scores = engine.score("The capital of France is", [" a", " b"], [5, 6], apply_softmax=True)
        assert len(scores) == 2 and all(sum(s) == pytest.approx(1.0) for s in scores)
    finally:
        engine.shutdown()
    time.sleep(0.1)


@pytest.mark.full
def test_decoder_embeddings_under_overlap_chunks_and_pages(shared_server, tiny_chat_model):
    """The overlap scheduler, prefill chunks of 16 tokens and pages of 4 give the same embeddings."""
    server = shared_server(
        "--model-path",
        tiny_chat_model,
        "--is-embedding",
        "--max-total-tokens",
        "8192",
        "--enable-overlap-schedule",
        "--chunked-prefill-size",
        "16",
        "--page-size",
        "4",
    )
    texts = [t * 3 for t in sentences(10)]  # 30-90 tokens: several chunks each
    with ThreadPoolExecutor(5) as pool:
        got = list(
            pool.map(lambda t: server.post("/v1/embeddings", {"input": t}).json()["data"][0]["embedding"], texts)
        )
    assert np.abs(np.array(got) - hf_last_token(tiny_chat_model, texts)).max() < TOL

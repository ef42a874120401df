"""all-MiniLM-L6-v2 served for embeddings (an encoder: it pools without --is-embedding): /v1/embeddings
over the official `openai` client (float and base64, `dimensions`) and over concurrent single-input
requests (other batch compositions) equal sentence-transformers' own `SentenceTransformer.encode` within
1e-5 in cosine; /encode's native shape; rerank by cosine in both answer shapes; every bad input is a
400 naming the field and the server keeps serving; generation is refused."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import requests
from pooling.pooling_models import minilm_folder, sentences

TOL = 1e-5


@pytest.fixture(scope="module")
def folder() -> str:
    return minilm_folder()


@pytest.fixture(scope="module")
def server(shared_server, folder):
    return shared_server("--model-path", folder)


@pytest.fixture(scope="module")
def reference(folder) -> np.ndarray:
    """sentence-transformers' embeddings of the 64 sentences (float32, its own pipeline)."""
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(folder, device="cpu")
    return model.encode(sentences(64), batch_size=64, convert_to_numpy=True)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=-1, keepdims=True)
    b = b / np.linalg.norm(b, axis=-1, keepdims=True)
    return (a * b).sum(-1)


def test_openai_client_float_and_base64_match_sentence_transformers(client, reference):
    texts = sentences(64)
    floats = client.embeddings.create(model="m", input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(64))
    got = np.array([d.embedding for d in floats.data], dtype=np.float32)
    assert got.shape == reference.shape == (64, 384)
    assert (1 - cosines(got, reference)).max() < TOL
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)  # the checkpoint's Normalize module
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 64
    # the client's default: base64 on the wire, decoded by the client into the same floats
    default = client.embeddings.create(model="m", input=texts)
    assert np.abs(np.array([d.embedding for d in default.data]) - got).max() < 1e-6


def test_base64_is_little_endian_float32(server):
    r = server.post("/v1/embeddings", {"input": "Tea or coffee?", "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert len(raw) == 384 * 4
    plain = server.post("/v1/embeddings", {"input": "Tea or coffee?"}).json()["data"][0]["embedding"]
    assert np.array_equal(np.frombuffer(raw, dtype="<f4"), np.array(plain, dtype=np.float32))


def test_dimensions_truncate_and_renormalize(client, reference):
    out = client.embeddings.create(model="m", input=sentences(8), dimensions=64, encoding_format="float")
    got = np.array([d.embedding for d in out.data])
    assert got.shape == (8, 64)
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    assert (1 - cosines(got, reference[:8, :64])).max() < TOL


def test_concurrent_single_requests_match(server, reference):
    """Each sentence alone, 16 in flight: batches of other compositions give the same embeddings."""
    texts = sentences(64)

    def one(i):
        r = server.post("/v1/embeddings", {"input": texts[i]})
        assert r.status_code == 200, r.text
        return r.json()["data"][0]["embedding"]

    with ThreadPoolExecutor(16) as pool:
        got = np.array(list(pool.map(one, range(64))), dtype=np.float32)
    assert (1 - cosines(got, reference)).max() < TOL


def test_token_ids_and_native_encode(server, folder, reference):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok(sentences(3))["input_ids"]
    r = server.post("/v1/embeddings", {"input": ids})
    assert r.status_code == 200, r.text
    got = np.array([d["embedding"] for d in r.json()["data"]])
    assert (1 - cosines(got, reference[:3])).max() < TOL
    one = server.post("/encode", {"text": sentences(1)[0]}).json()
    assert set(one) == {"embedding", "meta_info"} and len(one["embedding"]) == 384
    assert one["meta_info"]["prompt_tokens"] == len(ids[0])
    batch = server.post("/encode", {"input_ids": ids[:2]}).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert (1 - cosines(np.array([b["embedding"] for b in batch]), reference[:2])).max() < TOL


def test_truncate(server, folder):
    long = " ".join(["word"] * 400)
    r = server.post("/v1/embeddings", {"input": long})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "input[0]" in msg and "256" in msg and "truncate" in msg
    cut = server.post("/v1/embeddings", {"input": long, "truncate": True})
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == 256


def test_rerank_by_cosine_both_shapes(server):
    body = {
        "query": "Where does the cat sleep?",
        "documents": ["Stock markets fell.", {"text": "The cat sits on the mat."}, "Tea or coffee?"],
        "top_n": 2,
    }
    r = server.post("/v1/rerank", body)
    assert r.status_code == 200, r.text
    ranked = r.json()
    assert [x["index"] for x in ranked][0] == 1 and len(ranked) == 2
    assert ranked[0]["score"] >= ranked[1]["score"]
    assert ranked[0]["document"] == {"text": "The cat sits on the mat."}
    cohere = server.post("/v2/rerank", {**body, "return_documents": True}).json()
    assert [x["index"] for x in cohere["results"]] == [x["index"] for x in ranked]
    assert cohere["results"][0]["document"] == {"text": "The cat sits on the mat."}
    assert cohere["results"][0]["relevance_score"] == pytest.approx(ranked[0]["score"], abs=1e-6)
    assert "document" not in server.post("/rerank", {**body, "return_documents": False}).json()["results"][0]


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/v1/embeddings", {"input": ""}, "input[0] is empty"),
        ("/v1/embeddings", {"input": []}, "input is empty"),
        ("/v1/embeddings", {"input": ["ok", ""]}, "input[1] is empty"),
        ("/v1/embeddings", {}, "input is required"),
        ("/v1/embeddings", {"input": 5}, "input must be"),
        ("/v1/embeddings", {"input": ["a", 3]}, "input must be"),
        ("/v1/embeddings", {"input": [[1, 2], "a"]}, "input must be"),
        ("/v1/embeddings", {"input": [[1, 99999]]}, "out of range [0, 30522)"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "fp16"}, "encoding_format = 'fp16'"),
        ("/v1/embeddings", {"input": "a", "dimensions": 385}, "dimensions = 385 is more than this model's 384"),
        ("/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions = 0 must be an integer >= 1"),
        ("/v1/embeddings", {"input": "a", "dimensions": "8"}, "dimensions = '8'"),
        ("/v1/embeddings", {"input": "a", "truncate": "yes"}, "truncate = 'yes'"),
        ("/encode", {"text": "a", "input_ids": [1]}, "exactly one of text or input_ids"),
        ("/v1/rerank", {"query": "", "documents": ["a"]}, "query = ''"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents must be a non-empty list"),
        ("/v1/rerank", {"query": "q", "documents": ["a", {"x": 1}]}, "documents[1]"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n = 0"),
        ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [1]}, "encoder"),
        ("/classify", {"input": "a"}, "no classification head"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, path, body, field):
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"]


def test_not_json_object_and_generation_refused(server):
    r = requests.post(server.url + "/v1/embeddings", data=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400
    g = server.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert g.status_code == 400 and "encoder" in g.json()["error"]["message"]
    ok = server.post("/v1/embeddings", {"input": "still serving"})
    assert ok.status_code == 200

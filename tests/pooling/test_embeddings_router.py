"""Two MiniLM servers behind SGLang's router (`sglang-router`): /v1/embeddings over the official
`openai` client through the router equals a worker's own answer, and /v1/rerank goes through (the
router wraps SGLang's list as `{"results": [...]}`)."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import requests
from pooling.pooling_models import minilm_folder, sentences

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install -e '.[dev]')")


@pytest.fixture(scope="module")
def workers(shared_server):
    return shared_server.replicas(2, "--model-path", minilm_folder())


@pytest.fixture(scope="module")
def router(workers, tmp_path_factory):
    from server.test_router import Router

    r = Router([w.url for w in workers], str(tmp_path_factory.mktemp("router") / "router.log"))
    yield r
    r.stop()


def test_embeddings_and_rerank_through_the_router(router, workers):
    texts = sentences(8)
    via = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    got = np.array([d.embedding for d in via.embeddings.create(model="m", input=texts).data])
    direct = workers[0].post("/v1/embeddings", {"input": texts}).json()["data"]
    assert np.abs(got - np.array([d["embedding"] for d in direct])).max() < 1e-6
    for text in texts[:4]:  # single inputs, spread over both workers
        one = via.embeddings.create(model="m", input=text, dimensions=32).data[0].embedding
        assert len(one) == 32
    r = requests.post(
        router.url + "/v1/rerank", json={"query": "Where does the cat sleep?", "documents": texts[:3]}, timeout=60
    )
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert sorted(x["index"] for x in results) == [0, 1, 2]
    assert results[0]["index"] == 0  # "The cat sits on the mat."

"""vLLM's /v1/score and /v1/rerank (and /v2/rerank, Cohere's path) on a real sentence-transformers encoder
(all-MiniLM-L6-v2): each score is sentence-transformers' cosine similarity of the two texts, documents come back
ranked by it, and what cannot be paired or scored is a 400. Behind an API key, as every API path."""

from __future__ import annotations

import numpy as np
import pytest

from ..support.in_process import InProcessServer

QUERY = "Which city is the capital of France?"
DOCUMENTS = [
    "The cat sat on the mat.",
    "Paris is the capital of France; its museums are among the most visited in the world.",
    "Embeddings map text to vectors.",
    "Lyon is a large city in France, known for its food.",
    "ok",
    "Berlin is the capital of Germany.",
]


@pytest.fixture(scope="module")
def server(minilm_dir):
    # 64 tokens per step: the texts of one request take several steps, several texts each.
    with InProcessServer({"model": minilm_dir, "max_num_batched_tokens": 64, "api_key": "the-key"}) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with server.client(headers={"Authorization": "Bearer the-key"}) as client:
        yield client


@pytest.fixture(scope="module")
def reference(minilm_dir):
    """sentence-transformers' cosine similarity of each second text with its first (the one first, or its pair)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir), device="cpu")

    def scores(firsts: list[str], seconds: list[str]) -> np.ndarray:
        a, b = (model.encode(texts, normalize_embeddings=True).astype(np.float64) for texts in (firsts, seconds))
        return (np.broadcast_to(a, b.shape) * b).sum(1)

    return scores


def tokens(server, texts: list[str]) -> int:
    return sum(len(server.manager.default.tokenizer.encode(text)) for text in texts)


def test_rerank_ranks_documents_by_sentence_transformers_cosine(server, http, reference):
    expected = reference([QUERY], DOCUMENTS)
    reply = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert [r["index"] for r in results] == np.argsort(-expected).tolist()
    assert results[0] == {
        "index": 1,
        "document": {"text": DOCUMENTS[1]},
        "relevance_score": results[0]["relevance_score"],
    }
    assert np.allclose([r["relevance_score"] for r in results], np.sort(expected)[::-1], atol=1e-5)
    assert reply.json()["usage"] == {"total_tokens": tokens(server, [QUERY, *DOCUMENTS])}
    # Cohere's path; documents as objects (Jina's form); the first three, without their text
    body = {"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "top_n": 3, "return_documents": False}
    top = http.post("/v2/rerank", json=body).json()
    assert top["results"] == [{"index": r["index"], "relevance_score": r["relevance_score"]} for r in results[:3]]
    with server.client() as keyless:
        assert keyless.post("/v2/rerank", json=body).status_code == 401


def test_score_pairs_one_text_with_each_or_pair_by_pair(server, http, reference):
    one_to_many = http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["index"] for d in one_to_many["data"]] == list(range(len(DOCUMENTS)))
    assert np.allclose([d["score"] for d in one_to_many["data"]], reference([QUERY], DOCUMENTS), atol=1e-5)
    assert one_to_many["usage"]["prompt_tokens"] == tokens(server, [QUERY, *DOCUMENTS])
    firsts = [QUERY, "A pet on a rug.", "Vectors of text."]
    pairwise = http.post("/v1/score", json={"text_1": firsts, "text_2": DOCUMENTS[:3]}).json()
    assert np.allclose([d["score"] for d in pairwise["data"]], reference(firsts, DOCUMENTS[:3]), atol=1e-5)
    single = http.post("/v1/score", json={"text_1": [QUERY], "text_2": DOCUMENTS[1]}).json()["data"]
    assert single[0]["score"] == pytest.approx(one_to_many["data"][1]["score"], abs=1e-6)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
        ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/v1/score", {"text_1": "", "text_2": "b"}, "text_1"),
        ("/v1/score", {"text_1": "a"}, "text_2"),
        ("/v1/score", {"text_1": "word " * 300, "text_2": "b"}, "text_1"),  # these three each named the second
        ("/v1/rerank", {"query": "word " * 300, "documents": ["b"]}, "query"),
        ("/v1/rerank", {"query": "a", "documents": ["b", "word " * 300]}, "documents.1"),
        ("/v1/rerank", {"query": "", "documents": ["b"]}, "query"),
        ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": "a", "documents": [{"txt": "b"}]}, "documents"),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "return_documents": "yes"}, "return_documents"),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": 1.0}, "top_n"),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "truncate_prompt_tokens": 100_000}, "truncate_prompt_tokens"),
        ("/v2/rerank", {"query": "a", "documents": ["b"], "max_tokens_per_doc": 5}, "max_tokens_per_doc"),  # Cohere's
    ],
)
def test_what_cannot_be_scored_is_a_400_naming_its_field(server, http, path, body, param):
    reply = http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert server.metrics()["wsgi_infer:num_requests_running"] == 0

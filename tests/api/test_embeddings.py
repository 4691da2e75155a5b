"""/v1/embeddings with a real sentence-transformers encoder (all-MiniLM-L6-v2, from its PyPI wheel): the openai SDK
gets sentence-transformers' own embeddings, inputs share engine steps, and what the model does not do is a 400."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import openai
import pytest

from ..plugins.server_fixtures import openai_client
from ..support.in_process import InProcessServer

TEXTS = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog near the river bank, then runs far away into the forest.",
    "Embeddings map text to vectors.",
    "Paris is the capital of France; its museums are among the most visited in the world. " * 3,
    "ok",
    "Ünïcödé and emoji 🙂 are tokens too.",
    "Retrieval-augmented generation reads the closest passages first.",
    "short",
]


@pytest.fixture(scope="module")
def embedding_api(minilm_dir):
    # 64 tokens per step: the batch below takes several steps, several inputs each.
    with InProcessServer({"model": minilm_dir, "max_num_batched_tokens": 64}) as server:
        yield server


@pytest.fixture(scope="module")
def client(embedding_api) -> openai.OpenAI:
    return openai_client(embedding_api)


@pytest.fixture(scope="module")
def reference(minilm_dir) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu").encode(TEXTS)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_a_batch_equals_sentence_transformers_and_shares_engine_steps(embedding_api, client, reference):
    before = embedding_api.metrics()
    reply = client.embeddings.create(model=embedding_api.manager.model_name, input=TEXTS)  # base64, decoded by the SDK
    after = embedding_api.metrics()
    ours = np.array([d.embedding for d in reply.data])
    assert [d.index for d in reply.data] == list(range(len(TEXTS)))
    assert cosines(ours, reference).min() > 0.9999
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)  # the model's Normalize module
    tokenizer = embedding_api.manager.default.tokenizer
    assert reply.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS) == reply.usage.total_tokens
    steps = after["wsgi_infer:iteration_tokens_total_count"] - before["wsgi_infer:iteration_tokens_total_count"]
    assert 1 < steps < len(TEXTS)  # more than one step (64 tokens each), fewer than one per input


def test_floats_base64_token_ids_and_one_string_agree(embedding_api, reference):
    ids = embedding_api.manager.default.tokenizer.encode(TEXTS[1])
    with embedding_api.client() as http:
        floats = http.post("/v1/embeddings", json={"input": TEXTS[1]}).json()
        packed = http.post("/v1/embeddings", json={"input": [TEXTS[1]], "encoding_format": "base64"}).json()
        from_ids = http.post("/v1/embeddings", json={"input": [ids], "dimensions": 384}).json()
    vector = np.array(floats["data"][0]["embedding"])
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, vector.astype(np.float32))
    assert np.allclose(from_ids["data"][0]["embedding"], vector, atol=1e-6)
    assert cosines(vector[None], reference[1][None])[0] > 0.9999


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": "word " * 300}, "input"),  # over the model's 256 tokens
        ({"input": ["hi", "word " * 300]}, "input.1"),  # the one at fault
        ({"input": [[101, 999999, 102]]}, "input"),
        ({"input": [True]}, "input"),  # not token id 1
        ({"input": "hi", "dimensions": 128}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "model": "text-embedding-3-small"}, "model"),
        # vLLM's, changing the vectors or their bytes: refused, not ignored
        ({"input": "hi", "normalize": False}, "normalize"),
        ({"input": "hi", "add_special_tokens": False}, "add_special_tokens"),
        ({"input": "hi", "encoding_format": "base64", "embed_dtype": "float16"}, "embed_dtype"),
        ({"input": "hi", "encoding_format": "base64", "endianness": "big"}, "endianness"),
        ({"input": "hi", "messages": [{"role": "user", "content": "something else"}]}, "messages"),
    ],
)
def test_bad_inputs_are_400s_naming_the_field(embedding_api, body, param):
    with embedding_api.client() as http:
        reply = http.post("/v1/embeddings", json=body)
    assert reply.status_code == (404 if param == "model" else 400) and reply.json()["error"]["param"] == param


def test_vllms_fields_at_their_defaults_are_taken(embedding_api):
    neutral = {"add_special_tokens": True, "embed_dtype": "float32", "endianness": "little"}
    with embedding_api.client() as http:
        plain = http.post("/v1/embeddings", json={"input": "hi", "encoding_format": "base64"})
        given = http.post("/v1/embeddings", json={"input": "hi", "encoding_format": "base64", **neutral})
    assert given.status_code == 200 and given.json()["data"] == plain.json()["data"]


def test_the_server_says_it_embeds_and_refuses_to_generate(embedding_api):
    with embedding_api.client() as http:
        assert http.get("/v1/models").json()["data"][0]["task"] == "embed"
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/responses", {"input": "hi"}),
        ):
            reply = http.post(path, json=body)
            assert reply.status_code == 400 and reply.json()["error"]["code"] == "wrong_model_task", path
    assert embedding_api.manager.num_open_requests == 0


def transformers_pooled(model_dir: Path, texts: list[str], pooling: str) -> np.ndarray:
    """The reference: transformers' final hidden states (after the last norm), pooled, L2-normalized."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModel.from_pretrained(model_dir).eval()
    rows = []
    with torch.no_grad():
        for text in texts:
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
            rows.append(hidden.mean(0) if pooling == "mean" else hidden[-1])
    return torch.nn.functional.normalize(torch.stack(rows), dim=1).numpy()


def test_a_generating_model_embeds_by_mean_pooling_over_the_server(tiny_api, tiny_model_dirs):
    texts = [TEXTS[3], TEXTS[0], TEXTS[3]]  # the long one twice: its second read may not take the prefix cache
    with tiny_api.client() as http:
        reply = http.post("/v1/embeddings", json={"input": texts}).json()
    ours = np.array([d["embedding"] for d in reply["data"]])
    assert np.allclose(ours, transformers_pooled(tiny_model_dirs["llama"], texts, "mean"), atol=1e-5)
    assert tiny_api.manager.num_open_requests == 0


def test_last_token_pooling_through_chunks_and_the_prefix_cache(tiny_llama, tiny_model_dirs):
    """The engine itself: a prompt read in several chunks, then again from the prefix cache, embeds the same."""
    from wsgi_infer import SamplingParams

    engine, ids = tiny_llama.engine, tiny_llama.engine.tokenize(TEXTS[3] * 2)
    found, hits = {}, []
    for request_id in ("first", "again"):
        hits.append(engine.counters().num_prefix_hit_tokens)
        engine.add_request(request_id, ids, SamplingParams(max_tokens=0, pooling="last"))
        while engine.has_unfinished():
            found.update({d.request_id: d.embedding for d in engine.step() if d.finished})
    expected = transformers_pooled(tiny_model_dirs["llama"], [TEXTS[3] * 2], "last")[0]
    assert len(ids) > 64 and engine.counters().num_prefix_hit_tokens > hits[1]  # chunks of 64, then the cache
    assert np.allclose(found["first"], expected, atol=1e-5) and np.allclose(found["again"], expected, atol=1e-5)


def test_truncate_prompt_tokens_keeps_the_last_tokens_as_sentence_transformers_truncating_on_the_left(
    embedding_api, minilm_dir
):
    from sentence_transformers import SentenceTransformer

    text = " ".join(TEXTS) * 4  # over the model's 256 tokens
    model = SentenceTransformer(str(minilm_dir), device="cpu")
    references = {}
    for side, length in (("left", 40), ("right", 40), ("left", 256)):
        model.max_seq_length, model.tokenizer.truncation_side = length, side
        references[side, length] = model.encode([text])
    with embedding_api.client() as http:
        kept = http.post("/v1/embeddings", json={"input": text, "truncate_prompt_tokens": 40}).json()
        window = http.post("/v1/embeddings", json={"input": text, "truncate_prompt_tokens": -1}).json()
        refused = http.post("/v1/embeddings", json={"input": text, "truncate_prompt_tokens": 257}).json()
        no_room = http.post("/v1/embeddings", json={"input": text, "truncate_prompt_tokens": 2})  # [SEP] was kept
    assert kept["usage"]["prompt_tokens"] == 40 and window["usage"]["prompt_tokens"] == 256
    ours = np.array([kept["data"][0]["embedding"]])
    assert cosines(ours, references["left", 40])[0] > 0.9999 > cosines(ours, references["right", 40])[0]
    assert cosines(np.array([window["data"][0]["embedding"]]), references["left", 256])[0] > 0.9999
    assert refused["error"]["param"] == "truncate_prompt_tokens" and "256" in refused["error"]["message"]
    assert no_room.status_code == 400 and "at least 3, got 2" in no_room.json()["error"]["message"]

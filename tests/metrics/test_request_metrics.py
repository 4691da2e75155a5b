"""What ``/metrics`` counts per request, as vLLM counts it, over the tiny engine in this process: each of ``n``
choices a request of its own, the phases of a request's time, an embedding a request that stopped."""

from __future__ import annotations

import pytest

from ..support.server import labelled_samples

PROMPT = "Rivers and gardens, again and again."


def grown(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(f"wsgi_infer:{name}", 0) - before.get(f"wsgi_infer:{name}", 0)


def successes(server) -> dict[str, float]:
    with server.client() as http:
        text, model = http.get("/metrics").text, server.manager.model_name  # this process may serve others
        samples = labelled_samples(text, "wsgi_infer:request_success_total", model)
    return {dict(labels)["finished_reason"]: value for labels, value in samples.items()}


def test_each_of_n_choices_counts_as_a_request_with_its_prompt_and_its_phases(tiny_api):
    body = {"prompt": PROMPT, "n": 3, "max_tokens": 4, "ignore_eos": True, "temperature": 1.0, "seed": 7}
    before, reasons_before = tiny_api.metrics(), successes(tiny_api)
    with tiny_api.client() as http:
        usage = http.post("/v1/completions", json=body).json()["usage"]
    after = tiny_api.metrics()
    prompt = usage["prompt_tokens"]
    assert grown(before, after, "prompt_tokens_total") == 3 * prompt  # it was the prompt once, beside n of the rest
    assert grown(before, after, "request_prompt_tokens_sum") == 3 * prompt
    assert successes(tiny_api)["length"] - reasons_before.get("length", 0) == 3
    for histogram in (
        "e2e_request_latency_seconds",  # it was one per request, beside a time to first token per choice
        "time_to_first_token_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_time_per_output_token_seconds",
    ):
        assert grown(before, after, f"{histogram}_count") == 3, histogram
    phases = grown(before, after, "request_prefill_time_seconds_sum") + grown(
        before, after, "request_decode_time_seconds_sum"
    )
    assert grown(before, after, "request_inference_time_seconds_sum") == pytest.approx(phases)
    assert 0 < phases <= grown(before, after, "e2e_request_latency_seconds_sum")


def test_an_embedding_is_a_request_that_stopped_not_one_that_ran_out_of_tokens(tiny_api):
    reasons_before = successes(tiny_api)
    with tiny_api.client() as http:
        reply = http.post("/v1/embeddings", json={"input": ["gardens", "rivers and gardens"]})
    assert reply.status_code == 200
    reasons = successes(tiny_api)
    assert reasons["stop"] - reasons_before.get("stop", 0) == 2
    assert reasons.get("length", 0) == reasons_before.get("length", 0)


def test_every_finish_reason_has_its_series_before_its_first_request(tiny_api):
    from wsgi_infer.server.metrics import ModelMetrics

    ModelMetrics("a-model-never-asked")
    with tiny_api.client() as http:
        samples = labelled_samples(http.get("/metrics").text, "wsgi_infer:request_success_total", "a-model-never-asked")
    assert {dict(labels)["finished_reason"]: value for labels, value in samples.items()} == {
        "stop": 0,
        "length": 0,
        "abort": 0,
        "error": 0,
    }

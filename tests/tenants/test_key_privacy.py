"""Each API key reads only its own: another key's stored responses, their input items and its streams are a 404,
and a chain cannot continue another key's response."""

from __future__ import annotations

from ..conftest import tiny_settings
from ..support.in_process import InProcessServer
from ..support.sse_client import events

ASK = "What is the weather like in Paris today?"


def test_each_key_reads_only_its_own_responses_and_streams(tiny_model_dirs):
    with InProcessServer(tiny_settings(tiny_model_dirs, api_key="key-one,key-two")) as server:
        one, two = ({"Authorization": f"Bearer {key}"} for key in ("key-one", "key-two"))
        with server.client() as http:
            created = http.post("/v1/responses", json={"input": ASK, "max_output_tokens": 2}, headers=one).json()
            chat = {"messages": [{"role": "user", "content": ASK}], "max_tokens": 2, "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=chat, headers=one) as reply:
                stream_id = reply.headers["X-Stream-Id"]
                list(events(reply))
            assert http.get(f"/v1/responses/{created['id']}", headers=one).status_code == 200
            assert http.get(f"/v1/responses/{created['id']}", headers=two).status_code == 404
            assert http.get(f"/v1/responses/{created['id']}/input_items", headers=one).status_code == 200
            assert http.get(f"/v1/responses/{created['id']}/input_items", headers=two).status_code == 404
            assert http.delete(f"/v1/responses/{created['id']}", headers=two).status_code == 404
            assert http.get(f"/v1/responses/{created['id']}", headers=one).status_code == 200  # not deleted either
            assert http.get(f"/v1/streams/{stream_id}", headers=one).status_code == 200
            assert http.get(f"/v1/streams/{stream_id}", headers=two).status_code == 404
            follow = {"input": ASK, "previous_response_id": created["id"], "max_output_tokens": 2}
            assert http.post("/v1/responses", json=follow, headers=two).status_code == 400  # not found

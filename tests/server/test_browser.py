"""The chat page in a real headless Chromium (Debian's), driven by Playwright."""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from wsgi_infer import SamplingParams

from ..support.nginx_proxy import NginxProxy
from ..support.server import ENDLESS, GunicornServer

pytestmark = pytest.mark.slow  # real processes

STATIC = Path(__file__).parents[2] / "wsgi_infer" / "server" / "static"


@pytest.fixture(scope="module")
def server(gunicorn_server, tiny_model_dirs):
    # A stream nobody reads is abandoned one heartbeat interval after its reader left: 30 s, which a reload's resume
    # is well within, and which Stop's cancel does not wait for.
    return gunicorn_server(
        {"model": tiny_model_dirs["llama"], "dtype": "float32", "quantization": "none", "heartbeat_seconds": 30}
    )


@pytest.fixture
def page(browser, server):
    page = browser.new_page(bypass_csp=True)  # the page's CSP refuses Playwright's string predicates (eval)
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model').textContent === 'tiny-llama0'")
    yield page
    page.close()


def ask(page, prompt: str, max_tokens: int) -> None:
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.fill("#prompt", prompt)
    page.click("#send")


def test_text_appears_incrementally_and_matches_the_engine(page, tiny_llama):
    prompt = "Tell me about the sea"
    expected = tiny_llama.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=400))[
        0
    ].text
    ask(page, prompt, 400)
    page.wait_for_function("document.querySelector('.assistant.streaming')?.textContent.length > 0")
    early = len(page.text_content(".assistant"))
    page.wait_for_function(
        f"(() => {{ const a = document.querySelector('.assistant'); "
        f"return a.classList.contains('streaming') && a.textContent.length > {early} }})()"
    )  # more text arrived while the stream was still open
    assert page.get_attribute("#transcript", "aria-busy") == "true"  # a screen reader waits: it read every token
    assert page.evaluate("document.activeElement.id") == "prompt"  # not lost with the disabled Send button
    page.wait_for_function("!document.querySelector('.assistant').classList.contains('streaming')")
    assert page.text_content(".assistant") == expected
    assert "finish: " in page.text_content("#status")
    assert early < len(expected) and page.get_attribute("#transcript", "aria-busy") == "false"
    assert page.get_by_label("message").count() == 1  # the prompt's name: a placeholder is none


def test_stop_cancels_the_generation_at_once_and_its_text_joins_the_conversation(page, server):
    """Stop only cut the connection, which keeps a stream a heartbeat for a resume (30 s here); and the conversation
    sent next lacked both the question and the partial reply the page still showed."""
    mark = len(server.lines)
    ask(page, "Go on forever", ENDLESS)  # the composer is fixed: Stop can be clicked while text streams
    page.wait_for_function("document.querySelector('.assistant.streaming')?.textContent.length > 0")
    page.click("#stop")
    page.wait_for_function("document.getElementById('status').textContent === 'stopped'")
    server.wait_for_log(r"response ended early, aborted 1", after=mark, timeout=15)  # not the heartbeat's 30 s
    metrics = server.metrics()
    assert metrics["wsgi_infer:open_streams"] == 0
    assert metrics["wsgi_infer:kv_blocks_free"] == metrics["wsgi_infer:kv_blocks_total"]
    shown = page.text_content(".assistant")
    assert page.evaluate("state.turns") == [
        {"role": "user", "content": "Go on forever"},
        {"role": "assistant", "content": shown},
    ]


def test_a_reload_mid_reply_keeps_the_conversation_and_resumes_the_reply(page, tiny_llama):
    """The page kept nothing: a reload lost the conversation, and the reply went on unread until abandoned."""
    prompt = "Keep talking through the reload"
    expected = tiny_llama.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=800))
    ask(page, prompt, 800)
    page.wait_for_function("document.querySelector('.assistant.streaming')?.textContent.length > 20")
    page.reload()
    page.wait_for_function("document.querySelector('.assistant')?.classList.contains('streaming') === false")
    assert page.text_content(".user") == prompt
    assert page.text_content(".assistant") == expected[0].text
    assert "finish: length" in page.text_content("#status")


def test_enter_sends_shift_enter_breaks_the_line_and_an_empty_field_is_the_servers_default(page):
    page.fill("#max_tokens", "")  # it was sent as max_tokens 0: an empty reply
    page.fill("#prompt", "Line one")
    page.press("#prompt", "Shift+Enter")
    page.type("#prompt", "line two")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.press("#prompt", "Enter")
    body = sent.value.post_data_json
    assert body["messages"] == [{"role": "user", "content": "Line one\nline two"}] and "max_tokens" not in body
    assert sent.value.headers["x-session-id"]  # the conversation's name, for nginx's several-host routing
    page.wait_for_function("document.querySelector('.assistant.streaming')?.textContent.length > 0")
    page.click("#stop")  # the tiny model's reply would run to the window's end
    page.wait_for_function("document.getElementById('status').textContent === 'stopped'")


def test_a_cut_connection_resumes_without_losing_or_repeating_tokens(browser, tiny_model_dirs, tiny_llama):
    prompt = "Keep talking through the cut"
    params = SamplingParams(temperature=0, max_tokens=800)  # seconds of steps: the cut comes mid-stream
    expected = tiny_llama.chat([{"role": "user", "content": prompt}], params)[0].text
    # Heartbeats of 10 s: the cut stream is kept for longer than all of the page's retries
    # (150 ms x attempt, 10 attempts: 8.25 s in all).
    settings = {"model": tiny_model_dirs["llama"], "dtype": "float32", "quantization": "none", "heartbeat_seconds": 10}
    with GunicornServer(settings) as server, NginxProxy(f"127.0.0.1:{server.port}") as nginx:
        server.wait_ready()
        page = browser.new_page(bypass_csp=True)
        page.goto(nginx.url + "/")
        page.wait_for_function("document.getElementById('model').textContent === 'tiny-llama0'")
        ask(page, prompt, 800)
        page.wait_for_function("document.querySelector('.assistant.streaming')?.textContent.length > 20")
        nginx.cut()  # the browser's connection drops mid-stream
        page.wait_for_function("document.getElementById('status').textContent.startsWith('connection lost')")
        nginx.start()
        page.wait_for_function("!document.querySelector('.assistant').classList.contains('streaming')", timeout=60_000)
        assert page.text_content(".assistant") == expected
        assert "finish: length" in page.text_content("#status")
        page.close()


def test_errors_are_shown_clearly(page):
    ask(page, "Too long", 100_000)
    page.wait_for_function("document.getElementById('status').className === 'error'")
    assert "400: prompt" in page.text_content("#status") and "context window" in page.text_content("#status")


# A template whose prompt opens the thought, as DeepSeek-R1's: the tiny random model's reply is all thought
OPENED = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n<think>\n{% if enable_thinking is defined and not enable_thinking %}</think>\n{% endif %}"
)


def test_a_thinking_models_thought_shows_apart_from_its_answer(browser, gunicorn_server, tiny_model_dirs, tmp_path):
    """Before, the page showed only content: a reply that was all thought left the message empty."""
    model = shutil.copytree(tiny_model_dirs["llama"], tmp_path / "thinking")
    (model / "chat_template.jinja").write_text(OPENED)
    server = gunicorn_server({"model": model, "dtype": "float32", "quantization": "none"})
    body = {"messages": [{"role": "user", "content": "Think it over"}], "max_tokens": 40, "temperature": 0}
    expected = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert expected["reasoning_content"] and not expected["content"]  # the case: a reply that is all thought
    page = browser.new_page(bypass_csp=True)  # the page's CSP refuses Playwright's string predicates (eval)
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model').textContent === 'thinking'")
    ask(page, "Think it over", 40)
    page.wait_for_function("!document.querySelector('.assistant').classList.contains('streaming')")
    assert page.text_content(".assistant .thought div") == expected["reasoning_content"]
    assert page.text_content(".assistant .answer") == ""
    assert page.get_attribute(".assistant .thought", "open") is not None  # no answer began: it stays open
    page.close()


def test_another_site_cannot_frame_the_page_which_works_under_its_own_policy(browser, server):
    """Framed by another site, the page's own requests pass the origin check: a user clicking through an overlay
    would send for it (clickjacking). The page says it may not be framed, and Chromium shows it nowhere."""
    page, refused = browser.new_page(), []
    page.on("console", lambda message: refused.append(message.text) if "Content Security" in message.text else None)
    page.goto(server.url + "/")  # under its policy (the other tests' pages bypass it): it lists the models
    page.locator("#model option", has_text="tiny-llama0").wait_for(state="attached")
    assert not refused
    page.set_content(f'<iframe src="{server.url}/" width="640" height="480"></iframe>', wait_until="load")
    (framed,) = page.main_frame.child_frames
    assert framed.query_selector("#send") is None, framed.url
    page.close()
    headers = httpx.get(server.url + "/").headers
    assert "frame-ancestors 'none'" in headers["content-security-policy"] and headers["x-frame-options"] == "DENY"


REPLY = [  # a reply in two events, as chunks of /v1/chat/completions, and its end
    'id: 1\ndata: {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": null}]}\n\n',
    'id: 2\ndata: {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]}\n\n',
    "id: 3\ndata: [DONE]\n\n",
]


class ScriptedReplies(BaseHTTPRequestHandler):
    """The page's own files, and replies as the test scripts them: a prompt saying "crlf" gets the whole reply with
    CRLF line ends; any other, its first event, then silence on an open connection, and the rest on its resume."""

    silence = threading.Event()  # set: the silent connections end

    def do_GET(self) -> None:
        if self.path.startswith("/v1/streams/s?last_event_id=1"):
            return self._answer("text/event-stream", "".join(REPLY[1:]).encode())
        if self.path == "/v1/models":
            return self._answer("application/json", json.dumps({"data": [{"id": "m", "state": "loaded"}]}).encode())
        name = "index.html" if self.path == "/" else self.path.removeprefix("/static/")
        self._answer("text/html" if name.endswith("html") else "text/plain", (STATIC / name).read_bytes())

    def do_POST(self) -> None:
        asked = self.rfile.read(int(self.headers["Content-Length"])).decode()
        if "crlf" in asked:
            return self._answer("text/event-stream", "".join(REPLY).replace("\n", "\r\n").encode())
        self._answer("text/event-stream", REPLY[0].encode(), {"X-Stream-Id": "s"})
        self.silence.wait(60)

    def _answer(self, kind: str, body: bytes, headers: dict | None = None) -> None:
        self.send_response(200)
        for name, value in {"Content-Type": kind, **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def scripted(browser):
    ScriptedReplies.silence = threading.Event()  # this test's own (the last one's ended its connections)
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedReplies)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    page = browser.new_page(bypass_csp=True)
    page.add_init_script("window.WSGI_INFER_STALL_MS = 1000")
    page.goto(f"http://127.0.0.1:{server.server_port}/")
    page.wait_for_function("document.getElementById('model').textContent === 'm'")
    yield page
    page.close()
    ScriptedReplies.silence.set()
    server.shutdown()


@pytest.mark.parametrize("prompt", ["crlf", "silence"])
def test_crlf_events_are_read_and_a_silent_connection_is_resumed(scripted, prompt):
    """CRLF ends lines as LF does in SSE (the page waited for LF alone: "the stream ended without finishing"); a
    connection silent past its heartbeats (a lost network, which never closes it) left the page "generating…" for
    ever. A reply without usage says how it finished (the status said "generating…")."""
    ask(scripted, prompt, 8)
    scripted.wait_for_function("!document.querySelector('.assistant').classList.contains('streaming')")
    assert scripted.text_content(".assistant .answer") == "Hello", scripted.text_content("#status")
    assert scripted.text_content("#status") == "finish: stop"

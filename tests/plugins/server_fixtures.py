"""The servers' fixtures: the app in this process and the openai SDK on it, the app over a model that thinks, real
gunicorn servers shared per set of settings, a Redis for a module's servers, a headless browser, the tool-call texts
the app parsed; and, at the session's end, the folders of servers a test killed removed."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from wsgi_infer.server.gunicorn.owned_dirs import remove_abandoned_dirs

from ..conftest import tiny_settings
from ..support.chat_templates import THINKING_TEMPLATE
from ..support.in_process import InProcessServer
from ..support.prerequisites import CHROMIUM, CHROMIUM_ARGS, unavailable
from ..support.server import GunicornServer, RedisServer, stop_together


@pytest.fixture(scope="session")
def server():
    """The default model served in float32 (so it equals ``default_llm``), in this process: the API tests."""
    with InProcessServer({"dtype": "float32", "quantization": "none"}) as srv:
        yield srv


def openai_client(server: InProcessServer):
    """The openai SDK, talking to ``server`` in this process."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0, http_client=server.client())


@pytest.fixture(scope="session")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="session")
def packed_client():
    """The openai SDK and the default model as it serves by default, in this process (packed weights on the CPU
    kernels, several times float32's speed): for API tests that compare no offline engine's output."""
    with InProcessServer({}) as srv:
        yield openai_client(srv)


@pytest.fixture(scope="session")
def packed_model(packed_client) -> str:
    return packed_client.models.list().data[0].id


@pytest.fixture(scope="session")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def gunicorn_server():
    """Real servers, started once for every test that asks for the same settings and gunicorn arguments, and
    stopped at the end of the session. Tests that stop or signal a server start their own."""
    servers: dict[tuple, GunicornServer] = {}

    def serve(settings: dict, *args: str) -> GunicornServer:
        key = (tuple(sorted((name, str(value)) for name, value in settings.items())), args)
        if key not in servers or servers[key].process.poll() is not None:
            servers[key] = GunicornServer(settings, *args).wait_ready()
        return servers[key]

    yield serve
    stop_together(servers.values())


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Iterator[str]:
    """A real Redis for the servers of one module (several hosts sharing it), started and stopped with it."""
    with RedisServer(tmp_path_factory.mktemp("redis")) as redis_server:
        yield redis_server.url


@pytest.fixture(scope="module")
def browser():
    """A real headless Chromium (Debian's), driven by Playwright; per module: Playwright's sync API runs an asyncio
    loop in this thread while it lives, and other modules' clients (openai-agents' run_sync) need none running."""
    if not os.path.exists(CHROMIUM):
        unavailable("chromium is not installed")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="session")
def tiny_server(gunicorn_server, tiny_model_dirs) -> GunicornServer:
    return gunicorn_server(tiny_settings(tiny_model_dirs))


@pytest.fixture(scope="session")
def tiny_api(tiny_model_dirs):
    """The app over the tiny Llama (``tiny_settings``), in this process: the fast tier's API tests."""
    with InProcessServer(tiny_settings(tiny_model_dirs)) as server:
        yield server


@pytest.fixture
def parsed_texts(monkeypatch) -> list[str]:
    """The text of each reply the app parsed for tool calls (in this process), as the model wrote it."""
    from wsgi_infer.server.api.chat import formatters

    texts = []

    class Recording(formatters.ToolCallParser):
        def finish(self) -> dict:
            texts.append(self.text)
            return super().finish()

    monkeypatch.setattr(formatters, "ToolCallParser", Recording)
    return texts


def pytest_sessionfinish(session):
    """Nothing left in the temporary directory: the folders of servers a test killed outright (SIGKILL) are removed,
    as the next server to start there would remove them; those of servers still running are not."""
    remove_abandoned_dirs()


def thinking_server(tiny_model_dirs, path, template: str) -> InProcessServer:
    """The tiny Llama with a chat template that thinks, as Qwen3's does."""
    shutil.copytree(tiny_model_dirs["llama"], path)
    (path / "chat_template.jinja").write_text(template)
    return InProcessServer(tiny_settings(tiny_model_dirs, model=path))


@pytest.fixture(scope="module")
def thinking_api(tiny_model_dirs, tmp_path_factory):
    with thinking_server(tiny_model_dirs, tmp_path_factory.mktemp("thinking") / "tiny", THINKING_TEMPLATE) as server:
        yield server

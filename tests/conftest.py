"""The suite's root: the environment every test process and server inherits, the plugins that hold the shared
fixtures and hooks (``tests/plugins/``), and the helpers test modules import: tiny random-weight models of each
architecture and the settings most servers on them share, an idle engine's check, the property-based tests'
examples."""

from __future__ import annotations

import json
import os
from pathlib import Path

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
from wsgi_infer.engine.runtime.cache_files import cache_root  # noqa: E402

from .support import warm_starts  # noqa: E402

warm_starts.enable()  # servers of this process fork from a helper with torch imported, where they may

# The shared fixtures, by what they give, and the hooks that order and group the suite (only the root conftest
# may name plugins).
pytest_plugins = ["tests.plugins.model_fixtures", "tests.plugins.server_fixtures", "tests.plugins.scheduling"]

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

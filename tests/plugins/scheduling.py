"""The suite's tiers and order: tests on the real default model marked slow, the whole-machine modules first and
then the longest others, and under pytest-xdist each module one unit of work (the whole-machine ones one unit
together)."""

from __future__ import annotations

from pathlib import Path

import pytest

DEFAULT_MODEL_FIXTURES = {"default_llm", "packed_llm", "packed_client", "gguf_weights"}  # the real model


# Modules that load the whole machine (5,000 streams, the soak, a busy process per CPU, the real Gemma) or time
# their steps or a stream's gaps: under pytest-xdist they run one after another, in one process, never beside
# each other (a queue of 5,000 streams beside the soak once missed its 120 s for heartbeats; a stream's 1 s bound
# while another model loads, beside two-worker servers starting, saw 1.98 s: it is 3 s now).
WHOLE_MACHINE = {
    *("test_hostile_clients", "test_soak", "test_lifecycle", "test_cpu_share", "test_gemma3_270m"),
    *("test_front_end", "test_bridge", "test_many_models", "test_text_sides", "test_worker_replacement"),
}


# The other modules of 5 s and more (a full run, AMD EPYC Zen 4, 2026-12-06), longest first: under pytest-xdist
# they start before the short ones, so that the last units are short and neither process ends long before the
# other (test_key_limits_server, 73 s, once ran last, alone for 43 s of a 517 s run; the fast tier's test_layout,
# 10 s, last of one process, ended it 9 s after the other). Only the order depends on it.
LONGEST_FIRST = (
    *("test_key_limits_server", "test_kernel_variants", "test_cpu_kernels", "test_redis_outage", "test_text_files"),
    *("test_cli", "test_model_residency", "test_gguf_formats", "test_server_errors", "test_server_workers"),
    *("test_model_loader", "test_server_openai", "test_server_streams", "test_owned_dirs", "test_browser"),
    *("test_quantization", "test_several_hosts", "test_reference", "test_stream_failover", "test_bench_engine"),
    *("test_store_server", "test_resume", "test_server_promises", "test_layout", "test_batching"),
    *("test_server_structured", "test_sampling_properties", "test_nginx", "test_fuzz", "test_speculative"),
    *("test_prefix_store", "test_filters_and_temperature", "test_exact_batching", "test_interleavings"),
    "test_attention",  # test_cpu_kernels' attention tests, 12 s (Xeon, 2026-12-07)
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

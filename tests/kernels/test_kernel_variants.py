"""Which CPU kernels a process loads: the installed variant its CPU runs best, without a compiler or a writable
cache; else one build here, once, started by gunicorn's master. The source builds with GCC, clang and for aarch64
(see variants.py and build.py; what each library computes is checked in test_cpu_kernels)."""

from __future__ import annotations

import ctypes
import json
import logging
import shutil
import threading
from pathlib import Path

import pytest

from wsgi_infer import LLM
from wsgi_infer.engine.kernels import variants
from wsgi_infer.engine.kernels.build import (
    build_cpu_kernels,
    build_lock,
    installed_dir,
    kernels_library,
    library_path,
    start_building_cpu_kernels,
)
from wsgi_infer.engine.kernels.cpu import CpuKernels, load_cpu_kernels
from wsgi_infer.engine.runtime.cpu_info import cpu_flags

from ..support.batch_runs import GREEDY
from ..support.prerequisites import unavailable
from ..support.server import GunicornServer

INSTALLED_HERE = variants.runnable(variants.installed_variants(installed_dir()) or [], cpu_flags())

AVX2_CPU = {"sse4_2", "ssse3", "sse4_1", "popcnt", "cx16", "avx", "avx2", "fma", "f16c"}
AVX512_CPU = AVX2_CPU | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
EVERY_VARIANT = [v.name for v in variants.X86_VARIANTS]


@pytest.mark.parametrize(
    ("cpu", "best"),
    [
        (AVX512_CPU | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"}, "avx512-amx"),  # a Sapphire Rapids
        (AVX512_CPU | {"avx512_vnni", "avx512_bf16", "amx_tile"}, "avx512-vnni"),  # AMX without its int8 unit, a Zen 4
        (AVX512_CPU, "avx512"),  # a Skylake-X
        (AVX2_CPU | {"avx_vnni"}, "avx2-vnni"),  # an Alder Lake
        (AVX2_CPU, "avx2"),  # a Zen 3, or one whose hypervisor lists no BMI, LZCNT or MOVBE
        (AVX2_CPU - {"f16c"}, "x86-64-v2"),  # a partial flag set gets what it fully has
        ({"sse4_2", "ssse3", "sse4_1", "popcnt", "cx16"}, "x86-64-v2"),
    ],
)
def test_each_cpu_gets_the_best_variant_it_runs(cpu, best):
    assert variants.runnable(EVERY_VARIANT, cpu)[0].name == best


@pytest.mark.parametrize("variant", INSTALLED_HERE, ids=lambda v: v.name)
def test_only_the_amx_variant_takes_multiplies_of_48_rows_and_more_to_the_tiles(variant):
    """Where this CPU has AMX, its variant's passes of 16 rows go to the tiles (the OS lends them), from 3 passes on;
    so the tests that compare every build's bits (test_packed_mm) do compare the tiles' with the registers'."""
    kernels = CpuKernels(installed_dir() / variant.file_name())
    expected = [0, 0, 48, 48, 512] if variant.name == "avx512-amx" else [0] * 5
    assert [kernels.rows_on_tiles(rows) for rows in (16, 47, 48, 50, 512)] == expected


@pytest.mark.parametrize("variant", INSTALLED_HERE, ids=lambda v: v.name)
def test_a_decodes_weight_is_fetched_non_temporal_on_amd_cores_only(variant):
    """prefetchnta gained a Zen 4's one stream 3% and halved an Intel Xeon's (c/register_passes.h): each build picks
    the hint by the CPU it loads on."""
    vendor = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("vendor_id"))
    kernels = CpuKernels(installed_dir() / variant.file_name())
    assert kernels.one_row_non_temporal == vendor.endswith("AuthenticAMD")


def test_a_cpu_without_any_variant_gets_none():
    assert variants.runnable(EVERY_VARIANT, {"sse2"}) == []


@pytest.mark.slow  # a cross compiler builds the whole file: 5-6 s of the fast tier's 90
def test_the_portable_variant_builds_for_aarch64(tmp_path):
    compiler = shutil.which("aarch64-linux-gnu-gcc")
    if compiler is None:
        unavailable("no aarch64 cross compiler here (Debian's gcc-aarch64-linux-gnu)")
    assert variants.build_variants(tmp_path, compiler, machine="aarch64") == []
    assert json.loads((tmp_path / variants.STAMP).read_text())["variants"] == ["portable"]
    header = (tmp_path / variants.PORTABLE.file_name()).read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64


def test_a_variant_the_compiler_cannot_build_is_left_out_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(variants, "X86_VARIANTS", (variants.Variant("bogus", ("-mno-such-flag",), frozenset()),))
    (message,) = variants.build_variants(tmp_path, machine="x86_64")
    assert "bogus variant did not build" in message and "-mno-such-flag" in message
    assert json.loads((tmp_path / variants.STAMP).read_text())["variants"] == []


def test_builds_made_side_by_side_each_link_their_own_objects(tmp_path, monkeypatch):
    """Every source of every build compiles at once: each library holds its own build's objects, each compiled with
    its own flags, and a source that does not compile fails its build alone."""
    sources = tmp_path / "c"
    sources.mkdir()
    (sources / "a.c").write_text("int which(void) { return WHICH; }\n")
    (sources / "b.c").write_text("int twice(void) { return 2 * WHICH; }\n#if WHICH == 3\n#error three\n#endif\n")
    monkeypatch.setattr(variants, "SOURCES", sources)
    builds = [((f"-DWHICH={n}",), tmp_path / f"lib{n}.so") for n in (1, 2, 3)]
    failures = variants.compile_libraries(shutil.which("cc"), builds)
    assert failures[:2] == [None, None] and "three" in failures[2] and not (tmp_path / "lib3.so").exists()
    for n in (1, 2):
        library = ctypes.CDLL(str(tmp_path / f"lib{n}.so"))
        assert (library.which(), library.twice()) == (n, 2 * n)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "lib1.so", "lib2.so"]  # no objects left behind


def test_an_install_for_another_source_is_not_used(tmp_path):
    (tmp_path / variants.STAMP).write_text(json.dumps({"source": "stale", "variants": ["avx2"]}))
    assert variants.installed_variants(tmp_path) is None


@pytest.fixture
def not_installed(tmp_path, monkeypatch) -> Path:
    """A package installed without kernels (or a source tree changed since its install), an empty cache."""
    monkeypatch.setenv("WSGI_INFER_KERNELS_DIR", str(tmp_path / "no-kernels"))
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_the_installed_variant_loads_without_a_compiler_or_a_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    assert INSTALLED_HERE, "pip install built the variants (setup.py)"
    assert kernels_library() == installed_dir() / INSTALLED_HERE[0].file_name()
    assert kernels_library(build=True) == kernels_library() and not any(tmp_path.iterdir())  # nothing built


def test_without_kernels_installed_or_a_compiler_torch_ops_serve(tiny_model_dirs, not_installed, monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-compiler")
    assert build_cpu_kernels() is None
    assert not library_path().exists() and load_cpu_kernels() is None
    assert "no C compiler" in caplog.text
    kernels_library()  # a directory named that holds none is said (a mistyped one was a silent build)
    assert "WSGI_INFER_KERNELS_DIR " + str(not_installed / "no-kernels") + " holds no CPU kernels" in caplog.text
    llm = LLM(model=str(tiny_model_dirs["llama"]))
    assert llm.engine.runner.kernels is None and llm.engine.runner.model.layers[0].self_attn.kernels is None
    assert len(llm.generate("Hi", GREEDY)[0].token_ids) == GREEDY.max_tokens


def test_a_failed_build_is_not_tried_again(not_installed, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/bin/false")  # a compiler that fails
    assert build_cpu_kernels() is None and "not retried" in caplog.text
    monkeypatch.setattr(variants, "compile_library", lambda *args: pytest.fail("compiled again"))
    assert build_cpu_kernels() is None and kernels_library() is None
    start_building_cpu_kernels()  # the master's start neither


def test_a_cache_the_master_cannot_write_leaves_it_running(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("WSGI_INFER_KERNELS_DIR", str(tmp_path / "no-kernels"))
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path / "a-file" / "cache"))  # no directory can be made there
    start_building_cpu_kernels()
    assert "the CPU kernels cannot be built" in caplog.text


def test_a_worker_waits_for_the_build_the_master_started(not_installed, monkeypatch, caplog):
    """The master's child holds the build's lock while it compiles; a worker's engine thread waits on it."""
    target, found, waiting = library_path(), [], threading.Event()
    target.parent.mkdir(parents=True)
    seen = logging.Handler()
    seen.emit = lambda record: "waiting for the CPU kernels' build" in record.getMessage() and waiting.set()
    logging.getLogger("wsgi_infer").addHandler(seen)
    try:
        with build_lock(target), caplog.at_level(logging.INFO, logger="wsgi_infer"):
            waiter = threading.Thread(target=lambda: found.append(kernels_library()))
            waiter.start()
            assert waiting.wait(30)  # logged just before it blocks on the lock
            assert not found
            target.write_bytes(b"built")  # what the child leaves before it exits
        waiter.join(30)
    finally:
        logging.getLogger("wsgi_infer").removeHandler(seen)
    assert found == [target]


@pytest.mark.slow
def test_the_master_compiles_beside_the_workers_imports(tiny_model_dirs, not_installed):
    """Where no variant is installed for this source, gunicorn's master starts the compiler in a child process
    and goes on to fork; the worker loads what the child built (the real command: its worker imports torch while
    the child compiles)."""
    settings = {"model": str(tiny_model_dirs["llama"])}
    with GunicornServer(settings, warm=False) as server:
        (worker,) = server.wait_booted()
        server.wait_ready()
        (built,) = [line for line in server.lines if "built the CPU kernels" in line]
        assert f"[{server.process.pid}]" not in built and f"[{worker}]" not in built
        assert_serves_on_the_kernels(server)


@pytest.mark.slow
def test_a_server_without_a_compiler_runs_the_installed_kernels(tiny_model_dirs, tmp_path):
    settings = {"model": str(tiny_model_dirs["llama"])}
    no_compilers = {"CC": "/bin/false", "PATH": "/nonexistent", "WSGI_INFER_CACHE_DIR": str(tmp_path)}
    with GunicornServer(settings, **no_compilers) as server:
        server.wait_ready()
        server.wait_for_log(f"CPU kernels: the installed {INSTALLED_HERE[0].name} variant")
        assert not [line for line in server.lines if "built the CPU kernels" in line]
        assert_serves_on_the_kernels(server)
    assert not (tmp_path / "kernels").exists()


def assert_serves_on_the_kernels(server: GunicornServer) -> None:
    server.wait_for_log(r"quantization auto: \{'packed ")
    with server.client() as client:
        reply = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3

"""The CPU kernels' builds for every x86-64 CPU, as ggml builds its CPU variants.

``pip install`` compiles the C sources (``c/``) once per variant into ``lib/`` beside
this module (``setup.py`` runs ``build_variants``), and a process loads the
best variant its CPU can run (``build.kernels_library``): a package built on one
x86-64 machine runs at full speed on another, and start-up compiles nothing.
Imports only the standard library, so that ``setup.py`` can run it before the
package is installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import selectors
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCES = Path(__file__).with_name("c")  # the kernels' C sources and headers
INSTALLED = Path(__file__).with_name("lib")
STAMP = "variants.json"  # in INSTALLED: the source's hash and the variants built from it
# No contraction of a * b + c into one rounding, so the kernels round as the torch ops they replace; no errno or
# traps, which would keep loops with exp and selects from vectorizing (neither changes a result).
COMMON_FLAGS = (
    "-O3",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-Wno-psabi",
)
# x86-64-v2, then the vector extensions the kernels use named one by one rather than as x86-64-v3 and -v4: those
# also require BMI, LZCNT and MOVBE, which some hypervisors leave out of /proc/cpuinfo on CPUs that have AVX2, and
# a CPU would then get the SSE build for want of instructions the kernels never needed.
_V2 = frozenset({"sse4_2", "ssse3", "sse4_1", "popcnt", "cx16"})
_AVX2 = ("-march=x86-64-v2", "-mavx", "-mavx2", "-mfma", "-mf16c")
_V3 = _V2 | {"avx", "avx2", "fma", "f16c"}
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512cd")
_V4 = _V3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]  # the compiler's, after COMMON_FLAGS
    needs: frozenset[str]  # /proc/cpuinfo flags the code may use

    def runs_on(self, cpu: set[str]) -> bool:
        return self.needs <= cpu

    def file_name(self) -> str:
        return f"cpu_kernels-{self.name}.so"


# Best first: the kernels' own paths (AMX's int8 tiles beside AVX-512 VNNI, AVX-512 VNNI, AVX-VNNI, AVX-512, AVX2 +
# FMA, plain C). They have none for AVX-512 BF16 (activations are float32 or 8-bit integers; a build with
# -mavx512bf16 is the VNNI one byte for byte).
_VNNI512 = (*_AVX512, "-mavx512vnni")
X86_VARIANTS = (
    Variant("avx512-amx", (*_VNNI512, "-mamx-tile", "-mamx-int8"), _V4 | {"avx512_vnni", "amx_tile", "amx_int8"}),
    Variant("avx512-vnni", _VNNI512, _V4 | {"avx512_vnni"}),
    Variant("avx512", _AVX512, _V4),
    Variant("avx2-vnni", (*_AVX2, "-mavxvnni"), _V3 | {"avx_vnni"}),
    Variant("avx2", _AVX2, _V3),
    Variant("x86-64-v2", ("-march=x86-64-v2",), _V2),
)
PORTABLE = Variant("portable", (), frozenset())  # other architectures (aarch64...): the compiler's defaults


def variants_for(machine: str | None = None) -> tuple[Variant, ...]:
    """The variants a machine of this architecture may run, best first."""
    machine = machine or platform.machine()
    return X86_VARIANTS if machine in ("x86_64", "AMD64") else (PORTABLE,)


def source_files() -> list[Path]:
    return sorted([*SOURCES.glob("*.c"), *SOURCES.glob("*.h")])


def source_bytes() -> bytes:
    """Every source and header, named: what a build is made of."""
    return b"\0".join(path.name.encode() + b"\0" + path.read_bytes() for path in source_files())


def source_hash() -> str:
    return hashlib.sha256(source_bytes() + " ".join(COMMON_FLAGS).encode()).hexdigest()[:16]


def _is_clang(compiler: str) -> bool:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    return "clang" in version.stdout


def compile_library(compiler: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile the source into ``target`` (written whole or not at all); the compiler's complaint on failure."""
    return compile_libraries(compiler, [(flags, target)])[0]


def compile_libraries(compiler: str, builds: list[tuple[tuple[str, ...], Path]]) -> list[str | None]:
    """Each build's flags compiled into its target, as ``compile_library`` does. Every source of every build is
    compiled on its own, as many at once as this process may use CPUs, then each build's objects are linked: the
    same objects one invocation makes one after another (on 2 cores a variant 7.1 -> 4.9 s, packed_mm.c alone
    taking 4.1; six variants 55 -> 28 s). With clang, OpenMP is GCC's libgomp, the runtime torch's own threads use:
    two runtimes in one process would each keep a team of spinning threads."""
    common = [("-fopenmp=libgomp" if flag == "-fopenmp" and _is_clang(compiler) else flag) for flag in COMMON_FLAGS]
    # the largest sources first, every build's, so that the short ones fill the CPUs at the end
    sources = sorted((p for p in source_files() if p.suffix == ".c"), key=lambda p: p.stat().st_size, reverse=True)
    for _, target in builds:
        target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kernels-build.", dir=builds[0][1].parent) as objects:
        compiles = [
            [compiler, *common, *flags, "-c", str(source), "-o", f"{objects}/{i}-{source.stem}.o"]
            for source in sources
            for i, (flags, _) in enumerate(builds)
        ]
        compiled = _side_by_side(compiles)
        every = len(builds)  # build i's compiles are every one from i on
        return [
            _link(compiler, [*common, *flags], compiles[i::every], compiled[i::every], target)
            for i, (flags, target) in enumerate(builds)
        ]


def _link(
    compiler: str, flags: list[str], compiles: list[list[str]], compiled: list[tuple[int, str]], target: Path
) -> str | None:
    """The objects ``compiles`` made linked into ``target`` (None) where all compiled; else the first complaint."""
    staging = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    link = [compiler, *flags, "-o", str(staging), *sorted(command[-1] for command in compiles), "-lm"]  # by name
    code, output = next(((c, o) for c, o in compiled if c != 0), None) or _side_by_side([link])[0]
    if code != 0:
        staging.unlink(missing_ok=True)
        return output[-2000:] or f"{compiler} exited with {code}"
    os.replace(staging, target)
    return None


def _side_by_side(commands: list[list[str]]) -> list[tuple[int, str]]:
    """Each command's exit code and output, the commands run as processes, as many at once as this process may use
    CPUs (processes, not threads: in a server the engine client's bridge alone starts native threads)."""
    results: list[tuple[int, str]] = [(0, "")] * len(commands)
    waiting = list(enumerate(commands))[::-1]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with selectors.DefaultSelector() as running:
        while waiting or running.get_map():
            while waiting and len(running.get_map()) < cpus:
                index, command = waiting.pop()
                process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                running.register(process.stdout, selectors.EVENT_READ, (index, process, []))
            for key, _ in running.select():
                index, process, output = key.data
                chunk = key.fileobj.read1(1 << 16)
                if chunk:
                    output.append(chunk)
                    continue
                running.unregister(key.fileobj)
                key.fileobj.close()
                results[index] = (process.wait(), b"".join(output).decode(errors="replace"))
    return results


def build_variants(out_dir: Path = INSTALLED, compiler: str | None = None, machine: str | None = None) -> list[str]:
    """At install: every variant of this architecture that the compiler can build, into ``out_dir``, and the stamp
    that names them. Returns the messages worth printing (a missing compiler, a variant it could not build)."""
    compiler = shutil.which(compiler or os.environ.get("CC", "cc"))
    if compiler is None:
        return ["no C compiler (CC or cc): the CPU kernels are not installed; torch's ops serve instead"]
    chosen = variants_for(machine)
    failures = compile_libraries(compiler, [(v.flags, out_dir / v.file_name()) for v in chosen])
    built = [variant.name for variant, failure in zip(chosen, failures, strict=True) if failure is None]
    messages = [
        f"the CPU kernels' {variant.name} variant did not build: {failure.strip()[-300:]}"
        for variant, failure in zip(chosen, failures, strict=True)
        if failure is not None
    ]
    stamp = {"source": source_hash(), "compiler": compiler, "variants": built}
    (out_dir / STAMP).write_text(json.dumps(stamp, indent=1))
    return messages


def installed_variants(directory: Path = INSTALLED) -> list[str] | None:
    """The names of the variants installed in ``directory``; None where none were installed for this very source
    (a source tree whose kernels changed since its install builds its own, see ``build.py``)."""
    try:
        stamp = json.loads((directory / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return stamp["variants"] if stamp.get("source") == source_hash() else None


def runnable(names: list[str], cpu: set[str]) -> list[Variant]:
    """Those of the variants ``names`` that this CPU runs, best first."""
    return [v for v in variants_for() if v.name in names and v.runs_on(cpu)]

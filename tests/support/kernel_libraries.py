"""The CPU kernels' libraries a test multiplies with, and the packed weights it multiplies."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from wsgi_infer.engine.kernels import variants
from wsgi_infer.engine.kernels.build import build_cpu_kernels, installed_dir
from wsgi_infer.engine.kernels.weight_groups import Int4Groups, Int8Groups
from wsgi_infer.engine.runtime.cpu_info import cpu_flags

# Every library a CPU like this one may load: each installed variant it runs (x86-64-v2 is the path without
# AVX2), clang's build, and a build here where none is installed.
INSTALLED_HERE = variants.runnable(variants.installed_variants(installed_dir()) or [], cpu_flags())
LIBRARIES = [*(f"installed {v.name}" for v in INSTALLED_HERE), *([] if INSTALLED_HERE else ["built here"]), "clang"]
KINDS = ["int4", "int8", "int8 with lows"]
WITHOUT_VNNI = ("-mno-avx512vnni", "-mno-avxvnni")


def _clang_build(tmp_path_factory) -> Path:
    if shutil.which("clang") is None:
        pytest.skip("no clang here (CI installs Debian's)")
    target = tmp_path_factory.mktemp("clang") / "cpu_kernels-clang.so"
    assert variants.compile_library("clang", ("-march=native",), target) is None
    return target


def library(which: str, tmp_path_factory) -> Path:
    if which == "clang":
        return _clang_build(tmp_path_factory)
    if which.startswith("installed "):
        return installed_dir() / variants.Variant(which.removeprefix("installed "), (), frozenset()).file_name()
    path = build_cpu_kernels()
    assert path is not None, "the test machine has a C compiler"
    return path


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape) * scale


def groups_of_kind(kind: str, weight: torch.Tensor) -> Int4Groups | Int8Groups:
    """int4 (Q4_1's min/max), int8 (Q8_0's symmetric codes), or int8 with an offset per group (as Q5_1 and Q5_K
    have: codes 0..31 above each group's low)."""
    if kind == "int4":
        return Int4Groups.from_weight(weight)
    if kind == "int8":
        return Int8Groups.from_weight(weight)
    groups = Int4Groups.from_weight(weight)
    return Int8Groups((groups.q * 2).to(torch.int8), groups.scale / 2, groups.low)

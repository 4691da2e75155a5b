"""The kernels fixture: each library a CPU like this one may load."""

from __future__ import annotations

import pytest

from wsgi_infer.engine.kernels.cpu import CpuKernels

from ..support.kernel_libraries import LIBRARIES, library


def library_params(libraries: list) -> list:
    """clang's build is compiled by the test run (10 s of a core): its tests are the slow tier's"""
    return [pytest.param(which, marks=pytest.mark.slow) if which == "clang" else which for which in libraries]


@pytest.fixture(scope="module", params=library_params(LIBRARIES))
def kernels(request, tmp_path_factory) -> CpuKernels:
    return CpuKernels(library(request.param, tmp_path_factory))

"""The kernels fixture: each library a CPU like this one may load."""

from __future__ import annotations

import pytest

from wsgi_infer.engine.kernels.cpu import CpuKernels

from ..support.kernel_libraries import LIBRARIES, library


@pytest.fixture(scope="module", params=LIBRARIES)
def kernels(request, tmp_path_factory) -> CpuKernels:
    return CpuKernels(library(request.param, tmp_path_factory))

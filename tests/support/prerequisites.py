"""What a test needs of the machine (a program, a kernel feature): CI installs and allows all of it, so there a
missing one fails the test; elsewhere it is skipped."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: CI must run this test (.ci/run installs what the tests use)")
    pytest.skip(reason)

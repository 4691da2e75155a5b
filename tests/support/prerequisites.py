"""What a test needs of the machine (a program, a kernel feature): CI installs and allows all of it, so there a
missing one fails the test; elsewhere it is skipped. And the headless Chromium the chat page's tests drive
(Debian's), with its flags."""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: CI must run this test (.ci/run installs what the tests use)")
    pytest.skip(reason)

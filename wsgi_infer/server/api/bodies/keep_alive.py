"""Ollama's ``keep_alive``, which a request may give: how long its model stays loaded once idle."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator


def _seconds(value: object) -> object:
    """Ollama's ``keep_alive``: seconds as a number, or a duration ("10m", "1h30m", "45s"); below 0: for ever."""
    if isinstance(value, str):
        text = value.strip()
        if text == "0":  # Go's durations, as Ollama reads them: "0" alone needs no unit
            return 0.0
        if not re.fullmatch(r"-?(?:\d+(?:\.\d+)?(?:h|ms|m|s))+", text):
            raise ValueError('seconds as a number, or a duration such as "10m", "1h30m", "45s" or "500ms"')
        parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", text)
        seconds = sum(float(n) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[unit] for n, unit in parts)
        return -seconds if text.startswith("-") else seconds
    return value


def _forever_below_zero(seconds: float | None) -> float | None:
    return seconds if seconds is None or seconds >= 0 else -1.0


KeepAlive = Annotated[float | None, BeforeValidator(_seconds), AfterValidator(_forever_below_zero)]

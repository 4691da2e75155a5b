"""Whole numbers in a query string or header: an event id, a page's limit."""

from __future__ import annotations

MAX_DIGITS = 18  # below 2**63: any count this server keeps, and an id Redis takes


def whole_number(text: str) -> int | None:
    """``text`` as a whole number, or None: ASCII digits only ("²" is a digit to str.isdigit, not to int), and at
    most MAX_DIGITS of them (int() refuses thousands, and Redis stream ids end at 2**64)."""
    if text.isascii() and text.isdigit() and len(text) <= MAX_DIGITS:
        return int(text)
    return None

#!/usr/bin/env python
"""Save a screenshot of the chat page mid-stream (docs/chat-page.png, the README's picture), default model.

.venv/bin/python scripts/screenshot_chat.py [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.support.prerequisites import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from tests.support.server import GunicornServer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "chat-page.png")
    out = parser.parse_args().out
    with GunicornServer({}) as server, sync_playwright() as playwright:
        server.wait_ready()
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 900, "height": 560})
        page.goto(server.url + "/")
        page.wait_for_function("document.getElementById('model').textContent !== '…'")
        page.fill("#temperature", "0")
        page.fill("#prompt", "What is the capital of France?")
        page.click("#send")
        page.wait_for_function("!document.querySelector('.assistant').classList.contains('streaming')")
        page.fill("#prompt", "Write a short poem about the sea.")
        page.fill("#max_tokens", "200")
        page.click("#send")
        page.wait_for_function("document.querySelectorAll('.assistant')[1]?.textContent.length > 60")
        page.screenshot(path=str(out))
        browser.close()


if __name__ == "__main__":
    main()

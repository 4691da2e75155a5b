"""What copying streams to Redis costs a stream (``WSGI_INFER_REDIS_URL``: an event goes out once Redis holds
it): one server without Redis, then one with a local Redis, the same streams on each.

    .venv/bin/python scripts/bench_stream_copy.py [--model FILE] [--tokens 300] [--repeat 5]

Reports the medians of the time to the first token and of the mean time between tokens, one stream at a time,
greedy, EOS ignored, speculation off.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]
from tests.support.server import GunicornServer, RedisServer  # noqa: E402
from tests.support.sse_client import events  # noqa: E402


def one_stream(url: str, tokens: int) -> tuple[float, float]:
    body = {"prompt": "Tell me a story about a cat", "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
    started, arrivals = time.monotonic(), []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=600) as reply:
        arrivals = [time.monotonic() for e in events(reply) if e.data and e.data != "[DONE]"]
    return arrivals[0] - started, (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a GGUF or directory (default: the shipped SmolLM2)")
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with ExitStack() as stack:
        redis = stack.enter_context(RedisServer(Path(stack.enter_context(tempfile.TemporaryDirectory()))))
        settings = {"speculative": "none", **({"model": args.model} if args.model else {})}
        for label, extra in (("without Redis", {}), ("copied to Redis", {"redis_url": redis.url})):
            with GunicornServer({**settings, **extra}, "--access-logfile", "/dev/null") as server:
                server.wait_ready()
                one_stream(server.url, args.tokens)  # warm-up
                runs = [one_stream(server.url, args.tokens) for _ in range(args.repeat)]
            ttft, itl = (1000 * statistics.median(run[i] for run in runs) for i in (0, 1))
            print(f"{label}: first token {ttft:.1f} ms, between tokens {itl:.2f} ms (medians of {args.repeat})")


if __name__ == "__main__":
    main()

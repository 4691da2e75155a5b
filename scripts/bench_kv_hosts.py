"""The KV store across hosts (issue 65): a prompt read on one server, its first token on another that shares only
a Redis with it (``WSGI_INFER_KV_STORE_URL``), against that server's cold prefill.

    .venv/bin/python scripts/bench_kv_hosts.py --model /root/shaped/1b/shaped-1b-Q4_K_M.gguf --json kv_hosts.json

Two servers (one worker each, separate processes, no directory in common) and a redis-server, on this machine.
Per repeat, prompts new to the store (numbered first: no block shared): server A reads prompt P (A's cold TTFT);
once Redis holds its full blocks, server B is sent P (TTFT from the store), then prompt Q, new to both (B's cold
TTFT). Streamed completions of 2 tokens, EOS kept, speculation off; each figure the median over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
from bench_kv_store import prompt_ids, ttft  # noqa: E402

from tests.support.server import GunicornServer, RedisServer, wait_until  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a GGUF or directory (default: the shipped SmolLM2)")
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import redis as redis_py

    prompts = prompt_ids(2 * args.repeat, args.length)
    runs = []
    with ExitStack() as stack:
        redis = stack.enter_context(RedisServer(Path(stack.enter_context(tempfile.TemporaryDirectory()))))
        settings = {"kv_store_url": redis.url, "speculative": "none", **({"model": args.model} if args.model else {})}
        one, other = (stack.enter_context(GunicornServer(settings, "--access-logfile", "/dev/null")) for _ in "ab")
        one_http, other_http = (stack.enter_context(server.wait_ready().client(timeout=900)) for server in (one, other))
        blocks = redis_py.Redis.from_url(redis.url)
        for repeat in range(args.repeat):
            read, new = prompts[2 * repeat], prompts[2 * repeat + 1]
            before = len(blocks.keys("wsgi-infer:kv:*"))
            cold_a, _ = ttft(one_http, read)
            written = before + args.length // 16
            wait_until(lambda n=written: len(blocks.keys("wsgi-infer:kv:*")) >= n, "A's writes", 300)
            stored_b, cached = ttft(other_http, read)
            assert cached == (args.length - 1) // 16 * 16, cached
            cold_b, _ = ttft(other_http, new)
            runs.append({"cold_a": cold_a, "from_redis_b": stored_b, "cold_b": cold_b, "share": stored_b / cold_b})
            print(json.dumps(runs[-1]), flush=True)
        stored_mb = blocks.info("memory")["used_memory"] / 2**20
    report(runs, args, redis_used_mb=stored_mb)


def report(runs: list[dict], args: argparse.Namespace, **extra: float) -> None:
    """Each figure's median over the runs (and ``extra``), printed, and with the runs in ``--json``'s file."""
    summary = {name: statistics.median(run[name] for run in runs) for name in runs[0]} | extra
    print(json.dumps(summary))
    if args.json:
        record = {"args": {**vars(args), "json": str(args.json)}, "runs": runs, "median": summary}
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

"""What a host's death costs a stream (issue 65): three servers behind nginx (the several-host file), one Redis for
streams and, optionally, for the KV store; the host generating a stream is killed (SIGKILL to its master and
workers) in mid-generation.

    .venv/bin/python scripts/bench_failover.py --model FILE --prompt-tokens 2048 --json failover.json [--no-kv-store]

The client resumes the stream through nginx (``Last-Event-ID``, as EventSource does); the host it reaches serves
the events copied to Redis, and once the dead host's lease has lapsed continues the generation itself: the prompt
and the tokens so far computed again (the prompt from the KV store in Redis where it is there), the rest streamed.
Timed from the kill: the first token after those the client had, and the stream's end; the text is checked
against an uninterrupted run's. Streamed completions, greedy, EOS ignored, speculation off.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
from bench_kv_hosts import report  # noqa: E402
from bench_kv_store import prompt_ids  # noqa: E402

from tests.support.nginx_proxy import NginxProxy  # noqa: E402
from tests.support.server import GunicornServer, RedisServer  # noqa: E402
from tests.support.sse_client import events, text_of  # noqa: E402


def host_of(nginx: NginxProxy, hosts: list[GunicornServer], session: dict) -> int:
    """The host the conversation goes to (nginx's log of a short request)."""
    short = {"prompt": "hi", "max_tokens": 1}
    httpx.post(f"{nginx.url}/v1/completions", json=short, headers=nginx.tagged(session), timeout=600)
    (tried,) = nginx.upstreams(nginx.sent[-1:])
    address = tried[-1][0]
    return [f"127.0.0.1:{host.port}" for host in hosts].index(address)


def one_failover(nginx: NginxProxy, hosts: list[GunicornServer], ids: list[int], session: dict, args) -> dict:
    body = {"prompt": ids, "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    victim = hosts[host_of(nginx, hosts, session)]
    with httpx.Client(base_url=nginx.url, timeout=600) as http:
        with http.stream("POST", "/v1/completions", json=body, headers=session) as reply:
            stream_id, received = reply.headers["x-stream-id"], events(reply)
            tokens = (e for e in received if e.data)
            seen = [next(tokens) for _ in range(args.tokens_before_kill)]
            killed = time.monotonic()
            os.killpg(victim.process.pid, signal.SIGKILL)
        victim.process.wait(30)
        with http.stream("GET", f"/v1/streams/{stream_id}", headers={"Last-Event-ID": seen[-1].id}) as reply:
            rest = (e for e in events(reply) if e.data)
            seen.append(next(rest))
            first = time.monotonic() - killed
            seen += list(rest)
        ended = time.monotonic() - killed
        survivor = next(host for host in hosts if host is not victim)
        with http.stream("POST", f"{survivor.url}/v1/completions", json=body) as reply:
            whole = [e for e in events(reply) if e.data]
    assert text_of(seen) == text_of(whole), "the continued text differs from an uninterrupted run's"
    return {"continued_first_token_s": first, "continued_end_s": ended}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a GGUF or directory (default: the shipped SmolLM2)")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--tokens-before-kill", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--no-kv-store", action="store_true", help="no KV store: the continuation reads its prompt again"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    prompts = prompt_ids(args.repeat, args.prompt_tokens)
    runs = []
    with ExitStack() as stack:
        redis = stack.enter_context(RedisServer(Path(stack.enter_context(tempfile.TemporaryDirectory()))))
        settings = {"redis_url": redis.url, "speculative": "none", **({"model": args.model} if args.model else {})}
        settings |= {} if args.no_kv_store else {"kv_store_url": redis.url}
        for repeat in range(args.repeat):  # fresh hosts each time: one dies in each
            with ExitStack() as hosts_stack:
                quiet = ("--access-logfile", "/dev/null")
                hosts = [hosts_stack.enter_context(GunicornServer(settings, *quiet)) for _ in range(3)]
                for host in hosts:
                    host.wait_ready()
                nginx = hosts_stack.enter_context(NginxProxy.hosts([f"127.0.0.1:{h.port}" for h in hosts]))
                session = {"X-Session-Id": f"failover-{repeat}"}
                runs.append(one_failover(nginx, hosts, prompts[repeat], session, args))
                print(json.dumps(runs[-1]), flush=True)
    report(runs, args)


if __name__ == "__main__":
    main()

"""What the several-host routing keeps in cache (issue 65): three servers behind a real nginx, multi-turn chats.

    .venv/bin/python scripts/bench_routing.py --json routing.json [--model FILE] [--conversations 12 --turns 6]

Three servers of one model (separate processes, separate KV store roots: nothing shared), nginx in front with
``scripts/nginx/wsgi-infer-hosts.conf``, then the same file with round robin in place of its routing. Each
conversation (its own system prompt of about 500 tokens, then turns of a question and the model's greedy answer,
EOS kept) names itself by the OpenAI ``user`` field, and runs its turns one after another, a few conversations
at a time. Per routing: the share of the prompt tokens the hosts' prefix caches served (``prefix_cache_hits`` over
``prefix_cache_queries``, summed over the hosts), and the first token's time of the turns after the first
(median and p90). Speculation is off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
from repeat_prompts import SENTENCES  # noqa: E402

from tests.support.nginx_proxy import NginxProxy  # noqa: E402
from tests.support.server import GunicornServer  # noqa: E402

QUESTIONS = ("Summarise the last point.", "What follows from it?", "Give an example.", "Why does that matter?")


def system_prompt(conversation: int, sentences: int = 24) -> str:
    """About 500 tokens, each conversation's sentences in its own order (no two share a first block)."""
    own_order = (SENTENCES[(conversation + i) % len(SENTENCES)] for i in range(sentences))
    return f"Notes {conversation}. " + " ".join(own_order)


def converse(url: str, conversation: int, turns: int, answer_tokens: int) -> list[float]:
    """One conversation's turns, each with its history; the first token's time of each turn."""
    messages = [{"role": "system", "content": system_prompt(conversation)}]
    firsts = []
    with httpx.Client(base_url=url, timeout=600) as http:
        for turn in range(turns):
            messages.append({"role": "user", "content": f"{QUESTIONS[turn % len(QUESTIONS)]} (turn {turn})"})
            body = {
                "messages": messages,
                "max_tokens": answer_tokens,
                "temperature": 0,
                "stream": True,
                "user": f"conversation-{conversation}",
            }
            started, first, text = time.monotonic(), None, ""
            with http.stream("POST", "/v1/chat/completions", json=body) as reply:
                reply.raise_for_status()
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    first = first or time.monotonic()
                    text += delta
            firsts.append(first - started)
            messages.append({"role": "assistant", "content": text})
    return firsts


def cache_counts(hosts: list[GunicornServer]) -> tuple[float, float]:
    metrics = [host.metrics() for host in hosts]
    return (
        sum(m["wsgi_infer:prefix_cache_hits_total"] for m in metrics),
        sum(m["wsgi_infer:prefix_cache_queries_total"] for m in metrics),
    )


def run(hosts: list[GunicornServer], round_robin: bool, args: argparse.Namespace, first: int) -> dict:
    addresses = [f"127.0.0.1:{host.port}" for host in hosts]
    with NginxProxy.hosts(addresses, round_robin=round_robin) as nginx:
        hits, queries = cache_counts(hosts)
        started = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            conversations = range(first, first + args.conversations)
            firsts = list(pool.map(lambda c: converse(nginx.url, c, args.turns, args.answer_tokens), conversations))
        elapsed = time.monotonic() - started
        hits_after, queries_after = cache_counts(hosts)
    later = sorted(t for turns in firsts for t in turns[1:])
    return {
        "routing": "round robin" if round_robin else "wsgi-infer-hosts.conf",
        "cached_share": (hits_after - hits) / (queries_after - queries),
        "prompt_tokens": queries_after - queries,
        "later_turns_ttft_median_s": statistics.median(later),
        "later_turns_ttft_p90_s": later[int(0.9 * (len(later) - 1))],
        "seconds": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a GGUF or directory (default: the shipped SmolLM2)")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=3, help="conversations at a time")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    settings = {"speculative": "none", **({"model": args.model} if args.model else {})}
    with ExitStack() as stack:
        hosts = [stack.enter_context(GunicornServer(settings, "--access-logfile", "/dev/null")) for _ in range(3)]
        for host in hosts:
            host.wait_ready()
        # New conversations for each routing: none finds another's prefix in a cache.
        results = [run(hosts, round_robin, args, i * args.conversations) for i, round_robin in enumerate((True, False))]
    for result in results:
        print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=1))


if __name__ == "__main__":
    main()

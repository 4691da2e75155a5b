#!/usr/bin/env python
"""One stream in-process, request by request: greedy decodes of 128 tokens (speculation off), each request's tok/s,
and how much of the process's anonymous memory is in huge pages. Run it several times to see whether a spread is the
process's (its memory) or the machine's (the same process, request to request):

    for i in 1 2 3 4 5; do .venv/bin/python scripts/bench_one_stream.py --model shaped/1b/shaped-1b-Q4_K_M.gguf; done
"""

from __future__ import annotations

import argparse
import re
import time

from wsgi_infer import LLM
from wsgi_infer.engine.sampling_params import SamplingParams

TOPICS = ("rivers", "mountains", "volcanoes", "glaciers")  # the first warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    llm = LLM(model=args.model, speculative="none")
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rates = []
    for topic in TOPICS:
        start = time.perf_counter()
        out = llm.generate(f"Write a detailed, friendly explanation for a curious student about {topic}.", params)
        rates.append(len(out[0].token_ids) / (time.perf_counter() - start))
    memory = open("/proc/self/smaps_rollup").read()
    anon, huge = (int(re.search(rf"{key}:\s+(\d+)", memory).group(1)) >> 10 for key in ("Anonymous", "AnonHugePages"))
    print(" ".join(f"{rate:.1f}" for rate in rates[1:]), f"tok/s; anonymous {anon} MB, {huge} MB in huge pages")


if __name__ == "__main__":
    main()

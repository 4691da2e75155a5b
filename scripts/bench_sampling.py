"""What each sampling filter costs a batch: ``--streams`` sampled requests of ``--output-len`` tokens decoded together
in process (the engine alone, no server), greedy, plain sampling at two temperatures and each filter a chat client
sends (top_p, top_k, min_p, and llama-server's defaults: all three; the penalties), the settings alternating for
``--rounds`` rounds; speculation off unless ``--speculative ngram``.

    .venv/bin/python scripts/bench_sampling.py --streams 16 --rounds 2

Prints each setting's output tok/s per round and its best.
"""

from __future__ import annotations

import argparse
import time

from wsgi_infer import LLM, SamplingParams

SETTINGS = {
    "greedy": {"temperature": 0},
    "temperature 0.7": {"temperature": 0.7},
    "temperature 0.2": {"temperature": 0.2},
    "top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "top_k 40": {"temperature": 0.7, "top_k": 40},
    "min_p 0.05": {"temperature": 0.7, "min_p": 0.05},
    "top_k 40, top_p 0.95": {"temperature": 0.7, "top_k": 40, "top_p": 0.95},
    "llama-server's defaults": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
    "repetition_penalty 1.1": {"temperature": 0.7, "repetition_penalty": 1.1},
    "presence 0.5, frequency 0.3": {"temperature": 0.7, "presence_penalty": 0.5, "frequency_penalty": 0.3},
}
ANIMALS = "cat dog fox owl bee ant elk yak emu eel cod ram hen bat rat koi gnu ape cow pig".split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--speculative", default="none", choices=["none", "ngram"])
    args = parser.parse_args()
    llm = LLM(model=args.model, speculative=args.speculative)
    prompts = [
        f"Write a short story about a {ANIMALS[i % len(ANIMALS)]} who learns to code." for i in range(args.streams)
    ]
    rates: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, fields in SETTINGS.items():
            params = SamplingParams(**fields, seed=1, max_tokens=args.output_len, ignore_eos=True)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            rates[name].append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start))
    for name, values in rates.items():
        print(f"{name:24s} {' '.join(f'{v:7.1f}' for v in values)}  best {max(values):7.1f} tok/s")


if __name__ == "__main__":
    main()

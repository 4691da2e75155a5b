#!/usr/bin/env python
"""Top-1 agreement of packed small-batch weights with the bf16 reference, teacher-forced.

The bf16 engine (``quantization="none"``) writes greedy continuations of chat
prompts (``--tokens`` in all). Each quantized engine then reads the same
sequences with ``prompt_logprobs=1``, every linear layer forced onto its packed
weights (as one decode step uses them), and we count the generated positions
where its top-1 token is the reference's. Example:

    .venv/bin/python scripts/int4_agreement.py --tokens 1000 --methods auto int4 int8
"""

from __future__ import annotations

import argparse
import json

from wsgi_infer import LLM, SamplingParams
from wsgi_infer.engine.cpu_info import cpu_model_name
from wsgi_infer.engine.layers.quantization import SmallBatchLinear

TOPICS = ["rain", "volcanoes", "photosynthesis", "black holes", "the printing press", "tides", "vaccines", "bridges"]


def reference(model: str | None, tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy bf16 continuation) pairs, ``tokens`` continuation tokens in all."""
    llm = LLM(model=model, dtype="bfloat16", quantization="none")
    prompts = [
        llm.apply_chat_template([{"role": "user", "content": f"Write a detailed, friendly explanation about {t}."}])
        for t in TOPICS
    ]
    per_prompt = -(-tokens // len(prompts))
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=per_prompt, ignore_eos=True))
    return [(list(p), list(o.token_ids)) for p, o in zip(prompts, outputs)]


def agreement(model: str | None, method: str, pairs: list[tuple[list[int], list[int]]]) -> dict:
    llm = LLM(model=model, dtype="bfloat16", quantization=method)
    packed = [m for m in llm.engine.runner.model.modules() if isinstance(m, SmallBatchLinear)]
    for module in packed:
        module.max_rows = 1 << 30  # as in a decode step, whatever the rows
    agree = total = 0
    for prompt, continuation in pairs:
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
        out = llm.generate([prompt + continuation], params)[0]
        # prompt_logprobs[i] scores token i + 1 of the sequence: those of the continuation count.
        scored = out.prompt_logprobs[len(prompt) - 1 :]
        for reference_token, position in zip(continuation, scored):
            agree += position.top[0][0] == reference_token
            total += 1
    return {"method": method, "packed_layers": len(packed), "tokens": total, "top1_agreement": agree / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--methods", nargs="+", default=["auto", "int4", "int8"])
    args = parser.parse_args()
    pairs = reference(args.model, args.tokens)
    results = [agreement(args.model, method, pairs) for method in args.methods]
    print(json.dumps({"cpu": cpu_model_name(), "results": results}, indent=2))
    for r in results:
        print(
            f"{r['method']:>5}: {r['packed_layers']} packed layers, top-1 agreement {r['top1_agreement']:.2%} "
            f"over {r['tokens']} tokens"
        )


if __name__ == "__main__":
    main()

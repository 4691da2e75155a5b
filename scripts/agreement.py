#!/usr/bin/env python
"""Top-1 agreement of the default engine with the same weights' float32 reference, teacher-forced, per model file.

For each model (a GGUF of any type, or a Hugging Face directory), the float32 engine without packed weights
(``quantization="none"``: exactly transformers' output on the file's dequantized weights) writes greedy
continuations of chat prompts (``--tokens`` in all). The engine as it serves by default (``dtype`` and
``quantization`` auto: float32 activations on the CPU kernels over the file's own blocks, KV cache in bf16) then
reads the same sequences with ``prompt_logprobs=1``, every packed layer forced onto its packed weights (as one
decode step uses them), and we count the generated positions where its top-1 token is the reference's. Example:

    .venv/bin/python scripts/agreement.py --tokens 1000 smol-q8_0.gguf smol-q4_k_m.gguf hf-directory/
"""

from __future__ import annotations

import argparse
import json

from wsgi_infer import LLM, SamplingParams
from wsgi_infer.engine.layers.quantization import SmallBatchLinear, kinds
from wsgi_infer.engine.runtime.cpu_info import cpu_model_name

TOPICS = ["rain", "volcanoes", "photosynthesis", "black holes", "the printing press", "tides", "vaccines", "bridges"]


def reference(model: str | None, tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy float32 continuation) pairs, ``tokens`` continuation tokens in all."""
    llm = LLM(model=model, dtype="float32", quantization="none")
    prompts = [
        llm.apply_chat_template([{"role": "user", "content": f"Write a detailed, friendly explanation about {t}."}])
        for t in TOPICS
    ]
    per_prompt = -(-tokens // len(prompts))
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=per_prompt, ignore_eos=True))
    return [(list(p), list(o.token_ids)) for p, o in zip(prompts, outputs)]


def agreement(model: str | None, pairs: list[tuple[list[int], list[int]]], quantization: str, activations: str) -> dict:
    llm = LLM(model=model, quantization=quantization, activations=activations)
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
    return {
        "model": model or "default",
        "quantization": quantization,
        "activations": activations,
        "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "packed_layers": kinds(packed),
        "tokens": total,
        "top1_agreement": agree / total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=[None], help="default: the shipped model")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--quantization", default="auto", help="what the engine under test packs (default auto)")
    parser.add_argument("--activations", nargs="+", default=["int16"], help="each measured against one reference")
    args = parser.parse_args()
    results = []
    for model in args.models:
        pairs = reference(model, args.tokens)
        results += [agreement(model, pairs, args.quantization, activations) for activations in args.activations]
    print(json.dumps({"cpu": cpu_model_name(), "results": results}, indent=2))
    for r in results:
        print(
            f"{r['model']}: {r['dtype']}, {r['activations']} activations, top-1 agreement {r['top1_agreement']:.2%} "
            f"over {r['tokens']} tokens"
        )


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Top-1 agreement of the engine with the same weights' float32 reference, teacher-forced, per model file.

For each model (a GGUF of any type, or a Hugging Face directory), the float32 engine without packed weights
(``quantization="none"``: exactly transformers' output on the file's dequantized weights) writes greedy
continuations of chat prompts (``--tokens`` in all). The engine as it serves (``dtype`` and ``quantization`` auto:
the CPU kernels over the file's own blocks, KV cache in bf16), with each of ``--activations`` (int8: 8-bit
activations; int16: the exact path), then reads the same sequences with ``prompt_logprobs=1``, and we count the
generated positions where its top-1 token is the reference's. ``--llama-server BINARY`` measures llama.cpp's own
server on the same GGUF the same way: for each position, the sequence up to it as token ids to ``/completion``
(its prompt cache keeps the prefix), one greedy token back. Example:

    .venv/bin/python scripts/agreement.py --tokens 4000 --activations int8 int16 --llama-server LLAMA_SERVER \
        smol-q8_0.gguf smol-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from wsgi_infer import LLM, SamplingParams
from wsgi_infer.engine.layers.quantization import kinds
from wsgi_infer.engine.runtime.cpu_info import cpu_model_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_processes import free_port, healthy  # noqa: E402

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
        "packed_layers": kinds(llm.engine.runner.model),
        "tokens": total,
        "top1_agreement": agree / total,
    }


def llama_agreement(binary: str, model: str, pairs: list[tuple[list[int], list[int]]]) -> dict:
    """llama-server's top-1 at each generated position, given the reference's tokens before it."""
    port = free_port()
    command = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    command += ["-t", str(os.cpu_count()), "-np", "1", "-c", "8192"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    agree = total = 0
    try:
        url = healthy(process, f"http://127.0.0.1:{port}", command)
        with httpx.Client(base_url=url, timeout=120) as client:
            for prompt, continuation in pairs:
                for i, reference_token in enumerate(continuation):
                    body = {"prompt": prompt + continuation[:i], "n_predict": 1, "temperature": 0}
                    reply = client.post("/completion", json=body | {"cache_prompt": True, "return_tokens": True})
                    agree += reply.json()["tokens"][0] == reference_token
                    total += 1
    finally:
        process.terminate()
        process.wait(60)
    return {"model": model, "system": "llama-server", "tokens": total, "top1_agreement": agree / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=[None], help="default: the shipped model")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--quantization", default="auto", help="what the engine under test packs (default auto)")
    parser.add_argument("--activations", nargs="+", default=["int8"], help="each measured against one reference")
    parser.add_argument("--llama-server", metavar="BINARY", help="measure llama.cpp's server on each GGUF too")
    args = parser.parse_args()
    results = []
    for model in args.models:
        pairs = reference(model, args.tokens)
        results += [agreement(model, pairs, args.quantization, activations) for activations in args.activations]
        if args.llama_server and model and model.endswith(".gguf"):
            results.append(llama_agreement(args.llama_server, model, pairs))
    print(json.dumps({"cpu": cpu_model_name(), "results": results}, indent=2))
    for r in results:
        who = r.get("system") or f"wsgi-infer, {r['dtype']}, {r['activations']} activations"
        print(f"{r['model']}: {who}, top-1 agreement {r['top1_agreement']:.2%} over {r['tokens']} tokens")


if __name__ == "__main__":
    main()

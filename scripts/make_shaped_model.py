#!/usr/bin/env python
"""Make a model of a real model's shape, with random weights, as GGUF files: for speed work at sizes no test can
ship (never for quality: its text is noise).

    .venv/bin/python scripts/make_shaped_model.py --shape 1b --llama-cpp llsrc/.../vendor/llama.cpp \\
        --out /tmp/shaped --types Q4_K_M Q4_0 Q8_0

It builds transformers' Llama model of the shape under bf16 (``AutoModelForCausalLM.from_config``), saves it with
the shipped default model's tokenizer (SmolLM2's 49,152 tokens), converts it with llama.cpp's own converter to a BF16
GGUF (``convert_hf_to_gguf.py``; it needs ``pip install sentencepiece``), then makes each type with
``llama-quantize``. ``--llama-cpp`` is the llama.cpp tree with ``build/bin/llama-quantize`` built in it (see
shared/notes/baselines.md: the tree the llama-cpp-python sdist vendors). Nothing it makes belongs in the repository.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

# name: (hidden, intermediate, layers, heads, kv heads, vocab, tied): Llama 3.2's and Qwen's shapes, Llama's blocks
# (a head's size is hidden / heads)
SHAPES = {
    "0.5b": (896, 4864, 24, 14, 2, 49152, True),  # Qwen2.5 0.5B's shape (head_dim 64)
    "1b": (2048, 8192, 16, 32, 8, 49152, True),  # Llama 3.2 1B's shape with SmolLM2's vocabulary: 1.07B
    "1b-vocab128k": (2048, 8192, 16, 32, 8, 128256, True),  # Llama 3.2 1B's own vocabulary and LM head: 1.24B
    "1.7b": (2048, 8192, 24, 32, 8, 49152, True),  # SmolLM2 1.7B's shape (head_dim 64)
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, 151936, True),  # Qwen3-1.7B's shape: head_dim 128, 151,936 tokens
    "3b": (3072, 8192, 28, 24, 8, 128256, True),  # Llama 3.2 3B's shape (head_dim 128)
}


def vocabulary_of(gguf: Path, size: int):
    """The tokenizer of a GGUF file (a model's, or a vocabulary-only one), as transformers reads it, without the
    ``<|endoftext|>`` its GPT-2 builder adds past the file's tokens where the shape has no row for it."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from wsgi_infer.engine.loading.gguf_tokenizer import read_gguf_tokenizer, tokenizer_json

    tokenizer, merges = read_gguf_tokenizer(gguf)
    tokenizer._tokenizer = Tokenizer.from_str(tokenizer_json(tokenizer.backend_tokenizer, merges))  # with merges
    if len(tokenizer) <= size:
        return tokenizer
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < size]
    backend = Tokenizer.from_str(json.dumps(spec))
    special = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


def build(shape: str, directory: Path, vocabulary: Path | None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from wsgi_infer.engine.loading.model_paths import default_model_path

    hidden, intermediate, layers, heads, kv_heads, vocab, tied = SHAPES[shape]
    tokenizer = vocabulary_of(vocabulary or default_model_path(), vocab)
    if vocab > len(tokenizer):  # a larger vocabulary than the file's: its LM head's size is what matters here
        tokenizer.add_tokens([f"<extra_{i}>" for i in range(vocab - len(tokenizer))])
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rope_theta=500000.0,
        tie_word_embeddings=tied,
        max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    print(f"{shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters in {directory}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="1b")
    parser.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp tree with llama-quantize built")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--types", nargs="+", default=["Q4_K_M", "Q4_0"])
    parser.add_argument(
        "--vocabulary",
        type=Path,
        help="a GGUF whose tokenizer the model takes (default: the shipped model's, padded with added tokens to the "
        "shape's size): llama.cpp's models/ggml-vocab-llama-bpe.gguf is Llama 3's 128,256 tokens, the 3B's own",
    )
    args = parser.parse_args()
    hf_dir, bf16 = args.out / f"{args.shape}-hf", args.out / f"{args.shape}-bf16.gguf"
    if not (hf_dir / "config.json").is_file():
        build(args.shape, hf_dir, args.vocabulary)
    if not bf16.is_file():
        converter = args.llama_cpp / "convert_hf_to_gguf.py"
        env = os.environ | {"PYTHONPATH": str(args.llama_cpp / "gguf-py")}
        subprocess.run([sys.executable, converter, hf_dir, "--outtype", "bf16", "--outfile", bf16], check=True, env=env)
    for kind in args.types:
        # not "1b-q4_0.gguf": llama-quantize reads an output name that starts with a number as a type's number
        out = args.out / f"shaped-{args.shape}-{kind}.gguf"
        if not out.is_file():
            threads = str(os.cpu_count())
            subprocess.run([args.llama_cpp / "build/bin/llama-quantize", bf16, out, kind, threads], check=True)
        print(f"{out}: {out.stat().st_size / 2**20:,.0f} MiB", flush=True)


if __name__ == "__main__":
    main()

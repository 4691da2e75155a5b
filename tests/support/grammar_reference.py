"""llguidance's Python binding as the reference for our matchers, which call its C interface; and whether one of
our matchers takes a text whole."""

from __future__ import annotations

import random

import llguidance
import torch

from wsgi_infer.engine.kernels.cpu import CpuKernels
from wsgi_infer.engine.sampling.grammar import GrammarCompiler, apply_grammar_masks, grammar_text
from wsgi_infer.engine.sampling_params import StructuredOutput


def accepts(grammars: GrammarCompiler, tokenizer, spec: StructuredOutput, text: str) -> bool:
    """Whether a fresh matcher for ``spec`` takes every token of ``text`` (as ``tokenizer`` encodes it) and may end
    there."""
    matcher = grammars.matcher(spec)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(token) for token in tokens) and matcher.is_accepting()


def assert_masks_as_the_python_binding(
    grammars: GrammarCompiler,
    tokenizer,
    specs: list[StructuredOutput],
    steps: int = 24,
    kernels: CpuKernels | None = None,
) -> None:
    """At each of ``steps`` tokens, drawn at random from what both allow, our mask (unpacked for a batch row, beside
    an unconstrained row, by ``kernels`` where given, else by torch) equals the Python binding's for the same
    tokenizer, and both stop together."""
    reference = llguidance.LLTokenizer(
        tokenizer.backend_tokenizer.to_str(), n_vocab=grammars.vocab_size, eos_token=tokenizer.eos_token_id
    )
    vocab, draw = grammars.vocab_size, random.Random(0)
    for spec in specs:
        ours, theirs = grammars.matcher(spec), llguidance.LLMatcher(reference, grammar_text(spec))
        for step in range(steps):
            logits = torch.zeros(2, vocab)
            apply_grammar_masks(logits, [1], [ours], kernels)
            allowed = torch.frombuffer(bytearray(theirs.compute_logit_bias()), dtype=torch.uint8)[:vocab] > 0
            assert torch.equal(logits[1] == 0, allowed), (spec.kind, step)
            assert torch.equal(logits[0], torch.zeros(vocab)), "an unconstrained row is untouched"
            assert ours.is_stopped() == theirs.is_stopped(), (spec.kind, step)
            if theirs.is_stopped():
                break
            token = draw.choice(allowed.nonzero().flatten().tolist())
            assert ours.consume_token(token) and theirs.consume_token(token), (spec.kind, step, token)

"""The long-prompt workload of the prefill benchmark: prompts of about 2,048 tokens, or ``tokens`` (the default
model's tokenizer, which the shaped models share), each new to the server: every call numbers its prompts on from
the last, and the number comes first, so no prompt shares a cached block (or llama-server's slot prefix) with
another."""

from __future__ import annotations

import itertools

from repeat_prompts import SENTENCES

PROMPT_TOKENS = 2048
_serial = itertools.count()


def long_prompts(n: int, tokens: int = PROMPT_TOKENS) -> list[str]:
    from wsgi_infer.engine.loading.model_loader import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(None))
    sentence_tokens = [len(tokenizer(" " + s, add_special_tokens=False).input_ids) for s in SENTENCES]
    texts = []
    for _ in range(n):
        serial = next(_serial)
        text, used = f"Report {serial}.", 4
        for i in itertools.count(serial):  # each prompt's sentences in its own order
            if used + sentence_tokens[i % len(SENTENCES)] > tokens:
                break
            text += " " + SENTENCES[i % len(SENTENCES)]
            used += sentence_tokens[i % len(SENTENCES)]
        texts.append(text)
    return texts

"""vLLM's ``truncate_prompt_tokens``: a prompt longer than that keeps its last tokens (vLLM truncates on the left).

A text prompt keeps the special tokens its tokenizer adds (a beginning of sequence, an embedding model's [CLS] and
[SEP]) and the last tokens of its text, as transformers' left truncation keeps them; token ids and a rendered
conversation (whose template writes those tokens as text) keep their last tokens.
"""

from __future__ import annotations

from ..sampling_params import InvalidParameter


def keep_last(ids: list[int], keep: int | None) -> list[int]:
    return ids if keep is None else ids[-keep:]


def prompt_tokens(tokenizer, prompt: str | list[int], keep: int | None) -> list[int]:
    """A text's token ids with the tokenizer's special tokens, or token ids as given, within ``keep`` tokens."""
    if not isinstance(prompt, str):
        return keep_last(list(prompt), keep)
    whole = tokenizer.encode(prompt, add_special_tokens=True)
    if keep is None or len(whole) <= keep:
        return whole
    # the text's own tokens, and where the ones the tokenizer adds stand (not the backend's truncation: a
    # tokenizer.json may carry its own, and padding, which transformers' calls set aside)
    text = tokenizer.encode(prompt, add_special_tokens=False)
    added = len(whole) - len(text)
    if keep <= added:  # no room for any text beside them: [SEP] alone was kept, and read as the text's embedding
        raise InvalidParameter(
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens must leave room for text beside the {added} special tokens the model's tokenizer "
            f"adds: at least {added + 1}, got {keep}",
        )
    lead, specials = 0, set(tokenizer.all_special_ids)
    while lead < added and whole[lead] in specials:
        lead += 1
    return whole[:lead] + text[len(text) - (keep - added) :] + whole[lead + len(text) :]

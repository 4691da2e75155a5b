"""vLLM's allowed_token_ids and bad_words: only the allowed tokens are sampled, each the model's most likely among
them; a bad word is never completed, its first tokens free; a request beside them in the batch is unchanged; a
request left no token to sample is refused, or (bad words that bar every allowed token) takes the allowed ones."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from wsgi_infer import LLM, SamplingParams
from wsgi_infer.engine.sampling.sampler import Sampler
from wsgi_infer.engine.sampling.token_bans import token_bans
from wsgi_infer.engine.sampling_params import InvalidParameter, StructuredOutput
from wsgi_infer.engine.scheduling.sequence import Sequence

from ..conftest import assert_idle
from ..support.transformers_reference import load_hf_model

PROMPT = "Once upon a time, in a land far away, there lived a"


def test_only_allowed_tokens_each_the_most_likely_of_them(tiny_llama, tiny_model_dirs):
    vocab = tiny_llama.engine.hf_config.vocab_size
    free = tiny_llama.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    allowed = random.Random(0).sample(sorted(set(range(vocab)) - set(free.token_ids)), 40)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)
    out = tiny_llama.generate(PROMPT, params)[0]
    assert set(out.token_ids) <= set(allowed)
    prompt = tiny_llama.engine.tokenize(PROMPT)
    with torch.no_grad():
        logits = load_hf_model(tiny_model_dirs["llama"])(torch.tensor([prompt + out.token_ids])).logits[0]
    ranked = logits[len(prompt) - 1 : -1, allowed].argmax(-1)  # each step's most likely allowed token
    assert out.token_ids == [allowed[i] for i in ranked.tolist()]
    sampled = tiny_llama.generate(PROMPT, SamplingParams(**{**vars(params), "temperature": 1.0, "seed": 3}))[0]
    assert set(sampled.token_ids) <= set(allowed)
    assert_idle(tiny_llama)


def _word_in(packed_llm, text: str) -> tuple[str, list[int]]:
    """A word of the text whose spelling there is several tokens, with those tokens."""
    tokenizer = packed_llm.engine.tokenizer
    for word in text.split()[2:]:
        ids = tokenizer.encode(" " + word, add_special_tokens=False)
        if len(ids) > 1:
            return word, ids
    pytest.fail(f"no word of several tokens in {text!r}")


PASSAGE = "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. All that glitters is not gold. "
REPEAT = [{"role": "user", "content": PASSAGE * 2 + "\nRepeat the passage above, once."}]


def test_a_bad_word_is_never_completed_and_the_batch_beside_it_unchanged(packed_llm):
    """On a reply that copies its prompt, which speculation drafts: a request with bad words drafts none (a draft's
    tokens are the model's own argmax, which bars nothing)."""
    prompt = packed_llm.apply_chat_template(REPEAT)
    drafts = packed_llm.engine.spec.drafts
    free = packed_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0]
    assert packed_llm.engine.spec.drafts > drafts  # the case: the copy is drafted
    word, ids = _word_in(packed_llm, free.text)
    last = next(i for i in range(len(free.token_ids)) if free.token_ids[i - len(ids) + 1 : i + 1] == ids)
    barred = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, bad_words=[word])
    beside = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out, other = packed_llm.generate([prompt, PROMPT], [barred, beside])
    # the same tokens up to the word's last, which is barred there; its first tokens were free to come
    assert out.token_ids[:last] == free.token_ids[:last] and out.token_ids[last] != free.token_ids[last]
    spelled = [ids, packed_llm.engine.tokenizer.encode(word, add_special_tokens=False)]
    for n in range(len(out.token_ids)):
        assert not any(out.token_ids[n : n + len(s)] == s for s in spelled), out.text
    assert other.token_ids == packed_llm.generate(PROMPT, beside)[0].token_ids
    assert out.token_ids == LLM(model=None, speculative="none").generate(prompt, barred)[0].token_ids
    assert_idle(packed_llm)


def test_a_one_token_bad_word_never_comes(tiny_llama):
    free = tiny_llama.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    tokenizer = tiny_llama.engine.tokenizer
    word = next(tokenizer.decode([t]) for t in free.token_ids[2:] if len(tokenizer.encode(tokenizer.decode([t]))) == 1)
    (banned,) = tokenizer.encode(word, add_special_tokens=False)
    out = tiny_llama.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=[word]))
    first = free.token_ids.index(banned)
    assert out[0].token_ids[:first] == free.token_ids[:first] and banned not in out[0].token_ids


def test_bad_words_that_bar_every_allowed_token_leave_the_allowed_ones():
    """Rows no static check can foresee: a word's last token barred after its first, each allowed token so."""
    sampler = Sampler()
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, 5.0]])
    params = SamplingParams(temperature=0, allowed_token_ids=[1, 2], bad_words=["x"])
    both = replace(params, bad_word_ids=((3, 1), (3, 2)))
    seq = Sequence("r", [0], both, 8, bans=token_bans(both, None, 5, set(), logits.device))
    assert sampler(logits.clone(), [seq])[0] == [1]  # no word begun: the most likely allowed token
    seq.token_ids.append(3)
    assert sampler(logits.clone(), [seq])[0] == [1]  # both barred: the allowed tokens alone, the words lifted
    one = replace(params, bad_word_ids=((3, 1),))
    seq.bans = token_bans(one, None, 5, set(), logits.device)
    assert sampler(logits.clone(), [seq])[0] == [2]  # one barred, the other allowed


def test_requests_left_no_token_are_refused(tiny_llama):
    engine, tokenizer = tiny_llama.engine, tiny_llama.engine.tokenizer
    word = "hello"
    ids = tokenizer.encode(word, add_special_tokens=False)
    eos = sorted(engine.eos_token_ids)
    cases = [
        (SamplingParams(allowed_token_ids=[engine.hf_config.vocab_size]), "vocabulary size"),
        (SamplingParams(allowed_token_ids=ids[:1], bad_words=[tokenizer.decode(ids[:1])]), "bad word"),
        (SamplingParams(allowed_token_ids=eos, min_tokens=2), "min_tokens"),
    ]
    for params, why in cases:
        with pytest.raises(InvalidParameter, match=why) as refused:
            engine.add_request("x", PROMPT, params)
        assert refused.value.param == "allowed_token_ids"
    assert_idle(tiny_llama)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"allowed_token_ids": "1"}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"bad_words": "x"}, "bad_words"),
        ({"bad_words": [3]}, "bad_words"),
        ({"bad_words": ["x"], "structured_output": StructuredOutput("regex", "a+")}, "bad_words"),
        ({"allowed_token_ids": [1], "structured_output": StructuredOutput("regex", "a+")}, "allowed_token_ids"),
    ],
)
def test_invalid_bans_name_the_field(kwargs, field):
    with pytest.raises(InvalidParameter, match=field) as refused:
        SamplingParams(**kwargs)
    assert refused.value.param == field

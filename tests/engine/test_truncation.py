"""vLLM's truncate_prompt_tokens in the engine: a longer prompt keeps its last tokens, a text its tokenizer's special
tokens too; as many as the context window holds with -1; more than it holds is refused."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from wsgi_infer import SamplingParams
from wsgi_infer.engine.sampling_params import InvalidParameter
from wsgi_infer.engine.text.truncation import prompt_tokens

from ..conftest import assert_idle

TEXT = "The weather in Paris is sunny, and the weather in Rome is rainy. " * 3


def test_a_text_keeps_its_special_tokens_and_its_last_tokens(minilm_dir):
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)  # [CLS] text [SEP]
    whole = tokenizer.encode(TEXT)
    text = tokenizer.encode(TEXT, add_special_tokens=False)
    assert prompt_tokens(tokenizer, TEXT, None) == prompt_tokens(tokenizer, TEXT, len(whole)) == whole
    assert prompt_tokens(tokenizer, TEXT, 10) == [whole[0], *text[-8:], whole[-1]] == whole[:1] + whole[-9:]
    with pytest.raises(InvalidParameter, match="at least 3, got 2"):  # no room for text: [SEP] alone was read
        prompt_tokens(tokenizer, TEXT, 2)
    assert prompt_tokens(tokenizer, whole, 10) == whole[-10:]  # token ids as given


def test_the_engine_reads_the_last_tokens_and_refuses_more_than_its_window(tiny_llama):
    engine = tiny_llama.engine
    ids = engine.tokenize(TEXT)
    params = SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=8)
    cut, as_ids = tiny_llama.generate([TEXT, ids[-8:]], [params, SamplingParams(temperature=0, max_tokens=8)])
    assert cut.prompt_token_ids == ids[-8:] and cut.token_ids == as_ids.token_ids
    window = SamplingParams(max_tokens=0, truncate_prompt_tokens=-1)  # queued, not computed: its length told
    longer = ids * (engine.max_model_len // len(ids) + 1)
    assert engine.add_request("w", longer, window) == engine.max_model_len < len(longer)
    engine.abort("w")
    with pytest.raises(InvalidParameter, match="context window") as refused:
        engine.add_request("x", TEXT, SamplingParams(truncate_prompt_tokens=engine.max_model_len + 1))
    assert refused.value.param == "truncate_prompt_tokens"
    assert_idle(tiny_llama)

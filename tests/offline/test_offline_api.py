"""The offline API (``LLM``) with vLLM's names, as its callers write them: ``sampling_params``, ``use_tqdm``, and
chat's template options and content parts (each a TypeError or a template's error before)."""

from __future__ import annotations

import pytest

from wsgi_infer import SamplingParams
from wsgi_infer.engine.sampling_params import InvalidParameter
from wsgi_infer.engine.text.chat_template import chat_prompt_ids

ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_vllms_keywords_are_taken(tiny_llama):
    alone = tiny_llama.generate("Hello", GREEDY)[0]
    assert tiny_llama.generate("Hello", sampling_params=GREEDY, use_tqdm=False)[0].token_ids == alone.token_ids
    chat = tiny_llama.chat(ASK, sampling_params=GREEDY, use_tqdm=False)[0]
    assert chat.token_ids == tiny_llama.generate(tiny_llama.apply_chat_template(ASK), GREEDY)[0].token_ids
    with pytest.raises(TypeError, match="prompts"):
        tiny_llama.generate(None)


def test_chat_takes_the_templates_options_and_text_parts(tiny_llama):
    tokenizer = tiny_llama.tokenizer
    prefill = [*ASK, {"role": "assistant", "content": "It is"}]
    continued = tiny_llama.chat(prefill, GREEDY, continue_final_message=True, add_generation_prompt=False)[0]
    assert continued.prompt_token_ids == chat_prompt_ids(tokenizer, prefill, continue_final_message=True)
    assert tokenizer.decode(continued.prompt_token_ids).endswith("It is")
    opened, closed = (tiny_llama.chat(ASK, GREEDY, add_generation_prompt=o)[0].prompt_token_ids for o in (True, 0))
    assert closed == chat_prompt_ids(tokenizer, ASK, add_generation_prompt=False) and len(closed) < len(opened)
    with pytest.raises(InvalidParameter, match="chat_template_kwargs"):  # they reach the template
        tiny_llama.chat(ASK, GREEDY, chat_template_kwargs={"tokenize": False})
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "What is the weather"}, {"type": "text", "text": "?"}]}
    ]
    joined = [{"role": "user", "content": "What is the weather\n?"}]
    assert tiny_llama.chat(parts, GREEDY)[0].prompt_token_ids == tiny_llama.apply_chat_template(joined)
    with pytest.raises(ValueError, match="only text parts"):
        tiny_llama.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], GREEDY)

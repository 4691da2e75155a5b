"""Stop strings and stop token ids: the output ends at the first one, a stop string not returned, and text that
only might begin one released once it does not."""

from __future__ import annotations

from wsgi_infer import SamplingParams

from ..conftest import assert_idle
from .story_prompt import PROMPT


def stream_pieces(llm, prompt, params) -> tuple[list[str], str]:
    engine = llm.engine
    engine.add_request("s", prompt, params)
    pieces, reason = [], None
    while engine.has_unfinished():
        for delta in engine.step():
            pieces.append(delta.text)
            reason = delta.finish_reason or reason
    return pieces, reason


def test_stop_string_truncates_and_is_not_returned(packed_llm):
    free = packed_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].text
    words = free.split()
    assert len(words) > 4, free
    stop = " " + words[3]  # a stop string in the middle of the free output, spanning tokens
    cut = free.index(stop)
    pieces, reason = stream_pieces(
        packed_llm, PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "zzzz-never"])
    )
    assert "".join(pieces) == free[:cut]
    assert reason == "stop"
    assert all(stop not in p for p in pieces)
    assert_idle(packed_llm)


def test_possible_stop_prefix_is_released_when_ruled_out(packed_llm):
    free = packed_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].text
    # A stop string that starts like the output but never completes: all text still arrives.
    stop = free[:3] + "\u2603never"
    pieces, reason = stream_pieces(
        packed_llm, PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    )
    assert "".join(pieces) == free and reason == "length"
    # Released as soon as the next character rules the stop string out, not held to the end of the request.
    assert "".join(pieces[:-1]).startswith(free[:3]), pieces


def test_stop_token_ids(tiny_llama):
    free = tiny_llama.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    target = free.token_ids[5]
    first = free.token_ids.index(target)
    out = tiny_llama.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[target])
    )[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", target)
    # vLLM's include_stop_str_in_output shows the stop token's text too (it was cut either way)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[target])
    params.include_stop_str_in_output = True
    shown = tiny_llama.generate(PROMPT, params)[0]
    assert out.text == tiny_llama.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True)
    assert shown.text == tiny_llama.tokenizer.decode(out.token_ids, skip_special_tokens=True) != out.text

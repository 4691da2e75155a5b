"""Validation: a sampling parameter out of its range or of the wrong type is refused by name, generate takes
SamplingParams only, and a request over the context window (or empty, or of unknown token ids) is refused."""

from __future__ import annotations

import pytest

from wsgi_infer import SamplingParams
from wsgi_infer.engine.sampling_params import InvalidParameter, StructuredOutput

from ..conftest import assert_idle


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"max_tokens": -1}, "max_tokens"),  # 0 is valid: it scores the prompt only
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"logit_bias": {5: -100.5}}, "logit_bias"),
        ({"logit_bias": {-5: 1}}, "logit_bias"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": 1, "structured_output": StructuredOutput("regex", "a+")}, "min_tokens"),
        ({"min_tokens": None}, "min_tokens"),
        # types the ranges could not tell: a later step crashed on each (its batch lost), or took it for another
        ({"repetition_penalty": None}, "repetition_penalty"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": None}, "top_k"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stop": None}, "stop"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"structured_output": "json"}, "structured_output"),
        # NaN passes no comparison: a NaN bias passed the bound and its step killed the engine (every stream lost)
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(InvalidParameter, match=field) as refused:
        SamplingParams(**kwargs)
    assert refused.value.param == field


@pytest.mark.parametrize("params", ["x", {}, [{}]])
def test_generate_takes_sampling_params_only(tiny_llama, params):
    with pytest.raises(ValueError, match="give one SamplingParams"):
        tiny_llama.generate("Hi", params)  # a string was a list of params, a dict the defaults


def test_request_over_the_context_window_is_refused(tiny_llama):
    limit = tiny_llama.engine.max_model_len
    with pytest.raises(ValueError, match=rf"prompt \(3 tokens\) \+ max_tokens \({limit}\).*{limit}"):
        tiny_llama.engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=limit))
    with pytest.raises(ValueError, match="empty"):
        tiny_llama.engine.add_request("y", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        tiny_llama.engine.add_request("z", [10**9], SamplingParams())
    assert_idle(tiny_llama)

"""The request fields of OpenAI's, Anthropic's, vLLM's and llama-server's APIs that would change the output and
that this server does not implement: each is a 400 naming it (``parsing.parse``), never ignored, unless its value is
one that changes nothing. A client written for one of those servers either gets what it asked for or is told it cannot.

Taken rather than refused: vLLM's ``min_tokens``, ``truncate_prompt_tokens``, ``prompt_logprobs``,
``return_token_ids``, ``return_tokens_as_token_ids``, ``allowed_token_ids``, ``bad_words``,
``guided_json``/``_regex``/``_choice``/``_grammar`` and chat's ``add_generation_prompt``, llama-server's
``json_schema`` and ``grammar``. Ignored, as changing nothing here:
vLLM's ``guided_decoding_backend``, ``request_id``, ``mm_processor_kwargs`` and ``kv_transfer_params``;
llama-server's ``cache_prompt``, ``id_slot``, ``n_keep``, ``samplers`` (the order of its samplers: ours is
vLLM's) and the settings of the samplers refused below, which act only with them.
"""

from __future__ import annotations

from .parsing import Refused

OPENAI = {
    "audio": Refused("audio output is not supported"),
    "modalities": Refused("only text output is supported", (["text"],)),
    "prediction": Refused("predicted outputs are not supported"),
    "functions": Refused("functions is deprecated and not supported; use tools"),
    "function_call": Refused("function_call is deprecated and not supported; use tool_choice"),
    "web_search_options": Refused("web search is not supported"),
    "suffix": Refused("suffix (fill in the middle) is not supported", ("",)),
    "best_of": Refused("best_of is not supported; use n", (1,)),
}


def _off(what: str, *neutral: object, why: str = "") -> Refused:
    return Refused(f"{what} is not supported" + (f": {why}" if why else ""), neutral)


# OpenAI's chat field and the Responses API's text.verbosity: its default, medium, is what a model writes unasked
VERBOSITY = _off("verbosity other than medium", "medium", why="the model writes as it does")
OPENAI_CHAT = {"verbosity": VERBOSITY}
RESPONSES = {  # the Responses API's own
    "background": Refused(
        "background responses are not supported; stream, and resume the stream if the connection drops", (False,)
    ),
    "conversation": Refused("conversations are not supported; chain responses with previous_response_id"),
    "prompt": _off("prompt templates"),
    "max_tool_calls": _off("max_tool_calls"),
    "top_logprobs": Refused("logprobs are not supported on /v1/responses; use /v1/chat/completions", (0,)),
    "truncation": _off("truncation other than disabled", "disabled"),
    "context_management": _off("context_management", [], why="a conversation is never compacted"),
    "moderation": _off("moderation"),
}
MESSAGES = {  # Anthropic's Messages API's
    "container": _off("code execution containers"),
    "mcp_servers": _off("MCP servers"),
    "context_management": RESPONSES["context_management"],
}
RESPONSES_NESTED = {  # fields of its objects, named as text.verbosity (``responses.schemas.refuse_unsupported``)
    "text": {"verbosity": VERBOSITY},
    "reasoning": {
        "context": _off("reasoning.context other than auto", "auto", why="the template renders past thoughts"),
        "mode": _off("reasoning.mode other than standard", "standard"),
    },
}


VLLM = {
    "use_beam_search": _off("beam search", False),
    "length_penalty": _off("length_penalty", 1.0, why="it is beam search's"),
    "logits_processors": _off("logits_processors", []),
    "vllm_xargs": _off("vllm_xargs", {}, why="they are custom logits processors' arguments"),
    "spaces_between_special_tokens": _off("spaces_between_special_tokens false", True),
    "structural_tag": _off("structural_tag", why="use tools or structured_outputs"),
    "guided_whitespace_pattern": _off("guided_whitespace_pattern", why="JSON takes 16 spaces or newlines at most"),
}
VLLM_CHAT = {
    "echo": _off("echo in chat completions", False),
    "chat_template": _off("a chat template in the request", why="the model's own renders the conversation"),
    "documents": _off("documents"),
    "add_special_tokens": _off("add_special_tokens in chat completions", False, why="the template places them"),
    "include_reasoning": _off("include_reasoning false", True, why="a thought comes as reasoning_content"),
    "thinking_token_budget": _off("thinking_token_budget", why="reasoning_effort none switches the thought off"),
}
VLLM_COMPLETIONS = {
    "add_special_tokens": _off("add_special_tokens false", True, why="a text prompt takes the tokenizer's own"),
}
VLLM_EMBEDDINGS = {  # vLLM's pooling fields: each changes the vectors, or the bytes that carry them
    "add_special_tokens": VLLM_COMPLETIONS["add_special_tokens"],
    "normalize": _off("normalize", why="a model's vectors are as its own pooling makes them (its Normalize module)"),
    "embed_dtype": _off("embed_dtype other than float32", "float32"),
    "endianness": _off("endianness other than little", "little", "native", why="base64 holds little-endian float32"),
    "messages": _off("messages (a conversation's embedding)", why="send its text as input"),
}
COHERE_RERANK = {  # Cohere's, on /v2/rerank: it truncates each document to its tokens
    "max_tokens_per_doc": _off("max_tokens_per_doc", why="use truncate_prompt_tokens (vLLM's)"),
}
CHATS_ONLY = {  # chat's fields, which OpenAI's completions refuse and vLLM's ignore: each would change the output
    "max_completion_tokens": Refused("max_completion_tokens is chat's; /v1/completions takes max_tokens"),
    "top_logprobs": Refused("top_logprobs is chat's; /v1/completions takes logprobs (an integer)"),
    **{
        name: Refused(f"{name} is a chat completion's field: /v1/chat/completions takes it (a prompt is no chat)")
        for name in ("messages", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort")
        + ("chat_template_kwargs", "continue_final_message", "add_generation_prompt")
    },
}
LLAMA_SERVER = {
    "n_predict": _off("n_predict", why="use max_tokens"),
    "n_probs": _off("n_probs", 0, why="use logprobs"),
    "repeat_penalty": _off("repeat_penalty", 1.0, why="use repetition_penalty, over the whole text"),
    "mirostat": _off("Mirostat sampling", 0),
    "typical_p": _off("typical_p", 1.0),
    "tfs_z": _off("tfs_z", 1.0),
    "top_n_sigma": _off("top_n_sigma", -1.0, 0.0),
    "dynatemp_range": _off("dynatemp_range", 0.0),
    "xtc_probability": _off("xtc_probability", 0.0),
    "dry_multiplier": _off("dry_multiplier", 0.0),
    "post_sampling_probs": _off("post_sampling_probs", False),
    "t_max_predict_ms": _off("t_max_predict_ms", 0),
    "n_indent": _off("n_indent", 0),
    "lora": _off("lora", [], why="adapters are not loaded per request"),
    "reasoning_format": _off("reasoning_format", "auto", "deepseek", why="a thought comes as reasoning_content"),
}
SAMPLING = {**OPENAI, **VLLM, **LLAMA_SERVER}

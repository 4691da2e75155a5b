"""The offline API: ``LLM(...).generate(prompts, sampling_params)`` and ``.chat(messages, sampling_params)``, with
vLLM's names for both."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from .engine.config import EngineConfig
from .engine.kernels.build import kernels_library
from .engine.llm_engine import LLMEngine, Prompt
from .engine.outputs import CompletionOutput, RequestDelta
from .engine.sampling_params import SamplingParams, tokens_to_keep
from .engine.text.chat_template import chat_prompt_ids
from .engine.text.truncation import prompt_tokens

Message = dict[str, str]
PROMPT_KEYS = {"prompt": str, "prompt_token_ids": list}  # vLLM's TextPrompt and TokensPrompt, each its key alone


def prompt_of(given: object) -> Prompt:
    """A text or token ids, given so or in one of vLLM's prompt dicts; anything else is a TypeError saying so."""
    if isinstance(given, dict) and len(given) == 1:
        ((key, value),) = given.items()
        if isinstance(value, PROMPT_KEYS.get(key, ())):
            given = value
    if isinstance(given, str) or (given and isinstance(given, list) and all(type(t) is int for t in given)):
        return given
    raise TypeError(
        'a prompt is a text, token ids (a list of integers), {"prompt": text} or {"prompt_token_ids": ids}; '
        f"not {given!r:.80}"
    )


class LLM:
    """Batch generation without a server; the same engine the server drives."""

    def __init__(self, model: str | None = None, device: str = "auto", dtype: str = "auto", **engine_options) -> None:
        kernels_library(build=True)  # without an installed variant: in the server a child of the master builds
        self.engine = LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion, batched; outputs are in prompt order. ``use_tqdm``: vLLM's, taken from
        its callers; no progress bar is drawn."""
        del use_tqdm
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, Seq):
            raise TypeError(f"prompts: a prompt or a list of prompts, not {prompts!r:.80}")
        prompts = [prompt_of(p) for p in prompts]
        params = sampling_params
        one = SamplingParams() if params is None else params
        params_list = list(params) if isinstance(params, Seq) else [one] * len(prompts)
        if len(params_list) != len(prompts) or not all(isinstance(p, SamplingParams) for p in params_list):
            raise ValueError("sampling_params: give one SamplingParams, or one per prompt")
        prompt_ids: dict[str, list[int]] = {}
        results: dict[str, RequestDelta] = {}
        try:
            for prompt, p in zip(prompts, params_list):
                request_id = f"offline-{next(self._ids)}"
                keep = tokens_to_keep(p, self.engine.max_model_len)
                prompt_ids[request_id] = prompt_tokens(self.engine.tokenizer, prompt, keep)
                self.engine.add_request(request_id, prompt_ids[request_id], p)
                results[request_id] = RequestDelta(request_id, "", [], [] if p.logprobs is not None else None)
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    results[delta.request_id] = results[delta.request_id].then(delta)
            self.engine.write_stored_blocks()  # the last step's prompt blocks (the next step's start writes them)
        finally:
            for request_id in results:  # on error or interrupt, leave nothing behind
                self.engine.abort(request_id)
        return [
            CompletionOutput(
                r.request_id,
                prompt_ids[r.request_id],
                r.text,
                r.token_ids,
                r.finish_reason,
                r.logprobs,
                r.prompt_logprobs,
                r.stop_reason,
            )
            for r in results.values()
        ]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> list[CompletionOutput]:
        """Apply the model's chat template to each conversation (vLLM's keywords), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        options = {"chat_template_kwargs": chat_template_kwargs, "tools": tools}
        options |= {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        prompts = [self.apply_chat_template(c, **options) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(
        self,
        messages: list[Message],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        """A conversation's token ids; text parts (OpenAI's and vLLM's content lists) joined by newlines, as the
        server joins them."""
        flat = [
            {**m, "content": text_of_parts(m["content"])} if isinstance(m.get("content"), list) else m for m in messages
        ]
        return chat_prompt_ids(
            self.engine.tokenizer, flat, tools, add_generation_prompt, chat_template_kwargs, continue_final_message
        )


def text_of_parts(parts: list) -> str:
    """A content list's text: its text parts, joined by newlines; another kind of part is a ValueError."""
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        raise ValueError("content parts: only text parts ({'type': 'text', 'text': ...}) are supported")
    return "\n".join(p["text"] for p in parts)

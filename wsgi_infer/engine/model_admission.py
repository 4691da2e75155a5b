"""A request's way into one engine (``admit``), and the token texts its deltas' logprobs need."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .messages import Accepted, Admitted, Rejected, Submit
from .text.token_pieces import token_piece

if TYPE_CHECKING:
    from .embedding_engine import EmbeddingEngine
    from .llm_engine import LLMEngine
    from .outputs import RequestDelta

log = logging.getLogger(__name__)


def admit(engine: LLMEngine | EmbeddingEngine, command: Submit) -> Admitted:
    """Queue every choice of every prompt (choice index = prompt * n + j), or none of them."""
    n = len(command.params)
    generated = command.generated or [[]] * len(command.choice_ids)
    try:
        for i, ids in enumerate(command.prompts):
            for j, params in enumerate(command.params):
                tokens = generated[i * n + j]
                if tokens is not None:  # an embedding engine continues nothing: it is never given tokens
                    engine.add_request(command.choice_ids[i * n + j], ids, params, *([tokens] if tokens else []))
    except Exception as exc:  # one request's bad input (or our bug) must not end the engine thread
        for choice_id in command.choice_ids:
            engine.abort(choice_id)
        if isinstance(exc, ValueError):
            return Admitted(command.key, Rejected(str(exc), getattr(exc, "param", None)))
        log.exception("request %s could not be admitted", command.request_id)
        return Admitted(
            command.key, Rejected(f"the engine could not take this request: {type(exc).__name__}", status=500)
        )
    return Admitted(command.key, Accepted(sum(len(ids) for ids in command.prompts)))


def token_texts(engine: LLMEngine | EmbeddingEngine, deltas: list[RequestDelta]) -> dict[int, str]:
    """The text of every token the deltas' logprobs mention (prompt ones too), decoded here, off the hub (part of a
    character as its bytes: ``text.token_pieces``)."""
    wanted = {t for d in deltas for lp in _all_logprobs(d) for t in (lp.token_id, *(i for i, _ in lp.top))}
    wanted.update(d.prompt_token_ids[0] for d in deltas if d.prompt_token_ids)  # the first has no logprob
    return {t: token_piece(engine.tokenizer, t) for t in wanted}


def _all_logprobs(delta: RequestDelta) -> list:
    return (delta.logprobs or []) + (delta.prompt_logprobs or [])

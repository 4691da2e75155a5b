"""vLLM's /tokenize and /detokenize: the served model's tokenizer over HTTP.

They run on the worker's own copy of the tokenizer, on the front-end thread (a long
text takes tens of milliseconds), never on the hub or the engine thread, so
they answer at once even while a long prefill runs.
"""

from __future__ import annotations

from flask import Blueprint, jsonify, request

from ..errors import APIError
from .bodies.parsing import parse
from .bodies.schemas import DetokenizeRequest, TokenizeRequest
from .chat.conversation import chat_token_ids
from .chat.schemas import TokenizeChatRequest
from .serving import served, wait_ready

bp = Blueprint("tokenization", __name__)


@bp.post("/tokenize")
def tokenize():
    body = request.get_json(force=True)
    chat = isinstance(body, dict) and "messages" in body
    if chat and "prompt" in body:  # one was ignored
        raise APIError("send a prompt or messages, not both", param="prompt")
    req = parse(TokenizeChatRequest if chat else TokenizeRequest, body)
    mgr = served(req.model)
    if chat:
        tokens = chat_token_ids(req)
    else:
        wait_ready(mgr)
        tokens = mgr.with_tokenizer(_encode, req.prompt, req.add_special_tokens)
    body = {"count": len(tokens), "max_model_len": mgr.max_model_len, "tokens": list(tokens), "token_strs": None}
    if req.return_token_strs:
        body["token_strs"] = mgr.tokenizer.convert_ids_to_tokens(list(tokens))
    return jsonify(body)


@bp.post("/detokenize")
def detokenize():
    req: DetokenizeRequest = parse(DetokenizeRequest, request.get_json(force=True))
    mgr = served(req.model)
    wait_ready(mgr)
    vocab = len(mgr.tokenizer)
    if any(t >= vocab for t in req.tokens):
        raise APIError(f"tokens must be token ids below {vocab}", param="tokens")
    return jsonify({"prompt": mgr.tokenizer.decode(req.tokens)})


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)

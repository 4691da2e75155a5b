"""vLLM's /v1/score and /v1/rerank (Jina's shape; /v2/rerank for Cohere's clients) on an embedding model: a pair's
score is the cosine similarity of its two texts' embeddings, as vLLM scores with an embedding model. Every text of
a request is embedded in one batch, through /v1/embeddings' admission, bounds and truncation."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

import numpy as np
from flask import Blueprint, jsonify, request
from pydantic import BaseModel, Field, StrictBool, StrictInt, StringConstraints, ValidationError, WrapValidator

from ...errors import APIError
from ..bodies.keep_alive import KeepAlive
from ..bodies.parsing import Request, parse
from ..bodies.refused import COHERE_RERANK
from ..bodies.schemas import batch_of, engine_field
from .embeddings import MAX_INPUTS, embedded

bp = Blueprint("scores", __name__)


def _texts(value: Any, handler: Any) -> Any:
    """One error naming what a field takes, where each member of the union reported its own."""
    try:
        value = handler(value)
    except ValidationError:
        raise ValueError("must be a text or a list of texts") from None
    _check([value] if isinstance(value, str) else value)
    return value


def _documents(value: Any, handler: Any) -> Any:
    try:
        documents = handler(value)
    except ValidationError:
        raise ValueError('must be a list of texts or of {"text": ...} objects') from None
    _check([d if isinstance(d, str) else d.text for d in documents])
    return documents


def _check(texts: list[str]) -> None:
    if not 0 < len(texts) <= MAX_INPUTS:
        raise ValueError(f"must hold 1 to {MAX_INPUTS} texts")
    if "" in texts:
        raise ValueError("a text must not be empty")


Texts = Annotated[str | list[str], WrapValidator(_texts)]


class ScoringRequest(Request):
    model: str | None = None
    keep_alive: KeepAlive = None
    truncate_prompt_tokens: int | None = engine_field("truncate_prompt_tokens")
    user: str | None = None


class ScoreRequest(ScoringRequest):
    text_1: Texts
    text_2: Texts


class Document(BaseModel):
    text: str


class RerankRequest(ScoringRequest):
    refused = COHERE_RERANK
    query: Annotated[str, StringConstraints(min_length=1)]
    documents: Annotated[list[str | Document], WrapValidator(_documents)]
    top_n: StrictInt = Field(0, ge=0)  # 0: every document, as vLLM
    return_documents: StrictBool = True  # Jina's


@bp.post("/v1/score")
def score():
    """1:N (one text_1 against each text_2) or N:N (pairwise), as vLLM pairs them."""
    req: ScoreRequest = parse(ScoreRequest, request.get_json(force=True))
    firsts, seconds = batch_of(req.text_1), batch_of(req.text_2)
    if len(firsts) not in (1, len(seconds)):
        message = f"text_1 holds {len(firsts)} texts: it must hold one, or as many as text_2 ({len(seconds)})"
        raise APIError(message, param="text_1")
    names = _names("text_1", req.text_1) + _names("text_2", req.text_2)
    name, scores, tokens = _cosines(req, firsts, seconds, names)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    reply = {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": name}
    return jsonify({**reply, "data": data, "usage": usage})


@bp.post("/v1/rerank")
@bp.post("/v2/rerank")
def rerank():
    """The documents by their score against the query, highest first; the first ``top_n`` of them."""
    req: RerankRequest = parse(RerankRequest, request.get_json(force=True))
    texts = [d if isinstance(d, str) else d.text for d in req.documents]
    name, scores, tokens = _cosines(req, [req.query], texts, ["query", *_names("documents", texts)])
    ranked = sorted(range(len(texts)), key=lambda i: -scores[i])[: req.top_n or len(texts)]
    results = [
        {"index": i, **({"document": {"text": texts[i]}} if req.return_documents else {}), "relevance_score": scores[i]}
        for i in ranked
    ]
    return jsonify(
        {"id": f"rerank-{uuid.uuid4().hex}", "model": name, "usage": {"total_tokens": tokens}, "results": results}
    )


def _names(field: str, given: str | list) -> list[str]:
    """Each text's name in the request, for an error: ``text_2.3``, or ``text_2`` where it is one text."""
    return [f"{field}.{i}" for i in range(len(given))] if isinstance(given, list) else [field]


def _cosines(
    req: ScoringRequest, firsts: list[str], seconds: list[str], names: list[str]
) -> tuple[str, list[float], int]:
    """Each second text's score against its first (the one first text, or the one at its index); ``names``: each
    text's name in the request, the firsts' then the seconds'."""
    if len(firsts) + len(seconds) > MAX_INPUTS:
        raise APIError(f"at most {MAX_INPUTS} texts in all", param=names[-1].split(".")[0])
    name, vectors, tokens = embedded(req.model, req.keep_alive, firsts + seconds, req.truncate_prompt_tokens, names)
    embeddings = np.asarray(vectors, dtype=np.float64)
    embeddings /= np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), np.finfo(np.float64).tiny)
    a, b = embeddings[: len(firsts)], embeddings[len(firsts) :]  # one first row broadcasts to every second
    return name, [float(s) for s in (a * b).sum(1)], tokens

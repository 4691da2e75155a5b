"""OpenAI's /v1/embeddings: by an embedding model's engine, or by a generating model's, pooling its final hidden
states (``embedding_pooling``). Inputs share engine steps and go through the same admission (429), drain and
bounds as generation."""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from flask import Blueprint, jsonify, request
from pydantic import Field, field_validator

from ....engine.sampling_params import InvalidParameter, SamplingParams
from ...errors import APIError
from ..bodies.keep_alive import KeepAlive
from ..bodies.parsing import Request, parse
from ..bodies.refused import VLLM_EMBEDDINGS
from ..bodies.schemas import Prompts, batch_of, engine_field
from ..serving import collect_all, served, start, wait_ready

bp = Blueprint("embeddings", __name__, url_prefix="/v1")

MAX_INPUTS = 2048  # per request, as OpenAI's


class EmbeddingRequest(Request):
    refused = VLLM_EMBEDDINGS
    model: str | None = None
    keep_alive: KeepAlive = None
    input: Prompts
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    truncate_prompt_tokens: int | None = engine_field("truncate_prompt_tokens")  # vLLM's
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _bounded(cls, value):
        if isinstance(value, list) and not 0 < len(value) <= MAX_INPUTS:
            raise ValueError(f"input must hold 1 to {MAX_INPUTS} inputs")
        if value == "" or isinstance(value, list) and any(v == "" or v == [] for v in value):
            raise ValueError("an input must not be empty")
        return value

    @property
    def inputs(self) -> list[str | list[int]]:
        return batch_of(self.input)


@bp.post("/embeddings")
def embeddings():
    req: EmbeddingRequest = parse(EmbeddingRequest, request.get_json(force=True))
    inputs = req.inputs
    names = [f"input.{i}" for i in range(len(inputs))] if len(inputs) > 1 else ["input"]
    name, vectors, prompt_tokens = embedded(req.model, req.keep_alive, inputs, req.truncate_prompt_tokens, names)
    if req.dimensions is not None and req.dimensions != len(vectors[0]):
        raise APIError(
            f"this model's embeddings have {len(vectors[0])} dimensions, and no other number", param="dimensions"
        )
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(vector, req.encoding_format)}
        for i, vector in enumerate(vectors)
    ]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return jsonify({"object": "list", "data": data, "model": name, "usage": usage})


def embedded(
    model: str | None, keep_alive: float | None, inputs: list[str | list[int]], truncate: int | None, names: list[str]
) -> tuple[str, list[list[float]], int]:
    """The model's name, each input's embedding and their prompt tokens; a 400 naming the input at fault by its
    ``names`` entry (``input.3``, ``text_2.0``...)."""
    mgr = served(model, keep_alive)
    wait_ready(mgr)
    pooling = None if mgr.task == "embed" else mgr.settings.embedding_pooling  # an encoder pools as configured
    try:  # the door first: a burst it refuses is not tokenized (2,048 short inputs: 119 ms)
        params = SamplingParams(max_tokens=0, pooling=pooling, truncate_prompt_tokens=truncate)
        stream = start(mgr, inputs, [params], task=None)
    except InvalidParameter as exc:  # the generation rule's words name a prompt, and max_tokens (always 0 here)
        if exc.param not in ("prompt", "max_tokens"):
            raise
        name = names[exc.index] if exc.index is not None else names[0].split(".")[0]
        raise APIError(str(exc).replace("prompt", name).replace(" + max_tokens (0)", ""), param=name) from None
    merged = collect_all(stream)
    return mgr.name, [merged[i].delta.embedding for i in sorted(merged)], stream.prompt_tokens


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    """``base64``: little-endian float32 bytes, as OpenAI sends them (its SDK decodes them so)."""
    if encoding == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()

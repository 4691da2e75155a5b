"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING

from flask import Blueprint, Response, jsonify, request

from .. import sse
from ..engine_messages import Chat
from ..errors import APIError
from ..protocol import ChatCompletionRequest, CompletionRequest, parse
from ..redis_store import RedisStreamReader, StoreUnavailable
from ..stream_log import StreamLog
from ..streams import ChoiceDelta, RequestStream
from ..tools import ToolCallParser
from .serving import Heartbeat, StreamInterrupted, check_model, collect, iter_deltas, manager, start

if TYPE_CHECKING:
    from ..manager import EngineManager

bp = Blueprint("openai", __name__, url_prefix="/v1")

RETRY_AFTER_INTERRUPT_MS = 1000


@bp.get("/models")
def models():
    mgr = manager()
    return jsonify(
        {
            "object": "list",
            "data": [
                {
                    "id": mgr.model_name,
                    "object": "model",
                    "created": int(mgr.started_at),
                    "owned_by": "wsgi-infer",
                    "root": mgr.model_dir or mgr.model_name,
                    "parent": None,
                    "max_model_len": mgr.max_model_len,
                }
            ],
        }
    )


@bp.post("/completions")
def completions():
    req: CompletionRequest = parse(CompletionRequest, request.get_json(force=True))
    check_model(req.model)
    params = req.sampling_params(req.max_tokens, req.logprobs, req.prompt_logprobs)
    stream = start(req.prompts, params, constraint_field=req.constraint_field)
    echo = None
    if req.echo:  # only then: the hub's tokenizer is loaded by its first use
        tokenizer = manager().tokenizer
        echo = [p if isinstance(p, str) else tokenizer.decode(p) for p in req.prompts]
    formatter = _CompletionFormatter(stream, "text_completion", echo)
    return _respond(stream, req.stream, req.include_usage, formatter)


@bp.post("/chat/completions")
def chat_completions():
    req: ChatCompletionRequest = parse(ChatCompletionRequest, request.get_json(force=True))
    check_model(req.model)
    messages, tools = req.conversation(manager().template_takes_tools)
    params = req.sampling_params(req.max_new_tokens, req.num_logprobs)
    stream = start([Chat(messages, tools)], params, constraint_field=req.constraint_field)
    obj = "chat.completion.chunk" if req.stream else "chat.completion"
    formatter = _ChatFormatter(stream, obj, with_tools=req.tool_plan is not None)
    return _respond(stream, req.stream, req.include_usage, formatter)


def _respond(stream: RequestStream, streaming: bool, include_usage: bool, formatter: _Formatter):
    if not streaming:
        try:
            merged = collect(stream)
        except StreamInterrupted as exc:
            raise APIError(exc.message, 503, code=exc.code, headers={"Retry-After": "1"}) from None
        finally:
            manager().release(stream)
        body = formatter.envelope([formatter.final_choice(merged[i]) for i in sorted(merged)])
        body["usage"] = stream.usage
        return jsonify(body)
    # A pump greenlet owns the generation and records its events; this response, and
    # any resume of it, only read that log, so a dropped connection loses nothing.
    mgr = manager()
    log = mgr.stream_logs.publish(_sse(mgr, stream, include_usage, formatter), on_abandoned=lambda: mgr.release(stream))
    return _read_log(log, 0)


@bp.get("/streams/<stream_id>")
def resume(stream_id: str):
    """Resume a stream after the event the client saw last (Last-Event-ID, as EventSource sends)."""
    try:
        log = manager().stream_logs.get(stream_id)
    except StoreUnavailable as exc:
        raise APIError(str(exc), 503, code="store_unavailable", headers={"Retry-After": "1"}) from None
    if log is None:
        raise APIError(
            f"stream {stream_id!r} is unknown or has expired", 404, param="stream_id", code="stream_not_found"
        )
    last = request.headers.get("Last-Event-ID") or request.args.get("last_event_id") or "0"
    if not last.isdigit():
        raise APIError("Last-Event-ID must be an event id of this stream", 400, param="Last-Event-ID")
    return _read_log(log, int(last))


def _read_log(log: StreamLog | RedisStreamReader, after: int) -> Response:
    headers = {**sse.STREAM_HEADERS, "X-Stream-Id": log.stream_id}
    return Response(
        log.read(after, manager().settings.heartbeat_seconds), mimetype="text/event-stream", headers=headers
    )


def _sse(mgr: EngineManager, stream: RequestStream, include_usage: bool, formatter: _Formatter) -> Iterator[str | None]:
    """The events of one response; runs in the pump greenlet (no request context)."""
    try:
        for batch in iter_deltas(stream, mgr.settings.heartbeat_seconds):
            if isinstance(batch, Heartbeat):
                if stream.closed:  # abandoned: nobody reads it any more
                    return
                yield None
                continue
            for choice in batch:
                chunk = formatter.chunk_choice(choice)
                if chunk is not None:
                    yield sse.event(formatter.envelope([chunk]))
        if include_usage:
            yield sse.event(formatter.envelope([], usage=stream.usage))
        yield sse.DONE
    except StreamInterrupted as exc:
        # Each unfinished choice ends with "abort", then an error event; never [DONE].
        for index in range(stream.num_choices):
            if index not in stream.finish_reasons:
                yield sse.event(formatter.envelope([formatter.abort_choice(index)]))
        kind = "server_shutdown" if exc.code == "server_shutting_down" else "server_error"
        error = {"error": {"message": exc.message, "type": kind, "param": None, "code": exc.code}}
        yield sse.event(error, name="error", retry_ms=RETRY_AFTER_INTERRUPT_MS)
    finally:
        mgr.release(stream)


class _Formatter(ABC):
    """Turns merged deltas into one API's JSON: streamed chunks, final choices, aborts."""

    prefix = ""

    def __init__(self, stream: RequestStream, obj: str) -> None:
        self.id = f"{self.prefix}-{stream.request_id}"
        self.object = obj
        self.created = int(time.time())
        self.model = manager().model_name  # read here, in the request: the pump has no app context

    def envelope(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    @abstractmethod
    def chunk_choice(self, choice: ChoiceDelta) -> dict | None:
        """A streamed choice; None when there is nothing to send yet."""

    @abstractmethod
    def final_choice(self, choice: ChoiceDelta) -> dict: ...

    @abstractmethod
    def abort_choice(self, index: int) -> dict: ...


class _CompletionFormatter(_Formatter):
    """``echo`` holds each prompt's text: it starts that prompt's choices."""

    prefix = "cmpl"

    def __init__(self, stream: RequestStream, obj: str, echo: list[str] | None = None) -> None:
        super().__init__(stream, obj)
        self._text_offset: dict[int, int] = {}
        self._echo = echo
        self._n = stream.choices_per_prompt
        self._echoed: set[int] = set()

    def chunk_choice(self, choice: ChoiceDelta) -> dict:
        d = choice.delta
        text = d.text
        if self._echo is not None and choice.index not in self._echoed:
            self._echoed.add(choice.index)
            text = self._echo[choice.index // self._n] + text
        return {
            "index": choice.index,
            "text": text,
            "logprobs": self._logprobs(choice),
            "finish_reason": d.finish_reason,
        }

    final_choice = chunk_choice

    def abort_choice(self, index: int) -> dict:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": "abort"}

    def _logprobs(self, choice: ChoiceDelta) -> dict | None:
        """The legacy shape; prompt tokens first when echoed (the first one has no logprob)."""
        d = choice.delta
        if d.logprobs is None and d.prompt_logprobs is None:
            return None
        entries: list[tuple[int, float | None, list | None]] = []
        if d.prompt_logprobs is not None:
            entries.append((d.prompt_token_ids[0], None, None))
            entries += [(lp.token_id, lp.logprob, lp.top) for lp in d.prompt_logprobs]
        entries += [(lp.token_id, lp.logprob, lp.top) for lp in d.logprobs or []]
        texts = choice.token_texts
        tokens = [texts.get(token_id, "") for token_id, _, _ in entries]
        offsets, offset = [], self._text_offset.get(choice.index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._text_offset[choice.index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": [None if top is None else {texts.get(t, ""): v for t, v in top} for _, _, top in entries],
            "text_offset": offsets,
        }


class _ChatFormatter(_Formatter):
    """With tools, each choice's text goes through a ``ToolCallParser``: content or tool calls."""

    prefix = "chatcmpl"

    def __init__(self, stream: RequestStream, obj: str, with_tools: bool = False) -> None:
        super().__init__(stream, obj)
        self._role_sent: set[int] = set()
        self._parsers = {i: ToolCallParser() for i in range(stream.num_choices)} if with_tools else None

    def chunk_choice(self, choice: ChoiceDelta) -> dict | None:
        finish_reason = choice.delta.finish_reason
        delta: dict = {"content": choice.delta.text}
        if self._parsers is not None:
            parser = self._parsers[choice.index]
            delta = parser.feed(choice.delta.text)
            if finish_reason is not None:
                delta = _merge_deltas(delta, parser.finish())
                finish_reason = _finish_reason(parser, finish_reason)
            elif not delta:
                return None
        if choice.index not in self._role_sent:  # the role comes with the first real token
            self._role_sent.add(choice.index)
            delta = {"role": "assistant", **delta}
        return {
            "index": choice.index,
            "delta": delta,
            "logprobs": self._logprobs(choice),
            "finish_reason": finish_reason,
        }

    def final_choice(self, choice: ChoiceDelta) -> dict:
        message: dict = {"role": "assistant", "content": choice.delta.text}
        finish_reason = choice.delta.finish_reason
        if self._parsers is not None:
            parser = self._parsers[choice.index]
            parser.feed(choice.delta.text)
            parser.finish()
            message["content"] = parser.content
            calls = [c.as_openai() for c in parser.calls if c.complete]
            if calls:
                message["tool_calls"] = calls
            finish_reason = _finish_reason(parser, finish_reason)
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs(choice),
            "finish_reason": finish_reason,
        }

    def abort_choice(self, index: int) -> dict:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": "abort"}

    @staticmethod
    def _logprobs(choice: ChoiceDelta) -> dict | None:
        if choice.delta.logprobs is None:
            return None
        texts = choice.token_texts

        def entry(token_id: int, logprob: float) -> dict:
            text = texts.get(token_id, "")
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in choice.delta.logprobs
            ]
        }


def _finish_reason(parser: ToolCallParser, finish_reason: str) -> str:
    """A choice that ended its calls (not cut by the length limit) finished with "tool_calls"."""
    return "tool_calls" if finish_reason == "stop" and parser.calls else finish_reason


def _merge_deltas(first: dict, second: dict) -> dict:
    """Two parser deltas of one chunk: content concatenated, tool-call entries listed in order."""
    merged = {**first}
    for key, value in second.items():
        merged[key] = merged[key] + value if key in merged else value
    return merged

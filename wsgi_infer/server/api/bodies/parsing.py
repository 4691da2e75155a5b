"""How a JSON body becomes a request: unknown fields are ignored, as OpenAI's server does; a field another API
defines that would change the output and that this server does not implement is a 400 naming it
(``refused``), never ignored; known fields with bad values give a 400 naming the field as the client sent it
(``fields_as_sent``: also where a request of another API runs as a chat completion)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, get_args

from pydantic import BaseModel, ConfigDict, ValidationError

from ....engine.sampling_params import InvalidParameter
from ...errors import APIError


@dataclass(frozen=True)
class Refused:
    """Why a field is refused, and the values that change nothing (each another server's default): accepted."""

    reason: str
    neutral: tuple = ()

    def refuses(self, value: object) -> bool:
        return value is not None and value not in self.neutral


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # JSON values as they are: true is no 1, "2" no 2
    refused: ClassVar[Mapping[str, Refused]] = {}  # the fields this route refuses (``refused``)

    def given(self, names: tuple[str, ...]) -> dict[str, Any]:
        """The named fields the client gave a value (not None)."""
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def parse(schema: type[Request], body: object) -> Request:
    """Validate a JSON body; a 400 naming the first refused or bad field otherwise."""
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object")
    try:  # JSON escapes can spell lone surrogates, which no tokenizer takes
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise APIError("request body has invalid unicode (a lone surrogate escape)") from None
    for name, refusal in schema.refused.items():
        if refusal.refuses(body.get(name)):
            raise APIError(refusal.reason, param=name)
    try:
        return schema.model_validate(_null_as_absent(schema, body))
    except ValidationError as exc:
        raise _bad_field(exc.errors(), body) from None


def _null_as_absent(schema: type[Request], body: dict) -> dict:
    """OpenAI's fields are nullable: null is the default (its SDK sends ``n=None`` so). Where a field's type has no
    None, null is taken as absent; where it has, None is a value of its own (``max_tokens``: the window's room)."""
    fields = schema.model_fields

    def absent(name: str, value: Any) -> bool:
        field = fields.get(name)
        return (
            value is None
            and field is not None
            and not field.is_required()
            and type(None) not in get_args(field.annotation)
        )

    return {name: value for name, value in body.items() if not absent(name, value)}


def _bad_field(errors: list[Any], body: dict) -> APIError:
    """A 400 naming the first bad field as the body spells it: pydantic's location also names the member of a
    union it tried (``input.str``) or a key (``[key]``), which is no field; such a field failed every form it takes."""
    for error in errors:  # a validator's own words, without pydantic's label for them
        error["msg"] = error["msg"].removeprefix("Value error, ")
    first = errors[0]
    where = _as_sent(first["loc"], body, missing=first["type"] == "missing")
    if not where:
        return APIError(first["msg"])
    param = ".".join(where)
    if first["type"] == "extra_forbidden":  # a route whose fields are all its own (the native API's)
        return APIError(f"{param}: no such field here", param=param)
    said = [e["msg"] for e in errors if tuple(str(p) for p in e["loc"][: len(where)]) == where]
    if len(where) < len(first["loc"]):
        detail = "; ".join(dict.fromkeys(said))  # each form's complaint, once
        kind = "key" if first["loc"][len(where)] == "[key]" else "none of the forms it takes"
        return APIError(f"{param}: {kind}: {detail}", param=param)
    return APIError(f"{param}: {first['msg']}", param=param)


def _as_sent(loc: tuple, body: Any, missing: bool) -> tuple[str, ...]:
    """The longest start of ``loc`` that names fields and items of ``body`` (and a missing field, last)."""
    path: list[str] = []
    for step in loc:
        if isinstance(body, dict) and step in body:
            body = body[step]
        elif isinstance(body, list) and isinstance(step, int) and 0 <= step < len(body):
            body = body[step]
        else:
            if missing and step == loc[-1] and isinstance(body, dict):
                path.append(str(step))
            break
        path.append(str(step))
    return tuple(path)


@contextmanager
def fields_as_sent(names: Mapping[str, str]) -> Iterator[None]:
    """The errors of the chat completion that a request of another API runs as, naming the fields its client sent
    (``names``: the chat's name of each, and that API's): the param's path becomes that field (a message's index in
    the chat counts the instructions and the stored history too: the input as a whole), and the other fields the
    message names are renamed too (a prompt too long names the prompt and max_tokens)."""
    try:
        yield
    except (APIError, InvalidParameter) as exc:
        error = exc if isinstance(exc, APIError) else APIError(str(exc), 400, param=exc.param, code=exc.code)
        field = (error.param or "").split(".")[0]
        if field not in names:
            raise
        message = error.message.replace(error.param, names[field], 1)
        for name, sent in names.items():
            if name != field:  # the param's own was renamed once, not in the prose ("at most 4 stop sequences")
                message = re.sub(rf"\b{re.escape(name)}\b", sent, message)
        raise APIError(message, error.status, names[field], error.code, error.headers) from None

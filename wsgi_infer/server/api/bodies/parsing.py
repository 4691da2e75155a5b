"""How a JSON body becomes a request: unknown fields are ignored, as OpenAI's server does; a field another API
defines that would change the output and that this server does not implement is a 400 naming it
(``refused``), never ignored; known fields with bad values give a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from ...errors import APIError


@dataclass(frozen=True)
class Refused:
    """Why a field is refused, and the values that change nothing (each another server's default): accepted."""

    reason: str
    neutral: tuple = ()

    def refuses(self, value: object) -> bool:
        return value is not None and value not in self.neutral


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore")
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
        return schema.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(f"{param}: {first['msg']}" if param else first["msg"], param=param) from None

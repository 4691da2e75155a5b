"""The request fields that constrain a choice's text, each API's way: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and the ``guided_*`` fields it replaced, llama-server's ``json_schema`` and ``grammar``
(GBNF). A request gives one of them at most."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool

from ....engine.sampling_params import StructuredOutput
from ...errors import APIError
from .parsing import Request


class JsonSchemaFormat(Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # json_object with a schema: the form llama-server and several hosted APIs honour (instructor sends it)
    schema_: dict | None = Field(None, alias="schema")

    def constraint(self) -> StructuredOutput | None:
        if self.type == "text":
            if self.schema_ is not None:
                raise APIError("response_format.schema needs type json_object or json_schema", param="response_format")
            return None
        if self.type == "json_object":
            return StructuredOutput("json", {"type": "object", **(self.schema_ or {})}, source="response_format")
        if self.json_schema is None:
            raise APIError("response_format.json_schema is required for type json_schema", param="response_format")
        # No schema: any JSON object, as OpenAI does.
        return StructuredOutput("json", self.json_schema.schema_ or {"type": "object"}, source="response_format")


class StructuredOutputs(Request):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None

    def constraint(self) -> StructuredOutput:
        given = {
            kind: value
            for kind, value in (
                ("json", self.json_),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        }
        if self.json_object:
            given["json"] = {"type": "object"}
        if len(given) != 1:
            raise APIError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                param="structured_outputs",
            )
        [(kind, value)] = given.items()
        return StructuredOutput(kind, value)


# the other fields, each one kind of constraint: vLLM's older ones, then llama-server's
KINDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "json_schema": "json",
    "grammar": "grammar",
}


class ConstraintFields(Request):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    json_schema: dict | None = None
    grammar: str | None = None

    @property
    def constraints_given(self) -> list[str]:
        return [name for name in ("response_format", "structured_outputs", *KINDS) if getattr(self, name) is not None]

    def constraint(self) -> StructuredOutput | None:
        """The one constraint given, or None; a 400 naming the second where several are."""
        given = self.constraints_given
        if len(given) > 1:
            raise APIError(f"give {given[0]} or {given[1]}, not both", param=given[1])
        if not given:
            return None
        name, value = given[0], getattr(self, given[0])
        return StructuredOutput(KINDS[name], value, source=name) if name in KINDS else value.constraint()

"""Structured outputs at the doors: OpenAI's `response_format` and vLLM's `structured_outputs`
extension, translated to the sampling dict's `structured_output` (engine/sampling_params.py:
exactly one of json, json_object, regex, choice, grammar, structural_tag, plus optional
disable_any_whitespace). The engine's grammar matcher enforces it; an invalid schema, regex or
grammar is refused when SamplingParams is built, and the door names the request field it came
from (`Constraint.param`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JsonSchemaSpec(_Strict):
    """response_format.json_schema: a named schema (strict is always enforced)."""

    name: str = Field(description="The schema's name (not used for decoding).")
    schema_: dict[str, Any] | bool | None = Field(
        None, alias="schema", description="The JSON schema the output must match."
    )
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")
    description: str | None = Field(None, description="Accepted, not used.")


class ResponseFormat(_Strict):
    """OpenAI's response_format: text, json_object, json_schema (or vLLM's structural_tag)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"] = Field(
        description="text: no constraint; json_object: any JSON object; json_schema: the "
        "schema in json_schema.schema; structural_tag (extension): an xgrammar structural tag."
    )
    json_schema: JsonSchemaSpec | None = Field(None, description="For type json_schema.")
    format: dict[str, Any] | None = Field(None, description="For type structural_tag.")

    @model_validator(mode="after")
    def _needs_its_part(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs response_format.json_schema")
        if self.type == "structural_tag" and self.format is None:
            raise ValueError("type 'structural_tag' needs response_format.format")
        return self


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs extension: one constraint (or only its options)."""

    json_: dict[str, Any] | str | None = Field(
        None, alias="json", description="A JSON schema (object or JSON text)."
    )
    json_object: bool | None = Field(None, description="Any JSON object.")
    regex: str | None = Field(None, description="A regular expression the output matches.")
    choice: list[str] | None = Field(None, min_length=1, description="One of these strings.")
    grammar: str | None = Field(None, description="An EBNF grammar (xgrammar's dialect).")
    structural_tag: dict[str, Any] | str | None = Field(
        None, description="An xgrammar structural tag (object or JSON text)."
    )
    disable_any_whitespace: bool = Field(
        False, description="JSON without whitespace between tokens (compact output)."
    )

    @model_validator(mode="after")
    def _one_kind(self) -> StructuredOutputs:
        given = [k for k in KINDS if self._value(k) not in (None, False)]
        if len(given) > 1:
            raise ValueError(f"give one constraint, got {', '.join(given)}")
        return self

    def _value(self, kind: str) -> Any:
        return getattr(self, "json_" if kind == "json" else kind)


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's output constraint: the sampling dict's value and the field it came from."""

    structured_output: dict
    param: str


def constraint(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputs | None,
    prefix: str = "",
) -> Constraint | None:
    """The constraint of a request (None: free text). Both fields may be given only when
    structured_outputs carries options alone (disable_any_whitespace). `prefix` names the
    fields' parent in errors (the Responses API's `text.format`)."""
    options = {}
    if structured_outputs is not None and structured_outputs.disable_any_whitespace:
        options["disable_any_whitespace"] = True
    own = _from_structured_outputs(structured_outputs) if structured_outputs else None
    given = _from_response_format(response_format, prefix) if response_format else None
    if own is not None and given is not None:
        raise ValueError("give either response_format or structured_outputs, not both")
    chosen = own or given
    if chosen is None:
        return None
    return Constraint({**chosen.structured_output, **options}, chosen.param)


def _from_response_format(rf: ResponseFormat, prefix: str) -> Constraint | None:
    where = prefix or "response_format"
    if rf.type == "json_object":
        return Constraint({"json_object": True}, where)
    if rf.type == "json_schema":
        spec = rf.json_schema
        if spec is None:  # the model's validator requires it for this type
            raise ValueError(f"type 'json_schema' needs {where}.json_schema")
        if spec.schema_ is None or spec.schema_ is True:  # no schema: any JSON object
            return Constraint({"json_object": True}, f"{where}.json_schema")
        param = f"{where}.schema" if prefix else f"{where}.json_schema.schema"
        return Constraint({"json": spec.schema_}, param)
    if rf.type == "structural_tag":
        return Constraint(
            {"structural_tag": {"type": "structural_tag", "format": rf.format}}, f"{where}.format"
        )
    return None


def _from_structured_outputs(so: StructuredOutputs) -> Constraint | None:
    for kind in KINDS:
        value = so._value(kind)
        if value not in (None, False):
            return Constraint({kind: value}, f"structured_outputs.{kind}")
    return None

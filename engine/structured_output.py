"""StructuredOutput: the constraint a request's output must match, as data.

Exactly one kind is set: `json` (a JSON schema), `json_object` (any JSON object), `regex`,
`choice` (one of these strings), `grammar` (EBNF in xgrammar's GBNF dialect) or
`structural_tag` (xgrammar's structural tag JSON, for tool calls). Construction checks the
grammar without a tokenizer (xgrammar parses it; results cached by spec), so a bad schema is
an InvalidRequestError naming the field at the door, never a worker failure. The engine
compiles it against its vocabulary (engine/grammar.py).
"""

from __future__ import annotations

import functools
import json as json_lib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from engine.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# json / json_object with whitespace allowed: most whitespace characters in a row (room for a
# newline and the indentation of 7 levels of 2 spaces, none for the endless whitespace a weak
# model falls into when the grammar allows it, which would run every reply to max_tokens).
MAX_WHITESPACE_RUN = 16
# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: ".
_XGRAMMAR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One output constraint (exactly one kind set); hashable, so it keys grammar caches.

    json and structural_tag hold JSON text (a dict given is dumped, key order kept: it is the
    order properties are generated in).
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False  # json / json_object: no whitespace between tokens

    def __post_init__(self) -> None:
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _json_text(name, value))
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, list | tuple):
                raise _bad("choice", "must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        self._validate()

    @classmethod
    def of(cls, value: StructuredOutput | Mapping[str, Any]) -> StructuredOutput:
        """A StructuredOutput from itself or a dict of its fields (unknown keys named)."""
        if isinstance(value, StructuredOutput):
            return value
        if not isinstance(value, Mapping):
            raise InvalidRequestError(
                f"structured_output must be an object with one of {', '.join(KINDS)}; "
                f"got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(
                f"structured_output has unknown field(s) {unknown}; known: {sorted(known)}"
            )
        return cls(**value)

    @property
    def kind(self) -> str:
        """The name of the one constraint that is set."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def text(self) -> str:
        """The text of a json, regex, grammar or structural_tag spec (its kind's field)."""
        value = getattr(self, self.kind)
        if not isinstance(value, str):
            raise ValueError(f"structured_output.{self.kind} has no text")
        return value

    def to_dict(self) -> dict[str, Any]:
        """Plain values (msgpack-able) that of() turns back into this spec."""
        out: dict[str, Any] = {self.kind: getattr(self, self.kind)}
        if self.choice is not None:
            out["choice"] = list(self.choice)
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        return out

    def choice_ebnf(self) -> str:
        """The grammar of `choice`: root ::= "a" | "b" (JSON escapes are GBNF escapes)."""
        return "root ::= " + " | ".join(json_lib.dumps(s) for s in self.choice or ())

    def json_options(self) -> dict[str, Any]:
        """xgrammar's whitespace options for json / json_object: none between tokens, or at
        most MAX_WHITESPACE_RUN characters in a row."""
        if self.disable_any_whitespace:
            return {"any_whitespace": False}
        return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE_RUN}

    def tag_format(self) -> dict[str, Any]:
        """This constraint as an xgrammar structural-tag format, to nest inside a larger tag
        (e.g. "a tool call or this format"): the same language the engine compiles for the
        spec alone (engine/grammar.py), options included, as a `grammar` element."""
        import xgrammar as xgr  # imports torch and a native library: only when asked

        match self.kind:
            case "json":
                grammar = xgr.Grammar.from_json_schema(self.text(), **self.json_options())
            case "json_object":
                grammar = xgr.Grammar.from_json_schema(
                    '{"type": "object"}', strict_mode=False, **self.json_options()
                )
            case "regex":
                grammar = xgr.Grammar.from_regex(self.text())
            case "choice":
                return {"type": "grammar", "grammar": self.choice_ebnf()}
            case "grammar":
                return {"type": "grammar", "grammar": self.grammar}
            case _:  # structural_tag
                tag = json_lib.loads(self.text())
                if "format" in tag:
                    return tag["format"]
                grammar = xgr.Grammar.from_structural_tag(self.text())
        return {"type": "grammar", "grammar": str(grammar)}

    def _validate(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidRequestError(
                f"structured_output must set exactly one of {', '.join(KINDS)}; "
                f"got {set_kinds or 'none'}"
            )
        if not isinstance(self.json_object, bool):
            raise _bad("json_object", "must be true or false")
        if not isinstance(self.disable_any_whitespace, bool):
            raise _bad("disable_any_whitespace", "must be true or false")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _bad(name, "must be a non-empty string")
        if self.choice is not None and (
            not self.choice or not all(isinstance(s, str) and s for s in self.choice)
        ):
            raise _bad("choice", "must be a non-empty list of non-empty strings")
        kind = set_kinds[0]
        if kind != "json_object":
            text = self.choice_ebnf() if kind == "choice" else getattr(self, kind)
            problem = _grammar_problem("grammar" if kind == "choice" else kind, text)
            if problem is not None:
                raise _bad(kind, f"invalid {_WHAT[kind]}: {problem}")


_WHAT = {
    "json": "JSON schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}


def _bad(name: str, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"structured_output.{name}: {problem}")


def _json_text(name: str, value: Any) -> str:
    """JSON text of a dict, or of a string that parses as a JSON object."""
    if isinstance(value, str):
        try:
            value = json_lib.loads(value)
        except ValueError as exc:
            raise _bad(name, f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise _bad(name, f"must be a JSON object, got {type(value).__name__}")
    try:
        return json_lib.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise _bad(name, f"is not valid JSON: {exc}") from None


@functools.lru_cache(maxsize=512)
def _grammar_problem(kind: str, text: str) -> str | None:
    """Why xgrammar rejects this grammar (no tokenizer involved), or None; cached by spec."""
    import xgrammar as xgr  # imports torch and a native library: only when a spec is given

    builders: dict[str, Callable[[str], object]] = {
        "json": xgr.Grammar.from_json_schema,
        "regex": xgr.Grammar.from_regex,
        "grammar": xgr.Grammar.from_ebnf,
        "structural_tag": xgr.Grammar.from_structural_tag,
    }
    build = builders[kind]
    try:
        build(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        message = _XGRAMMAR_PREFIX.sub("", str(exc)).strip()
        return message.splitlines()[0] if message else type(exc).__name__
    return None

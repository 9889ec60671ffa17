"""The tool protocol: a named function with an OpenAI-style JSON schema for its arguments.

Calling a tool never raises. Arguments are validated with `jsonschema` first; the
function's own rejections (`ToolError`) and any unexpected exception become a typed
error result that an agent can read and act on.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Mapping

import jsonschema

# The error types an agent can see. Kept as plain strings so that results serialise.
MALFORMED_ARGUMENTS = "malformed_arguments"
UNKNOWN_TOOL = "unknown_tool"
INVALID_VALUE = "invalid_value"
NOT_FOUND = "not_found"
TOOL_FAILURE = "tool_failure"
TIMEOUT = "timeout"
ERROR_TYPES = (MALFORMED_ARGUMENTS, UNKNOWN_TOOL, INVALID_VALUE, NOT_FOUND, TOOL_FAILURE, TIMEOUT)

# Bounds on what we echo back into an agent's context.
_MAX_MESSAGE_CHARS = 400


class ToolError(Exception):
    """Raised inside a tool function to return a typed error instead of content."""

    def __init__(self, error_type: str, message: str):
        if error_type not in ERROR_TYPES:
            raise ValueError(f"unknown tool error type {error_type!r}; expected one of {ERROR_TYPES}")
        super().__init__(message)
        self.error_type = error_type
        self.message = message


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What one call returned: `content` (JSON-serialisable) or an `error_type` with a `message`."""

    name: str
    content: Any = None
    error_type: str | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.error_type is None

    def to_json(self) -> dict:
        """The observation shown to an agent in the think+tool_call format."""
        if self.ok:
            return {"name": self.name, "content": self.content}
        return {"name": self.name, "error": {"type": self.error_type, "message": self.message}}

    def as_text(self) -> str:
        """A one-line rendering (used for SWiRL's `QUERY -> RESULT`)."""
        if self.ok:
            return self.content if isinstance(self.content, str) else json.dumps(self.content, ensure_ascii=False)
        return f"Error ({self.error_type}): {self.message}"


def error_result(name: str, error_type: str, message: str) -> ToolResult:
    return ToolResult(name=name, error_type=error_type, message=_clip(message))


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[: _MAX_MESSAGE_CHARS - 3] + "..."


def _describe_validation_error(error: jsonschema.ValidationError) -> str:
    where = "/".join(str(p) for p in error.absolute_path) or "arguments"
    return f"argument '{where}': {error.message}"


@dataclasses.dataclass(frozen=True)
class Tool:
    """A named function whose keyword arguments are described by a JSON schema (`parameters`).

    `fn(**arguments)` returns JSON-serialisable content or raises `ToolError`.
    `timeout_s` is the per-call limit the registry enforces (None: the registry default).
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., Any] = dataclasses.field(compare=False, repr=False)
    timeout_s: float | None = None

    @property
    def openai_schema(self) -> dict:
        """The OpenAI function-calling description that chat templates take as `tools=`."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }

    def validation_error(self, arguments: Any) -> str | None:
        """None when `arguments` satisfy the schema, else a message naming the offending field."""
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, got {type(arguments).__name__}"
        validator = jsonschema.Draft202012Validator(self.parameters)
        errors = sorted(validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
        return _describe_validation_error(errors[0]) if errors else None

    def __call__(self, arguments: Any) -> ToolResult:
        """Validate and run synchronously (no time limit: the registry adds one)."""
        problem = self.validation_error(arguments)
        if problem is not None:
            return error_result(self.name, MALFORMED_ARGUMENTS, problem)
        try:
            content = self.fn(**arguments)
        except ToolError as err:
            return error_result(self.name, err.error_type, err.message)
        except Exception as err:  # a bug or an unforeseen input: still an observation, never a crash
            return error_result(self.name, TOOL_FAILURE, f"{type(err).__name__}: {err}")
        return ToolResult(name=self.name, content=content)


def object_schema(properties: Mapping[str, Any], required: tuple[str, ...] | list[str] | None = None) -> dict:
    """A strict object schema: listed properties, all required unless told, no extras."""
    return {
        "type": "object",
        "properties": dict(properties),
        "required": list(properties if required is None else required),
        "additionalProperties": False,
    }


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One requested call. `arguments` is whatever the agent wrote (validated at execution)."""

    name: str
    arguments: Any = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return {"name": self.name, "arguments": self.arguments}

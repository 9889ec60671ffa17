"""OpenAI chat messages <-> prompt text and tool calls, for a tokenizer's chat template.

In: messages (system/user/assistant/tool, assistant `tool_calls`) and optional `tools` (OpenAI
function schemas), rendered by `steprl_jax.models.chat.apply_chat`. For templates that have no place
for assistant tool calls (e.g. SmolLM2's plain ChatML), earlier calls are written into the text as
`<tool_call>[...]</tool_call>`, the format our agents use.

Out: `<tool_call>` blocks in the generated text (a JSON object or a list of them, each
{"name", "arguments"}) become OpenAI `tool_calls`.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any, Mapping, Sequence

from steprl_jax.models.chat import apply_chat

TOOL_CALL_OPEN = "<tool_call>"
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class RequestError(ValueError):
    """The request is malformed; the message names the field (and `param`, when given, is its name)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _text_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text is supported
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content: only text content parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"{where}.content must be a string or a list of text parts")


def _call_json(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise RequestError(f"{where}: each tool call needs function.name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
            pass  # keep the string as the model wrote it
    return {"name": function["name"], "arguments": arguments}


def normalize_messages(messages: Any, inline_tool_calls: bool) -> list[dict]:
    """Validated plain messages; with `inline_tool_calls`, assistant tool calls are written into the text."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping) or message.get("role") not in ("system", "developer", "user",
                                                                          "assistant", "tool"):
            raise RequestError(f"{where}.role must be system, developer, user, assistant or tool")
        role = "system" if message["role"] == "developer" else message["role"]
        content = _text_content(message.get("content"), where)
        plain: dict = {"role": role, "content": content}
        calls = message.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, list):
                raise RequestError(f"{where}.tool_calls: only assistant messages carry a list of tool calls")
            parsed = [_call_json(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
            if inline_tool_calls:
                plain["content"] = content + f"<tool_call>{json.dumps(parsed, ensure_ascii=False)}</tool_call>"
            else:
                plain["tool_calls"] = [{"type": "function", "function": c} for c in parsed]
        if role == "tool" and message.get("name"):
            plain["name"] = message["name"]
        out.append(plain)
    return out


def render_prompt(tokenizer, messages: Any, tools: Sequence[Mapping] | None = None) -> str:
    """The prompt text for `messages` (and `tools`), ending where the assistant's reply begins.

    Rendering is `models.chat.apply_chat`, the same as the rollouts use: the checkpoint's template
    (tools in the system message when the template has no place for them), or the generic one.
    """
    template = getattr(tokenizer, "chat_template", None)
    native_calls = isinstance(template, str) and "tool_calls" in template
    messages = normalize_messages(messages, inline_tool_calls=not native_calls)
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)):
        raise RequestError("tools must be a list of objects")
    try:
        return apply_chat(tokenizer, messages, tools=list(tools) if tools else None, tokenize=False)
    except Exception as error:  # e.g. a template that only accepts alternating user/assistant turns
        raise RequestError(f"the model's chat template rejected the messages: {error}") from None


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(content without the tool-call blocks, OpenAI tool_calls); no calls when any block is not valid JSON."""
    blocks = _TOOL_CALL_BLOCK.findall(text)
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        try:
            value = json.loads(block)
        except (ValueError, RecursionError):
            return text, []
        for call in value if isinstance(value, list) else [value]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, []
            arguments = call.get("arguments", {})
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": call["name"],
                                       "arguments": arguments if isinstance(arguments, str)
                                       else json.dumps(arguments, ensure_ascii=False)}})
    return _TOOL_CALL_BLOCK.sub("", text).strip(), calls

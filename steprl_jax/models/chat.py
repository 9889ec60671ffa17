"""Chat prompts: the checkpoint's own template, or a documented generic rendering.

`apply_chat(tokenizer, messages, tools=None)` renders OpenAI-style messages
(`{"role": "system"|"user"|"assistant"|"tool", "content": str}`) to token ids.

* The tokenizer has a chat template that uses `tools`: the template renders the
  tool definitions itself (`apply_chat_template(..., tools=tools)`).
* The template ignores `tools` (SmolLM2's, for one): the definitions are put in
  the system message by `render_tools` (merged into the first system message, or
  as a new first one) and the template renders the rest.
* No template (Gemma 3 270M base): `GENERIC_TEMPLATE` below, Gemma-style turns
  when the vocabulary has `<start_of_turn>`/`<end_of_turn>`, else ChatML when it
  has `<|im_start|>`/`<|im_end|>`, else plain "Role: text" lines. System text
  goes before the first user turn, "tool" messages become user turns wrapped in
  <tool_response>...</tool_response>, and a generation prompt opens the
  assistant turn. The rendered text starts with the BOS token when the
  tokenizer adds one to plain text.

Tool definitions are OpenAI function schemas:
`{"type": "function", "function": {"name", "description", "parameters": <JSON schema>}}`.
Calls are expected back as `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`
(a JSON list, the format of steprl_jax.tools.formats).

`render_tools(tools, rendering)` writes the system-prompt listing in one of two renderings:
"json" (one JSON schema a line, what the template path above uses) or "compact" (one line a
tool, `name(arg: type, optional_arg?: type) - description`: for the tool world's 23 tools,
1,284 SmolLM2 tokens against 3,251, for small contexts and small models).
"""
from __future__ import annotations

import json
from typing import Optional, Sequence

TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query.\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n"
    "To call functions, return a JSON list of objects with function name and arguments within "
    "<tool_call></tool_call> XML tags (independent calls go in the same list):\n"
    "<tool_call>[{{\"name\": <function-name>, \"arguments\": <args-json-object>}}]</tool_call>"
)

_GEMMA_TURNS = """{{ bos }}{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] + '\n\n' -%}
{%- else -%}
{%- set role = 'model' if m['role'] == 'assistant' else 'user' -%}
{%- set text = '<tool_response>\n' + m['content'] + '\n</tool_response>' if m['role'] == 'tool' else m['content'] -%}
{{ '<start_of_turn>' + role + '\n' + ns.system + text + '<end_of_turn>\n' }}{%- set ns.system = '' -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"""

_CHATML = """{{ bos }}{%- for m in messages -%}
{%- set text = '<tool_response>\n' + m['content'] + '\n</tool_response>' if m['role'] == 'tool' else m['content'] -%}
{%- set role = 'user' if m['role'] == 'tool' else m['role'] -%}
{{ '<|im_start|>' + role + '\n' + text + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"""

_PLAIN = """{{ bos }}{%- for m in messages -%}
{%- set text = '<tool_response>\n' + m['content'] + '\n</tool_response>' if m['role'] == 'tool' else m['content'] -%}
{%- set role = 'User' if m['role'] == 'tool' else m['role'] | capitalize -%}
{{ role + ': ' + text + '\n\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}"""


# Tokens that end an assistant turn in the chat formats of our families.
END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>")


def end_of_turn_id(tokenizer) -> int:
    """The id a policy writes to end its turn: the chat format's end-of-turn token, else eos."""
    vocab = tokenizer.get_vocab()
    for token in END_OF_TURN:
        if token in vocab:
            return int(vocab[token])
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no end-of-turn token and no eos token")
    return int(tokenizer.eos_token_id)


def generic_template(tokenizer) -> str:
    """The generic chat template for a tokenizer without one (see the module docstring)."""
    vocab = tokenizer.get_vocab()
    if "<start_of_turn>" in vocab and "<end_of_turn>" in vocab:
        return _GEMMA_TURNS
    if "<|im_start|>" in vocab and "<|im_end|>" in vocab:
        return _CHATML
    return _PLAIN


COMPACT_TOOLS_PREAMBLE = (
    "You can call these tools, one per line as name(argument: type, optional_argument?: type) - what it does:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call tools, write a JSON list of calls within <tool_call></tool_call> tags, exactly like this "
    "(independent calls go in the same list):\n"
    "<tool_call>[{{\"name\": ..., \"arguments\": {{...}}}}]</tool_call>\n"
    "Each call has exactly the keys \"name\" (a tool above) and \"arguments\" (an object of its arguments)."
)
TOOL_RENDERINGS = ("json", "compact")


def render_tools(tools: Sequence[dict], rendering: str = "json") -> str:
    """The system-prompt text that lists `tools` (used where the template cannot, or for "compact")."""
    if rendering == "json":
        return TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t, sort_keys=True) for t in tools))
    if rendering == "compact":
        return COMPACT_TOOLS_PREAMBLE.format(tools="\n".join(compact_tool_line(t) for t in tools))
    raise ValueError(f"tool rendering must be one of {TOOL_RENDERINGS}, got {rendering!r}")


def compact_tool_line(tool: dict) -> str:
    """`name(arg: type, optional_arg?: type) - description` for one OpenAI function schema.

    Required arguments first, in schema order; enums are listed as their JSON values joined by
    `|`; an argument's description follows its type in parentheses. Other JSON-schema keywords
    (lengths, patterns, bounds, additionalProperties) are left out: the registry still
    validates them and says what was wrong."""
    function = tool.get("function", tool)
    parameters = function.get("parameters") or {}
    properties = parameters.get("properties") or {}
    required = [n for n in parameters.get("required", []) if n in properties]
    optional = [n for n in properties if n not in required]
    args = [_compact_argument(n, properties[n], n not in required) for n in required + optional]
    line = f"{function['name']}({', '.join(args)})"
    description = (function.get("description") or "").strip()
    return f"{line} - {description}" if description else line


def _compact_argument(name: str, schema: dict, optional: bool) -> str:
    text = f"{name}{'?' if optional else ''}: {_compact_type(schema)}"
    description = (schema.get("description") or "").strip()
    return f"{text} ({description})" if description else text


def _compact_type(schema: dict) -> str:
    if "enum" in schema:
        return "|".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    kind = schema.get("type", "any")
    if isinstance(kind, list):
        return "|".join(kind)
    if kind == "array" and isinstance(schema.get("items"), dict):
        return f"array of {_compact_type(schema['items'])}"
    return kind


def template_supports_tools(tokenizer) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and "tools" in template


def apply_chat(tokenizer, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None,
               add_generation_prompt: bool = True, tokenize: bool = True):
    """Token ids (list of int) of the chat prompt, or its text when `tokenize=False`."""
    messages = [dict(m) for m in messages]
    for i, m in enumerate(messages):
        if "role" not in m or "content" not in m:
            raise ValueError(f"message {i} needs 'role' and 'content', got keys {sorted(m)}")
    has_template = bool(tokenizer.chat_template)
    if tools and not (has_template and template_supports_tools(tokenizer)):
        messages = _with_tools_in_system(messages, tools)
        tools = None
    kwargs = {}
    if not has_template:
        kwargs["chat_template"] = generic_template(tokenizer)
        kwargs["bos"] = tokenizer.bos_token if _adds_bos(tokenizer) else ""
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, **kwargs)
    if not tokenize:
        return text
    # The template already wrote every special token (BOS included) it wants.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _with_tools_in_system(messages: list, tools) -> list:
    preamble = render_tools(tools)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=messages[0]["content"] + "\n\n" + preamble)
        return [first] + messages[1:]
    return [{"role": "system", "content": preamble}] + messages


def _adds_bos(tokenizer) -> bool:
    if tokenizer.bos_token_id is None:
        return False
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_level_tokenizer(chat_template: Optional[str] = CHATML_TEMPLATE, extra_tokens: Sequence[str] = ()):
    """A tokenizer that needs no checkpoint: byte-level BPE without merges (256 byte tokens, ids
    0-255), then ChatML's `<|im_start|>` / `<|im_end|>` (the end of a turn, eos and pad), then
    `extra_tokens`. For tiny random models in tests and quick runs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        pad_token="<|im_end|>")
    if extra_tokens:
        tokenizer.add_tokens(list(extra_tokens))
    tokenizer.chat_template = chat_template
    return tokenizer

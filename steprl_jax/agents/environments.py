"""Environments: what a step means in each action format.

An environment turns a task into the first chat messages, says which strings end an
action, and turns one generated action into tool calls, an observation text and
(possibly) a final answer. It never raises on what the model wrote: a malformed
action becomes an error observation (or ends the episode, by policy).

* `TaggedEnv` — SWiRL: `<search_query>`, `<math_exp>`, `<answer>`; one tool call or one
  answer per action; the observation `QUERY -> RESULT` continues the same assistant turn.
* `ToolCallEnv` — PORTool: `<think>...</think><tool_call>[...]</tool_call>`; several
  independent calls per step, run concurrently; the observation is a tool message,
  rendered by the checkpoint's chat template; `response_gen(answer)` ends the episode.
* `CodeEnv` (agents/code_env.py) — ToRL: reasoning with ```python blocks run at ```output.

An environment may set `max_tool_calls`: the tool calls one episode may make (the rollout runs
none past it, and hands `outcome` the results of those it ran).
"""
from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any, Callable, Optional, Sequence

from steprl_jax.tools import formats
from steprl_jax.tools.protocol import MALFORMED_ARGUMENTS, ToolCall, ToolResult, error_result
from steprl_jax.tools.registry import ToolRegistry


MAX_RESULT_CHARS = 4000  # a tool result longer than this reaches the agent truncated, with a marker


def clip_result(result: ToolResult, max_chars: int = MAX_RESULT_CHARS) -> ToolResult:
    """A result whose content fits in `max_chars` characters of text; longer content is cut and marked.

    A tool that returns megabytes must not flood the context (or the records)."""
    if not result.ok:
        return result
    text = result.content if isinstance(result.content, str) else json.dumps(result.content, ensure_ascii=False)
    if len(text) <= max_chars:
        return result
    clipped = f"{text[:max_chars]}... [truncated: {len(text) - max_chars} more characters]"
    return dataclasses.replace(result, content=clipped)


@dataclasses.dataclass(frozen=True)
class Task:
    """One query: an id, the question, the reference answer (may be None) and free metadata."""

    id: str
    question: str
    reference: Any = None
    metadata: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ActionOutcome:
    kind: str  # "search" | "math" | "answer" | "tool_call" | "invalid"; the code formats: "code" | "text" | "void"
    calls: list[ToolCall]
    results: list[ToolResult]
    observation_text: str
    final_answer: Optional[str]
    problems: list[str]
    format_checks: dict
    # The episode ends after this action even without a final answer (the code format: a response
    # that ended without asking for output); a final answer always ends it.
    ends_episode: bool = False


_SWIRL_ACTIONS = {
    "calculator": "<math_exp>EXPRESSION</math_exp> to use a calculator (for example <math_exp>48 / 2</math_exp>),\n",
    "search": "<search_query>QUERY</search_query> to search an encyclopedia,\n",
}


def demonstrated_messages(system_prompt: str, examples: Sequence, question: str) -> list[dict]:
    """The system prompt, each worked example (a `Demonstration`) as an earlier user/assistant
    exchange whose assistant turn holds its actions and observations, then the question."""
    messages = [{"role": "system", "content": system_prompt}]
    for demo in examples:
        messages.append({"role": "user", "content": demo.prompt})
        messages.append({"role": "assistant", "content": "".join(s.action + s.observation for s in demo.steps)})
    return messages + [{"role": "user", "content": question}]


def swirl_system_prompt(tools: Sequence[str]) -> str:
    """SWiRL's instructions, listing only the tools that are available."""
    return ("You solve problems step by step with tools. In each step, think briefly, then write exactly one "
            "action:\n" + "".join(_SWIRL_ACTIONS[t] for t in tools if t in _SWIRL_ACTIONS)
            + "<answer>ANSWER</answer> to give the final answer (a short phrase or a number).\n"
            "After a tool action its result is shown as `QUERY -> RESULT`; then continue.")


SWIRL_SYSTEM_PROMPT = swirl_system_prompt(("calculator", "search"))

TOOL_CALL_SYSTEM_PROMPT = (
    "You are an assistant that answers with tools. In each step write <think>your reasoning</think> then "
    "<tool_call>[{\"name\": TOOL, \"arguments\": {...}}, ...]</tool_call> with one or more independent calls. "
    "Tool results come back in <tool_response>. Give the final answer by calling response_gen "
    "with {\"answer\": ...}. If the tools cannot provide what is needed, say so in response_gen."
)


class TaggedEnv:
    """SWiRL's tag format with a calculator and/or a search tool from `registry`."""

    format = "tags"
    stop_strings = ("</search_query>", "</math_exp>", "</answer>")
    _TOOL_FOR_KIND = {"math": ("calculator", "expression"), "search": ("search", "query")}

    def __init__(self, registry: ToolRegistry, system_prompt: Optional[str] = None,
                 invalid_action: str = "error_observation", examples: Sequence = ()):
        """`examples`: worked demonstrations (`Demonstration`s in the tag format) shown before the
        question as earlier user/assistant turns; small models need them to follow the format."""
        if invalid_action not in ("error_observation", "end"):
            raise ValueError(f"invalid_action must be 'error_observation' or 'end', got {invalid_action!r}")
        self.registry = registry
        self.system_prompt = system_prompt or swirl_system_prompt(registry.names)
        self.invalid_action = invalid_action
        self.examples = tuple(examples)

    def messages(self, task: Task) -> list[dict]:
        return demonstrated_messages(self.system_prompt, self.examples, task.question)

    def tool_schemas(self, task: Task) -> Optional[list[dict]]:
        return None  # the tags are explained in the system prompt

    def registry_for(self, task: Task) -> ToolRegistry:
        return self.registry

    def release(self, task: Task) -> None:
        pass

    def parse(self, action_text: str):
        return formats.parse_tagged_action(action_text)

    def calls_for(self, parsed) -> list[ToolCall]:
        if parsed.kind in self._TOOL_FOR_KIND and "unclosed_tag" not in parsed.problems:
            name, arg = self._TOOL_FOR_KIND[parsed.kind]
            return [ToolCall(name, {arg: parsed.content})]
        return []

    def outcome(self, task: Task, parsed, results: Sequence[ToolResult]) -> ActionOutcome:
        problems = list(parsed.problems)
        if parsed.kind == "answer" and "unclosed_tag" not in problems:
            return ActionOutcome("answer", [], [], "", parsed.content, problems, {})
        calls = self.calls_for(parsed)
        if calls:
            observation = formats.render_tagged_observation(parsed.content, results[0])
            return ActionOutcome(parsed.kind, calls, list(results), observation, None, problems, {})
        observation = ("\nError: no complete action found. Write exactly one of <math_exp>...</math_exp>, "
                       "<search_query>...</search_query> or <answer>...</answer>.\n")
        return ActionOutcome("invalid", [], [], observation, None, problems or ["no_action"], {})

    def observation_ids(self, tokenizer, text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False) if text else []


class ToolCallEnv:
    """PORTool's think + tool_call format over a registry of function tools (e.g. the tool world)."""

    format = "tool_call"
    stop_strings = ("</tool_call>",)

    def __init__(self, registry: Optional[ToolRegistry] = None, *,
                 registry_factory: Optional[Callable[[Task], ToolRegistry]] = None,
                 system_prompt: str = TOOL_CALL_SYSTEM_PROMPT, invalid_action: str = "error_observation",
                 examples: Sequence[Sequence[dict]] = (), tool_rendering: str = "json"):
        """`registry` serves every task; `registry_factory(task)` instead builds one per task
        (the tool world's tools depend on the episode's "now" and location). `examples`: worked
        demonstrations as chat messages (user, assistant, tool, ...) shown before the question.
        `tool_rendering`: "json" gives the schemas to the chat template (`tool_schemas`; a
        template that ignores them gets them as JSON in the system message, `chat.apply_chat`);
        "compact" lists the tools one line each in the system message itself
        (`chat.render_tools(..., "compact")`) and gives the template none."""
        from steprl_jax.models.chat import TOOL_RENDERINGS

        if invalid_action not in ("error_observation", "end"):
            raise ValueError(f"invalid_action must be 'error_observation' or 'end', got {invalid_action!r}")
        if (registry is None) == (registry_factory is None):
            raise ValueError("give exactly one of registry and registry_factory")
        if tool_rendering not in TOOL_RENDERINGS:
            raise ValueError(f"tool_rendering must be one of {TOOL_RENDERINGS}, got {tool_rendering!r}")
        self.tool_rendering = tool_rendering
        self.registry = registry
        self.registry_factory = registry_factory
        self.system_prompt = system_prompt
        self.invalid_action = invalid_action
        self.examples = tuple(tuple(e) for e in examples)
        self._registries: dict = {}
        self._lock = threading.Lock()
        self._suffix_cache: dict = {}

    def registry_for(self, task: Task) -> ToolRegistry:
        if self.registry is not None:
            return self.registry
        with self._lock:
            if task.id not in self._registries:
                self._registries[task.id] = self.registry_factory(task)
            return self._registries[task.id]

    def release(self, task: Task) -> None:
        """Close a per-task registry once all of the task's episodes are done."""
        with self._lock:
            registry = self._registries.pop(task.id, None)
        if registry is not None:
            registry.close()

    def messages(self, task: Task) -> list[dict]:
        context = task.metadata.get("context")
        user = task.question if not context else f"{context}\n\n{task.question}"
        shown = [dict(m) for example in self.examples for m in example]
        system = self.system_prompt
        if self.tool_rendering == "compact":
            from steprl_jax.models.chat import render_tools

            system = f"{system}\n\n{render_tools(self.registry_for(task).openai_schemas(), 'compact')}"
        return [{"role": "system", "content": system}, *shown, {"role": "user", "content": user}]

    def tool_schemas(self, task: Task) -> Optional[list[dict]]:
        """The schemas for the chat template; None when the system message lists the tools ("compact")."""
        if self.tool_rendering == "compact":
            return None
        return self.registry_for(task).openai_schemas()

    def parse(self, action_text: str):
        return formats.parse_tool_call_step(action_text)

    def calls_for(self, parsed) -> list[ToolCall]:
        return list(parsed.executed_calls) if parsed.has_tool_call else []

    def outcome(self, task: Task, parsed, results: Sequence[ToolResult]) -> ActionOutcome:
        calls = self.calls_for(parsed)
        checks = formats.formatting_checks(parsed, self.registry_for(task), list(results) if calls else None)
        answer = parsed.final_answer
        if answer is not None:
            if not calls:  # only response_gen: executing it is trivially fine
                checks = {**checks, "known_tools": True, "valid_arguments": True, "executed_ok": True}
            return ActionOutcome("answer", calls, list(results), "", answer, list(parsed.problems), checks)
        refused = self._refused_answers(task, parsed)
        if calls:
            observation = formats.render_tool_responses([*results, *refused])
            return ActionOutcome("tool_call", calls, list(results), observation, None, list(parsed.problems), checks)
        if refused:  # a well-formed step whose answer call has no string answer: say which argument
            return ActionOutcome("invalid", [], [], formats.render_tool_responses(refused), None,
                                 list(parsed.problems) or ["bad_answer_arguments"], checks)
        problems = list(parsed.problems) or ["empty_call_list"]
        observation = ("<tool_response>[{\"error\": {\"type\": \"malformed_step\", \"message\": \"no valid "
                       "tool call found: write <think>...</think><tool_call>[{\\\"name\\\": ..., "
                       "\\\"arguments\\\": {...}}]</tool_call>\"}}]</tool_response>")
        return ActionOutcome("invalid", [], [], observation, None, problems, checks)

    def _refused_answers(self, task: Task, parsed) -> list[ToolResult]:
        """An error result for each `response_gen` call without a string `answer` (it neither
        ends the episode nor runs), naming the argument at fault as any other tool's would."""
        registry = self.registry_for(task)
        refused = []
        for call in parsed.calls:
            if call.name != formats.TERMINAL_TOOL:
                continue
            problem = registry.validation_error(call.to_json()) if call.name in registry else None
            refused.append(error_result(call.name, MALFORMED_ARGUMENTS,
                                        problem or "argument 'answer': the final answer, a string, is required"))
        return refused

    def observation_ids(self, tokenizer, text: str) -> list[int]:
        """The tool message as the chat template renders it after an assistant turn.

        The action was cut at `</tool_call>`, so the tokens closing the assistant turn and
        opening the next one belong to the observation (they are masked out in training).
        """
        if not text:
            return []
        before, after = self._template_suffix(tokenizer)
        return tokenizer.encode(before + text + after, add_special_tokens=False)

    def _template_suffix(self, tokenizer):
        key = id(tokenizer)
        if key not in self._suffix_cache:
            self._suffix_cache[key] = observation_frame(tokenizer)
        return self._suffix_cache[key]


_ACTION_SENTINEL = "\u2063ACTION\u2063"
_TOOL_SENTINEL = "\u2063TOOL\u2063"


def observation_frame(tokenizer) -> tuple[str, str]:
    """(text before, text after) a tool message's content, between two assistant turns.

    Read off the tokenizer's own chat template with sentinels; without a template (or
    when it drops tool messages) a plain rendering is used:
    "\\n<tool_response>...</tool_response>\\n".
    """
    template = getattr(tokenizer, "chat_template", None)
    if template:
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "q"}, {"role": "assistant", "content": _ACTION_SENTINEL},
                 {"role": "tool", "content": _TOOL_SENTINEL}],
                tokenize=False, add_generation_prompt=True)
        except Exception:  # a template that refuses the tool role: fall back below
            text = ""
        if _ACTION_SENTINEL in text and _TOOL_SENTINEL in text:
            after_action = text.split(_ACTION_SENTINEL, 1)[1]
            before, after = after_action.split(_TOOL_SENTINEL, 1)
            return before, after
    return "\n", "\n"

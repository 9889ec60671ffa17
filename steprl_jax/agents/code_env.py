"""ToRL's environment: reasoning with inline Python blocks in one assistant turn (format "code").

The action format is tools/code_format.py's. An action that stops at ```output has its last
complete python block run by the `python` tool (a fresh sandbox per run: stateless, as ToRL's);
the observation "\\n{output}\\n```\\n" continues the SAME assistant turn (as `TaggedEnv`'s does) and,
as every observation, is masked from the loss, while the stop string ```output stays in the trained
action, as in ToRL. The output is shown by ToRL's rules (`code_format.format_output`).

At most `max_tool_calls` runs per response (C; ToRL's script sets 1). After them an action that
stops at ```output is not run and gets an EMPTY observation, so the next generation call simply
continues the text: token for token what ToRL does when it drops the stop string for its last
call (the rollout enforces the budget: agents/rollout.py). An action that stops at ```output
without a complete block is an error observation (past the budget too); unlike ToRL, which appends
"\n" and spends a call, it spends none. Each ```output ends an action, so `rollout.max_steps`
bounds the runs plus the stops after them; ToRL has no such cap, only its response tokens.
ToRL also puts a newline before ```output when the text before it has none; the sampler has
already written the stop string here, so the action stays as sampled.

An action that ends without the stop string (end of turn, or the token cap) ends the episode. The
response's final answer is its last \\boxed{...}: the outcome rule reads it from the whole
response (actions and outputs, as ToRL's grader does, `response_answer`); the record's
`final_answer` is the last action's box (None without one; the episode then ends with termination
"no_answer").
"""
from __future__ import annotations

from typing import Optional, Sequence

from steprl_jax.agents.environments import ActionOutcome, Task
from steprl_jax.tools import code_format
from steprl_jax.tools.protocol import ToolCall, ToolResult
from steprl_jax.tools.registry import ToolRegistry

PYTHON_TOOL = "python"

# ToRL's instruction ("Please integrate natural language reasoning with programs to solve the
# problem above, and put your final answer within \boxed{}."), with the block convention spelled
# out for a chat model that has not been trained on it.
CODE_SYSTEM_PROMPT = (
    "Please integrate natural language reasoning with programs to solve the problem, and put your final "
    "answer within \\boxed{}. To run Python, write the code in a ```python ... ``` block, print what you "
    "need, and then write ```output on the next line: the output is shown to you, and you continue.")

NO_BLOCK = "Error: no complete ```python block before ```output; nothing was run"


def response_text(steps: Sequence) -> str:
    """The whole response of an episode: every action followed by its observation."""
    return "".join(s.action_text + s.observation_text for s in steps)


def response_answer(trajectory) -> Optional[str]:
    """ToRL's final answer: the last \\boxed{...} of the whole response (actions and outputs)."""
    return code_format.last_boxed(response_text(trajectory.steps))


class CodeEnv:
    """ToRL's code format over a registry holding the `python` tool (tools/python_sandbox.py)."""

    format = "code"
    stop_strings = (code_format.OUTPUT_STOP,)
    invalid_action = "error_observation"  # an action without a runnable block is shown an error

    def __init__(self, registry: ToolRegistry, *, max_tool_calls: int = 1,
                 system_prompt: str = CODE_SYSTEM_PROMPT, examples: Sequence = ()):
        """`examples`: worked demonstrations (`Demonstration`s in the code format) shown before the
        question as earlier user/assistant turns."""
        if PYTHON_TOOL not in registry.names:
            raise ValueError(f"the code format runs the {PYTHON_TOOL!r} tool; the registry has {registry.names}")
        if max_tool_calls < 0:
            raise ValueError(f"max_tool_calls must be >= 0, got {max_tool_calls}")
        self.registry = registry
        self.max_tool_calls = max_tool_calls
        self.system_prompt = system_prompt
        self.examples = tuple(examples)

    def messages(self, task: Task) -> list[dict]:
        messages = [{"role": "system", "content": self.system_prompt}]
        for demo in self.examples:
            messages.append({"role": "user", "content": demo.prompt})
            messages.append({"role": "assistant", "content": "".join(s.action + s.observation for s in demo.steps)})
        return messages + [{"role": "user", "content": task.question}]

    def tool_schemas(self, task: Task) -> Optional[list[dict]]:
        return None  # the convention is explained in the system prompt

    def registry_for(self, task: Task) -> ToolRegistry:
        return self.registry

    def release(self, task: Task) -> None:
        pass

    def parse(self, action_text: str) -> code_format.CodeAction:
        return code_format.parse_code_action(action_text)

    def calls_for(self, parsed: code_format.CodeAction) -> list[ToolCall]:
        if parsed.stopped and parsed.code is not None:
            return [ToolCall(PYTHON_TOOL, {"code": parsed.code})]
        return []

    def outcome(self, task: Task, parsed: code_format.CodeAction, results: Sequence[ToolResult]) -> ActionOutcome:
        """`results`: the runs the rollout made; none for a block past the call budget."""
        if not parsed.stopped:
            return ActionOutcome("answer", [], [], "", parsed.answer, [], {}, ends_episode=True)
        calls = self.calls_for(parsed)
        if not calls:
            observation = code_format.render_observation(NO_BLOCK, parsed.after_stop)
            return ActionOutcome("invalid", [], [], observation, None, ["no_code_block"], {})
        if not results:  # past the budget: nothing runs, the text goes on
            return ActionOutcome("text", [], [], "", None, [], {})
        result = results[0]
        shown = result.as_text() if result.ok else f"Error: {result.message} ({result.error_type})"
        observation = code_format.render_observation(code_format.format_output(shown), parsed.after_stop)
        return ActionOutcome("code", calls, list(results), observation, None, [], {})

    def observation_ids(self, tokenizer, text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False) if text else []

"""The code formats' environments: reasoning with Python blocks run by the `python` tool (a fresh
sandbox per run: stateless) in one assistant turn, each output masked from the loss.

* `CodeEnv` — ToRL (format "code"): blocks run at ```output (below).
* `CodeTurnsEnv` — SimpleTIR (format "code_turns"): turns end at the first complete block
  (tools/code_turns.py; see the class).

ToRL's environment, format "code":

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

from steprl_jax.agents.environments import ActionOutcome, Task, demonstrated_messages
from steprl_jax.sampling.stop import TwoPartStop
from steprl_jax.tools import code_format, code_turns
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


class _SandboxEnv:
    """What both code formats share: the `python` tool's registry, no tool schemas, token ids."""

    def __init__(self, registry: ToolRegistry):
        if PYTHON_TOOL not in registry.names:
            raise ValueError(f"the {self.format} format runs the {PYTHON_TOOL!r} tool; the registry has "
                             f"{registry.names}")
        self.registry = registry

    def tool_schemas(self, task: Task) -> Optional[list[dict]]:
        return None  # the convention is explained in the prompt

    def registry_for(self, task: Task) -> ToolRegistry:
        return self.registry

    def release(self, task: Task) -> None:
        pass

    def observation_ids(self, tokenizer, text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False) if text else []


class CodeEnv(_SandboxEnv):
    """ToRL's code format over a registry holding the `python` tool (tools/python_sandbox.py)."""

    format = "code"
    stop_strings = (code_format.OUTPUT_STOP,)
    invalid_action = "error_observation"  # an action without a runnable block is shown an error

    def __init__(self, registry: ToolRegistry, *, max_tool_calls: int = 1,
                 system_prompt: str = CODE_SYSTEM_PROMPT, examples: Sequence = ()):
        """`examples`: worked demonstrations (`Demonstration`s in the code format) shown before the
        question as earlier user/assistant turns."""
        super().__init__(registry)
        if max_tool_calls < 0:
            raise ValueError(f"max_tool_calls must be >= 0, got {max_tool_calls}")
        self.max_tool_calls = max_tool_calls
        self.system_prompt = system_prompt
        self.examples = tuple(examples)

    def messages(self, task: Task) -> list[dict]:
        return demonstrated_messages(self.system_prompt, self.examples, task.question)

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


# SimpleTIR's data.prompt (recipe/simpletir/config/simpletir_trainer.yaml), prepended to the question.
CODE_TURNS_PROMPT = (
    "Solve the following problem step by step. You now have the ability to selectively write executable Python "
    "code to enhance your reasoning process. The Python code will be executed by an external sandbox, and the "
    "output (after \"Code execution result: \") is returned to aid your reasoning and help you arrive at the final "
    "answer. The Python code should be complete scripts, including necessary imports.\n\n"
    "Code Format:\nEach code snippet is wrapped between ```. You need to use `print()` to output intermediate "
    "results.\n\n"
    "Answer Format:\nYou can use the `final_answer()` function in the code to return your final answer. For "
    "example, to answer the User Question: What is the result of the 5 + 3 + 1294.678?, you can write:\n"
    "```py\nanswer = 5 + 3 + 1294.678\nfinal_answer(answer)\n```\n\n"
    "You can also use \\boxed to return your answer. The last part of your response should be:\n"
    "\\boxed{'The final answer goes here.'}\n\nUser Question:\n")

# Generation stops at the end of the first complete code block (SimpleTIR cuts its turns there).
CODE_BLOCK_STOP = TwoPartStop(code_turns.BLOCK_OPENS, code_turns.BLOCK_CLOSE)
VOID_TURN = "void"  # the step kind of a turn with neither a complete block nor \boxed{


def render_run(result) -> str:
    """The `python` tool's text for the code_turns format: SimpleTIR's observation of a run
    (`code_turns.render_result`); the sandbox's error line (traceback's last line, timeout, limit,
    signal) stands for SimpleTIR's stderr."""
    return code_turns.render_result(result.stdout, result.error or "")


class CodeTurnsEnv(_SandboxEnv):
    """SimpleTIR's multi-turn code format (tools/code_turns.py) over a registry whose `python` tool
    renders runs with `render_run`. No system prompt: SimpleTIR's prompt opens the user message.

    A turn that stops at its first complete block has the block run (the snippet:
    `code_turns.snippet`) and its output appended to the SAME assistant turn (masked from the
    loss); the episode ends when the turn text (up to the block's end) or the output holds
    "\\boxed{" (final_answer prints it), and after a void turn (kind "void", no observation: the
    method masks the whole trajectory). The answer is the last \\boxed{} of the whole response
    (`response_answer`); the record's `final_answer`, the last box of the final turn's text and
    output. At most `rollout.max_steps` turns (SimpleTIR trains with 5).

    Departures from SimpleTIR: SimpleTIR drops the last turn's output at its turn cap, so a
    final_answer called in that turn does not count there; here it does (the step cap is the
    rollout's, the environment does not see it). A run that printed \\boxed{} and then failed ends
    SimpleTIR's episode (stdout is read apart from the error line it shows); here the tool returns
    the shown text only, so the episode goes on. SimpleTIR's stderr also holds warnings; the
    sandbox reports errors only. SimpleTIR's "\\n" observation after a void turn is not added
    (the episode has ended; it is not read)."""

    format = "code_turns"
    stop_strings = (CODE_BLOCK_STOP,)
    invalid_action = "end"

    def __init__(self, registry: ToolRegistry, *, prompt: str = CODE_TURNS_PROMPT):
        super().__init__(registry)
        self.prompt = prompt

    def messages(self, task: Task) -> list[dict]:
        return [{"role": "user", "content": self.prompt + task.question}]

    def parse(self, action_text: str) -> code_turns.Turn:
        return code_turns.parse_turn(action_text)

    def calls_for(self, parsed: code_turns.Turn) -> list[ToolCall]:
        return [] if parsed.code is None else [ToolCall(PYTHON_TOOL, {"code": code_turns.snippet(parsed.code)})]

    def outcome(self, task: Task, parsed: code_turns.Turn, results: Sequence[ToolResult]) -> ActionOutcome:
        text = parsed.text[:parsed.end]
        if parsed.void:
            return ActionOutcome(VOID_TURN, [], [], "", None, ["void_turn"], {}, ends_episode=True)
        if parsed.code is None:  # an answer without code
            return ActionOutcome("answer", [], [], "", code_format.last_boxed(text), [], {}, ends_episode=True)
        result = results[0] if results else None
        if result is None:
            shown = ""
        elif result.ok:
            shown = result.as_text()
        else:  # the sandbox could not run it (no free sandbox, a failed start): shown as an error line
            shown = code_turns.render_result("", f"Error: {result.message} ({result.error_type})")
        ends = parsed.boxed or code_turns.BOX_MARK in shown
        answer = code_format.last_boxed(text + shown) if ends else None
        return ActionOutcome("code", self.calls_for(parsed), list(results), shown, answer, [], {}, ends_episode=ends)

"""SimpleTIR's multi-turn code format (ltzheng/SimpleTIR, recipe/simpletir/agent_utils.py):
parsing (total, never raises) and rendering.

A turn is one generation call. It ends at the end of the FIRST complete code block (``` or
```py or ```python, a newline, the code, a newline, ```), at the end of the turn, or at the
token cap; the block's code runs on its own (no state from earlier turns) with SimpleTIR's
`final_answer` helper, which prints \\boxed{result}; the output continues the same assistant
turn as "\\nCode execution result: {output}\\n":

    I will compute it.
    ```py
    final_answer(6 * 7)
    ```
    Code execution result: \\boxed{42}     <- the observation (with a newline before and after)

The episode ends after a turn holding "\\boxed{" (its code, if any, still runs) or whose output
holds "\\boxed{"; a turn with neither a complete block nor "\\boxed{" is a void turn and ends it.

Where this departs from SimpleTIR: SimpleTIR samples each turn to its token cap and then cuts the
text after the first block (`_postprocess_responses`), re-tokenizing `preceding.strip() +
block.strip()`; here generation stops at the block's end (agents/code_env.py `CODE_BLOCK_STOP`,
exact on the decoded text) and the action stays the sampled tokens, so the whitespace before the
block is kept and at most the rest of the last token runs past it (`Turn.end` marks the cut).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

# The first complete block, as SimpleTIR's `execute_predictions` finds it (re.DOTALL).
CODE_BLOCK = re.compile(r"```(?:py|python)?\n(.*?)\n```", re.DOTALL)
# Generation stops where CODE_BLOCK first matches: after the first opening fence to complete,
# at the first "\n```" that follows it (the regex's leftmost match ends there too); the two parts
# of agents/code_env.py's `CODE_BLOCK_STOP` (sampling/stop.py `TwoPartStop`).
BLOCK_OPENS = ("```\n", "```py\n", "```python\n")
BLOCK_CLOSE = "\n```"
BOX_MARK = "\\boxed{"
# SimpleTIR prepends this to every snippet: final_answer(x) prints \boxed{x} and the run goes on.
FINAL_ANSWER_PRELUDE = '\ndef final_answer(result):\n    print(f"\\\\boxed{{{result}}}")\n'
RESULT_PREFIX = "\nCode execution result: "
MAX_OUTPUT_CHARS = 512


@dataclasses.dataclass(frozen=True)
class Turn:
    """One parsed turn. `code`: the first complete block's code, stripped (None without one);
    `end`: where the turn's text ends (just after that block, else the whole text); `boxed`:
    "\\boxed{" occurs in the text up to `end`; `void`: neither a block nor "\\boxed{"."""

    text: str
    code: Optional[str]
    end: int
    boxed: bool

    @property
    def void(self) -> bool:
        return self.code is None and not self.boxed


def parse_turn(text: Any) -> Turn:
    """The turn's first complete block and its box mark (see `Turn`). Non-text is a void turn."""
    if not isinstance(text, str):
        return Turn("", None, 0, False)
    match = CODE_BLOCK.search(text)
    end = match.end() if match else len(text)
    return Turn(text, match.group(1).strip() if match else None, end, BOX_MARK in text[:end])


def truncate_content(content: str, max_length: int = MAX_OUTPUT_CHARS) -> str:
    """SimpleTIR's `truncate_content`: longer than `max_length`, the first and last half of it
    around a note."""
    if len(content) <= max_length:
        return content
    half = max_length // 2
    return (content[:half] + f"\n..._This content has been truncated to stay below {max_length} characters_...\n"
            + content[-half:])


def render_result(stdout: str, stderr: str) -> str:
    """SimpleTIR's observation of a run: its stdout, or, when it wrote to stderr, the last line of
    stderr instead (both truncated to 512 characters), as "\\nCode execution result: ...\\n"; empty
    when the run printed nothing."""
    if stderr:
        return f"{RESULT_PREFIX}{truncate_content(chr(10).join(stderr.splitlines()[-1:]))}\n"
    if stdout:
        return f"{RESULT_PREFIX}{truncate_content(stdout)}\n"
    return ""


def snippet(code: str) -> str:
    """What runs for a turn's block: SimpleTIR's final_answer helper, then the code."""
    return FINAL_ANSWER_PRELUDE + code

